"""Invariant CPU ``linear`` on the exact-sum GEMM (see :func:`~rl_engine.backends.cpu.common.exact_matmul`).

Forward ``y = x Wᵀ + b``; backward ``dx = dy W`` (row invariant), ``dW = dyᵀ x`` and
``db = Σ_rows dy`` (they sum over rows, so they are not row invariant by nature; the exact sums
and :func:`fixed_order_sum` make them the same bits run to run, at any thread count and on
any instruction set).
Bias is added in the output dtype after the matmul, exactly as in the forward of every path.

fp32-output variant (``out_dtype=torch.float32`` for bf16 inputs, ``rlk::linear_cpu`` with
``fp32_out``): the exact sum rounded once to float32 (``exact_matmul(..., out_dtype=float32)``),
the bias added in fp32; its backward rounds the fp32 output gradient once to bf16 and runs the
bf16 backward.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_linear
from rl_engine.backends.cpu.common import exact_matmul
from rl_engine.utils.reductions import fixed_order_sum
from rl_engine.runtime.custom_ops import call_op
from rl_engine.runtime.registry import Implementation, register

_DTYPES = (torch.float32, torch.bfloat16)


def _forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool) -> torch.Tensor:
    y = exact_matmul(x2, weight, torch.float32 if fp32_out else None)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


@torch.library.custom_op("rlk::linear_cpu", mutates_args=(), device_types="cpu")
def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool = False) -> torch.Tensor:
    shape = x.shape
    y = _forward(x.reshape(-1, shape[-1]), weight, bias, fp32_out)
    return y.reshape(*shape[:-1], weight.shape[0])


@torch.library.custom_op("rlk::linear_cpu_backward", mutates_args=(), device_types="cpu")
def linear_cpu_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_dx: bool, need_dw: bool, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    N = weight.shape[0]
    g2 = grad.reshape(-1, N).to(x.dtype).contiguous()
    x2 = x.reshape(-1, K)
    dx = exact_matmul(g2, weight.t()).reshape(x.shape) if need_dx else x.new_empty((0,))
    gt = g2.t().contiguous()  # [N, M]
    dw = exact_matmul(gt, x2.t()) if need_dw else weight.new_empty((0,))  # [N, K], reduction over the M rows
    db = fixed_order_sum(gt.float()).to(x.dtype) if has_bias else x.new_empty((0,))
    return dx, dw, db


wire_linear(linear_cpu, linear_cpu_backward)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The registered entry (the reference's signature): ``rlk::linear_cpu`` (its body directly in
    a plain no-grad eager call: ``call_op``)."""
    return call_op(linear_cpu, x, weight, bias, out_dtype == torch.float32 and x.dtype != torch.float32)

register(
    Implementation(
        op="gemm.linear",
        impl_id="cpu.exact_sum",
        version="3",
        fn=linear,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "chunk", "run_to_run", "threads", "isa"}),
        priority=10,
        variants=frozenset({"fp32_out"}),
    )
)
