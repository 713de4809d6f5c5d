"""Triton ``rope.apply_rope`` for CUDA (validated on sm90) and ROCm (declared, untested).

Same public semantics as the CPU implementation (``rl_engine/backends/cpu/rope``): the fp32
table ``(cos, sin) = rope_cos_sin(positions, R, theta)`` — defined bit for bit by
:mod:`rl_engine.utils.rope_tables` from float64 ``+ - *`` (no libm), computed here on the GPU by
torch's elementwise float64 ops and so the same bits as on the CPU — then the rotate-half
rotation in fp32, rounded once to ``x.dtype``; backward is the transposed rotation of ``dy``.
**Row invariant** over tokens (with their positions) and deterministic, forward and backward.

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_apply_rope
from rl_engine.backends.triton import register_triton
from rl_engine.utils.rope_tables import rope_cos_sin

__all__ = ["apply_rope_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.triton.rope import kernels

    return kernels


def _rotate(x, positions, theta, rotary_dim, transpose):
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    return _kernels().rotate(x, cos.contiguous(), sin.contiguous(), rotary_dim, transpose)


@torch.library.custom_op("rlk::apply_rope_triton", mutates_args=(), device_types="cuda")
def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    return _rotate(x, positions, theta, rotary_dim, transpose=False)


@torch.library.custom_op("rlk::apply_rope_triton_backward", mutates_args=(), device_types="cuda")
def apply_rope_triton_backward(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    return _rotate(grad, positions, theta, rotary_dim, transpose=True)


wire_apply_rope(apply_rope_triton, apply_rope_triton_backward)


register_triton(
    "rope.apply_rope",
    "triton.exact_table",
    apply_rope_triton,
    dtypes=_DTYPES,
    guarantees=frozenset({"row", "run_to_run"}),
)
