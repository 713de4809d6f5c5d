"""Triton ``rope.apply_rope`` for CUDA (validated on sm90) and ROCm (declared, untested).

Same public semantics as the CPU implementation (``rl_engine/backends/cpu/rope``): the fp32
table ``(cos, sin) = rope_cos_sin(positions, R, theta)`` — defined bit for bit by
:mod:`rl_engine.ops.rope.tables` from float64 ``+ - *`` (no libm), computed here on the GPU by
torch's elementwise float64 ops and so the same bits as on the CPU — then the rotate-half
rotation in fp32, rounded once to ``x.dtype``; backward is the transposed rotation of ``dy``.
**Row invariant** over tokens (with their positions) and deterministic, forward and backward.

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends.shared.triton import arch_reasons, unavailable_reasons
from rl_engine.ops.rope.tables import rope_cos_sin
from rl_engine.runtime.registry import Implementation, Request, register

__all__ = ["apply_rope_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.shared.triton.rope import kernels

    return kernels


def _rotate(x, positions, theta, rotary_dim, transpose):
    cos, sin = rope_cos_sin(positions, rotary_dim, theta)
    return _kernels().rotate(x, cos.contiguous(), sin.contiguous(), rotary_dim, transpose)


@torch.library.custom_op("rlk::apply_rope_triton", mutates_args=(), device_types="cuda")
def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    return _rotate(x, positions, theta, rotary_dim, transpose=False)


@apply_rope_triton.register_fake
def _(x, positions, theta, rotary_dim):
    return x.new_empty(x.shape)


@torch.library.custom_op("rlk::apply_rope_triton_backward", mutates_args=(), device_types="cuda")
def apply_rope_triton_backward(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    return _rotate(grad, positions, theta, rotary_dim, transpose=True)


@apply_rope_triton_backward.register_fake
def _(grad, positions, theta, rotary_dim):
    return grad.new_empty(grad.shape)


def _setup(ctx, inputs, output):
    _, positions, theta, rotary_dim = inputs
    ctx.save_for_backward(positions)
    ctx.theta = theta
    ctx.rotary_dim = rotary_dim


def _backward(ctx, grad):
    (positions,) = ctx.saved_tensors
    return apply_rope_triton_backward(grad.contiguous(), positions, ctx.theta, ctx.rotary_dim), None, None, None


apply_rope_triton.register_autograd(_backward, setup_context=_setup)


def _call_reasons(request: Request) -> list[str]:
    return arch_reasons(request.platform.family, request.platform.arch)


register(
    Implementation(
        op="rope.apply_rope",
        impl_id="triton.exact_table",
        version="1",
        fn=apply_rope_triton,
        families=("cuda", "rocm"),
        untested_families=("rocm",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "run_to_run"}),
        priority=5,
        static_check=unavailable_reasons,
        call_check=_call_reasons,
    )
)
