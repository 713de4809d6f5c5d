"""Triton ``gemm.linear`` for CUDA (validated on sm90) and ROCm (declared, untested).

Forward ``y = x Wᵀ + b``: one tile kernel, no split-K, the K dimension consumed in one fixed
order with fp32 accumulation, the bias added in fp32 in the epilogue and one rounding to the
output dtype (fp32 inputs use IEEE fma, never TF32). The tile configuration follows M
(``configs.py``); every configuration performs the same per-element arithmetic, so the result
is **row invariant** and **column-chunk invariant** (tests/backends/triton/ prove it on
the device for every shipped configuration).

Backward ``dx = dy W`` (same tile kernel, configuration from M: row invariant), ``dW = dyᵀ x``
(reduction over the rows in increasing order) and ``db = Σ_rows dy`` (fixed order):
deterministic run to run.

fp32-output variant (``out_dtype=torch.float32`` for 16-bit inputs, ``fp32_out``): the fp32
accumulator stored unrounded; the backward rounds the fp32 output gradient once to the input
dtype and runs the 16-bit backward.

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_linear
from rl_engine.backends.triton import arch_reasons, unavailable_reasons
from rl_engine.runtime.custom_ops import call_op
from rl_engine.runtime.registry import Implementation, Request, register

__all__ = ["linear_triton", "linear"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from rl_engine.backends.triton.gemm import kernels

    return kernels


@torch.library.custom_op("rlk::linear_triton", mutates_args=(), device_types="cuda")
def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool = False) -> torch.Tensor:
    shape = x.shape
    y = _kernels().forward(x.reshape(-1, shape[-1]), weight, bias, out_dtype=torch.float32 if fp32_out else None)
    return y.reshape(*shape[:-1], weight.shape[0])


@torch.library.custom_op("rlk::linear_triton_backward", mutates_args=(), device_types="cuda")
def linear_triton_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_dx: bool, need_dw: bool, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = _kernels()
    K = x.shape[-1]
    N = weight.shape[0]
    g2 = grad.reshape(-1, N)
    if g2.dtype != x.dtype:  # the fp32-output variant: its gradient rounded once to the input dtype
        g2 = g2.to(x.dtype)
    x2 = x.reshape(-1, K)
    dx = k.grad_input(g2, weight).reshape(x.shape) if need_dx else x.new_empty((0,))
    dw = k.grad_weight(g2, x2) if need_dw else weight.new_empty((0,))
    db = k.grad_bias(g2) if has_bias else grad.new_empty((0,))
    return dx, dw, db


wire_linear(linear_triton, linear_triton_backward)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The registered entry (same signature as the reference): calls ``rlk::linear_triton``
    (directly in a plain no-grad eager call: ``call_op``)."""
    return call_op(linear_triton, x, weight, bias, out_dtype == torch.float32 and x.dtype != torch.float32)


def _call_reasons(request: Request) -> list[str]:
    return arch_reasons(request.platform.family, request.platform.arch)


register(
    Implementation(
        op="gemm.linear",
        impl_id="triton.tile_gemm",
        version="1",
        fn=linear,
        families=("cuda", "rocm"),
        untested_families=("rocm",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "chunk", "run_to_run"}),
        priority=5,
        static_check=unavailable_reasons,
        call_check=_call_reasons,
        variants=frozenset({"fp32_out"}),
    )
)
