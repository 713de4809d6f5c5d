"""Triton mixture-of-experts operators for CUDA (ROCm declared, untested): ``moe.route``,
``moe.expert_gate_up``, ``moe.expert_down_combine``, forward and backward.

Same public semantics and rounding points as the CPU implementation (``backends/cpu/moe``): the
router's fp32 softmax, top-k by logit with ties to the lower expert id and rank-order
renormalisation; the gate/up GEMM rounded to the activation dtype, then ``silu_and_mul``; the
down GEMM in fp32 and the rank-order fp32 combine, rounded once; in the down projection's backward
the routing weight scales ``dact``'s fp32 GEMM result and ``dW_down``'s operand (rounded to the
activation dtype). The grouped GEMMs take the slots
in the canonical order (:func:`~rl_engine.utils.routing.expert_permutation`), ``BLOCK_M`` slots
of one expert per program, with a fixed K loop and no split-K or atomics (``kernels.py``), so a
token's bits do not depend on how many tokens its experts received: **row** and **chunk**
invariant, deterministic run to run. GPU and CPU bits need not agree (tensor-core products and
the GPU ``exp`` differ from the CPU's exact sums); both meet the contracts' tolerances.

Nothing here imports triton: the kernels are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_moe_expert_down_combine, wire_moe_expert_gate_up_saving, wire_moe_route
from rl_engine.backends.triton import register_triton
from rl_engine.runtime.custom_ops import call_op

__all__ = ["moe_route_triton", "moe_expert_gate_up_triton", "moe_expert_gate_up_triton_entry", "moe_expert_down_combine_triton"]

_DTYPES = (torch.float32, torch.bfloat16)
_GUARANTEES = frozenset({"row", "chunk", "run_to_run"})


def _kernels():
    from rl_engine.backends.triton.moe import kernels

    return kernels


@torch.library.custom_op("rlk::moe_route_triton", mutates_args=(), device_types="cuda")
def moe_route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().route_forward(logits, top_k, renormalize)


@torch.library.custom_op("rlk::moe_route_triton_backward", mutates_args=(), device_types="cuda")
def moe_route_triton_backward(grad: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    return _kernels().route_backward(grad, logits, ids, renormalize)


wire_moe_route(moe_route_triton, moe_route_triton_backward)


@torch.library.custom_op("rlk::moe_expert_gate_up_triton", mutates_args=(), device_types="cuda")
def moe_expert_gate_up_triton(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act, h)``: the activations and the gate/up GEMM result they come from, which the
    backward reads instead of recomputing the GEMM (:func:`moe_expert_gate_up_triton_entry`
    returns ``act``)."""
    return _kernels().gate_up_forward_saving(x, w_gate_up, ids)


@torch.library.custom_op("rlk::moe_expert_gate_up_triton_backward", mutates_args=(), device_types="cuda")
def moe_expert_gate_up_triton_backward(grad: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor,
                                       ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().gate_up_backward(grad, x, w_gate_up, ids, h=h)


wire_moe_expert_gate_up_saving(moe_expert_gate_up_triton, moe_expert_gate_up_triton_backward)


def moe_expert_gate_up_triton_entry(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The registry entry of ``moe.expert_gate_up``: the custom op's ``act``."""
    return call_op(moe_expert_gate_up_triton, x, w_gate_up, ids)[0]


moe_expert_gate_up_triton_entry._init_fn = moe_expert_gate_up_triton._init_fn  # provenance: this module


@torch.library.custom_op("rlk::moe_expert_down_combine_triton", mutates_args=(), device_types="cuda")
def moe_expert_down_combine_triton(act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                                   ids: torch.Tensor) -> torch.Tensor:
    return _kernels().down_combine_forward(act, w_down, weights, ids)


@torch.library.custom_op("rlk::moe_expert_down_combine_triton_backward", mutates_args=(), device_types="cuda")
def moe_expert_down_combine_triton_backward(grad: torch.Tensor, act: torch.Tensor, w_down: torch.Tensor,
                                            weights: torch.Tensor, ids: torch.Tensor
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels().down_combine_backward(grad, act, w_down, weights, ids)


wire_moe_expert_down_combine(moe_expert_down_combine_triton, moe_expert_down_combine_triton_backward)

for _op, _fn, _version in (("moe.route", moe_route_triton, "1"), ("moe.expert_gate_up", moe_expert_gate_up_triton_entry, "1"),
                           ("moe.expert_down_combine", moe_expert_down_combine_triton, "2")):
    register_triton(_op, "triton.grouped", _fn, dtypes=_DTYPES, guarantees=_GUARANTEES, version=_version)
