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

from rl_engine.backends._customop import wire_silu_and_mul
from rl_engine.backends.triton import register_triton

__all__ = ["silu_and_mul_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.triton.activation import kernels

    return kernels


@torch.library.custom_op("rlk::silu_and_mul_triton", mutates_args=(), device_types="cuda")
def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return _kernels().forward(x.reshape(-1, n)).reshape(*x.shape[:-1], n // 2)


@torch.library.custom_op("rlk::silu_and_mul_triton_backward", mutates_args=(), device_types="cuda")
def silu_and_mul_triton_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    return _kernels().backward(grad.reshape(-1, n // 2), x.reshape(-1, n)).reshape(x.shape)


wire_silu_and_mul(silu_and_mul_triton, silu_and_mul_triton_backward)


register_triton(
    "activation.silu_and_mul",
    "triton.elementwise",
    silu_and_mul_triton,
    dtypes=_DTYPES,
    guarantees=frozenset({"row", "chunk", "run_to_run"}),
)
