"""Triton ``activation.silu_and_mul`` for CUDA (validated on sm90) and ROCm (declared, untested).

Same public semantics and rounding points as the CPU implementation
(``rl_engine/backends/cpu/activation``): fp32 math from the widened halves, ``silu(a) = a / (1 +
exp(-a))`` with a correctly rounded division, one rounding to ``x.dtype``; backward
``da = (g·b)·(s·(1 + a(1 − s)))``, ``db = g·silu``. Elementwise, so **row** and **chunk
invariant** on the GPU by construction, and deterministic (GPU ``exp`` differs from the CPU's,
so GPU and CPU bits need not agree; both meet the contract's tolerances).

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends.shared.triton import arch_reasons, unavailable_reasons
from rl_engine.runtime.registry import Implementation, Request, register

__all__ = ["silu_and_mul_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.shared.triton.activation import kernels

    return kernels


@torch.library.custom_op("rlk::silu_and_mul_triton", mutates_args=(), device_types="cuda")
def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return _kernels().forward(x.reshape(-1, n)).reshape(*x.shape[:-1], n // 2)


@silu_and_mul_triton.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("rlk::silu_and_mul_triton_backward", mutates_args=(), device_types="cuda")
def silu_and_mul_triton_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return _kernels().backward(grad.reshape(-1, n // 2), x.reshape(-1, n)).reshape(x.shape)


@silu_and_mul_triton_backward.register_fake
def _(grad, x):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return silu_and_mul_triton_backward(grad.contiguous(), x)


silu_and_mul_triton.register_autograd(_backward, setup_context=_setup)


def _call_reasons(request: Request) -> list[str]:
    return arch_reasons(request.platform.family, request.platform.arch)


register(
    Implementation(
        op="activation.silu_and_mul",
        impl_id="triton.elementwise",
        version="1",
        fn=silu_and_mul_triton,
        families=("cuda", "rocm"),
        untested_families=("rocm",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "chunk", "run_to_run"}),
        priority=5,
        static_check=unavailable_reasons,
        call_check=_call_reasons,
    )
)
