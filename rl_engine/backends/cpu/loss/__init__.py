"""Portable loss-family implementations (plain PyTorch, any device), registered for CPU and —
untested there by CI — CUDA and ROCm.

The loss family is small-tensor math: elementwise terms, per-sequence reductions, a sort over
sequences. It needs no BLAS and no vendor kernel, so one implementation serves every device; its
invariances come from the reduction order (:mod:`rl_engine.utils.reductions`), not from the
hardware. It lives in the CPU package because CPU is where it is validated; the registry lists
this package last for GPU families, so a dedicated GPU implementation would take precedence.

* ``loss.policy``, ``loss.kl``, ``loss.aggregate`` — custom ops with autograd (:mod:`.token`);
* ``loss.advantages`` — :mod:`.advantages`; ``loss.rollout_correction`` — :mod:`.correction`
  (no gradients, plain functions).
"""

from __future__ import annotations

import torch

from rl_engine.backends.cpu.loss.advantages import advantages_portable
from rl_engine.backends.cpu.loss.correction import rollout_correction_portable
from rl_engine.backends.cpu.loss.token import loss_kl, loss_masked_row_sum, loss_policy
from rl_engine.runtime.registry import Implementation, register

_DTYPES = (torch.float32, torch.bfloat16)
_FAMILIES = ("cpu", "cuda", "rocm")
_UNTESTED = ("cuda", "rocm")

_TOKEN_LOSS = frozenset({"row", "chunk", "layout", "run_to_run", "threads", "isa"})

for _op, _fn, _guarantees in (
    ("loss.policy", loss_policy, _TOKEN_LOSS),
    ("loss.kl", loss_kl, _TOKEN_LOSS),
    ("loss.aggregate", loss_masked_row_sum, _TOKEN_LOSS),
    # a sample's advantage depends on its group: permutation/padding invariant, not row invariant
    ("loss.advantages", advantages_portable, frozenset({"layout", "run_to_run", "threads", "isa"})),
    ("loss.rollout_correction", rollout_correction_portable, frozenset({"row", "layout", "run_to_run", "threads", "isa"})),
):
    register(
        Implementation(
            op=_op,
            impl_id="portable.fixed_order",
            version="2",
            fn=_fn,
            families=_FAMILIES,
            dtypes=_DTYPES,
            guarantees=_guarantees,
            priority=50,
            untested_families=_UNTESTED,
        )
    )
