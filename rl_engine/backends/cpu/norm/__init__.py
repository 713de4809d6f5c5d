"""Invariant CPU ``rms_norm`` and ``fused_add_rms_norm``.

Forward, per row of ``x`` (``[M, H]`` after flattening the leading dims), following HF
``Qwen3RMSNorm``'s rounding points::

    h   = fp32(x)
    var = fixed_order_sum(h * h) / H          # fp32; torch's CPU mean is also sum / H
    r   = 1 / sqrt(var + eps)                 # two correctly rounded fp32 ops (HF: rsqrt)
    n   = round_to_x_dtype(h * r)             # HF: hidden.to(input_dtype)
    y   = round_to_x_dtype(fp32(weight) * fp32(n))

Backward (``g = fp32(dy) * fp32(weight)``, ``n̂ = h * r`` unrounded; the rounding of ``n`` is
treated as the identity, as autograd does for HF)::

    dx      = round(r * (g - n̂ * (fixed_order_sum(g * n̂) / H)))        # per row
    dweight = round(fixed_order_sum over rows of fp32(dy) * fp32(n))    # [H, M] transposed

``fixed_order_sum`` fixes the reduction order per row, and every other step is an elementwise
IEEE operation, so ``y`` and ``dx`` are row invariant; ``dweight`` sums over rows in a fixed
order (deterministic run to run). ``r`` is recomputed in backward with the same operations,
hence the same bits.
"""

from __future__ import annotations

import torch

from rl_engine.backends.cpu.common import fixed_order_sum
from rl_engine.runtime.registry import Implementation, register

_DTYPES = (torch.float32, torch.bfloat16)


def _rstd(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(fixed_order_sum(h²) / H + eps)`` per row of fp32 ``h`` ``[M, H]`` → ``[M, 1]``."""
    var = fixed_order_sum(h * h) / h.shape[-1]
    return torch.sqrt(var + eps).reciprocal().unsqueeze(-1)


def _forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x2.float()
    n = (h * _rstd(h, eps)).to(x2.dtype)
    return (weight.float() * n.float()).to(x2.dtype)


def _backward(
    grad2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, eps: float, extra: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x2.float()
    r = _rstd(h, eps)
    nhat = h * r
    gf = grad2.float()
    g = gf * weight.float()
    dot = fixed_order_sum(g * nhat) / h.shape[-1]
    dx = r * (g - nhat * dot.unsqueeze(-1))
    if extra is not None:
        dx = dx + extra.float()
    n = nhat.to(x2.dtype).float()
    dw = fixed_order_sum((gf * n).t().contiguous())
    return dx.to(x2.dtype), dw.to(weight.dtype)


# --------------------------------------------------------------------------- rms_norm


@torch.library.custom_op("rlk::rms_norm_cpu", mutates_args=(), device_types="cpu")
def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    H = x.shape[-1]
    return _forward(x.reshape(-1, H), weight, eps).reshape(x.shape)


@rms_norm_cpu.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("rlk::rms_norm_cpu_backward", mutates_args=(), device_types="cpu")
def rms_norm_cpu_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    dx, dw = _backward(grad.reshape(-1, H), x.reshape(-1, H), weight, eps, None)
    return dx.reshape(x.shape), dw


@rms_norm_cpu_backward.register_fake
def _(grad, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_cpu_backward(grad.contiguous(), x, weight, ctx.eps)
    return dx, dw, None


rms_norm_cpu.register_autograd(_rms_backward, setup_context=_rms_setup)


# --------------------------------------------------------------------------- fused_add_rms_norm


@torch.library.custom_op("rlk::fused_add_rms_norm_cpu", mutates_args=(), device_types="cpu")
def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    new_residual = (x.float() + residual.float()).to(x.dtype)
    out = _forward(new_residual.reshape(-1, H), weight, eps).reshape(x.shape)
    return out, new_residual


@fused_add_rms_norm_cpu.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("rlk::fused_add_rms_norm_cpu_backward", mutates_args=(), device_types="cpu")
def fused_add_rms_norm_cpu_backward(
    grad_out: torch.Tensor, grad_residual: torch.Tensor, new_residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    H = new_residual.shape[-1]
    dres, dw = _backward(
        grad_out.reshape(-1, H), new_residual.reshape(-1, H), weight, eps, grad_residual.reshape(-1, H)
    )
    return dres.reshape(new_residual.shape), dw


@fused_add_rms_norm_cpu_backward.register_fake
def _(grad_out, grad_residual, new_residual, weight, eps):
    return new_residual.new_empty(new_residual.shape), weight.new_empty(weight.shape)


def _fused_setup(ctx, inputs, output):
    _, _, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps


def _fused_backward(ctx, grad_out, grad_residual):
    new_residual, weight = ctx.saved_tensors
    dres, dw = fused_add_rms_norm_cpu_backward(
        grad_out.contiguous(), grad_residual.contiguous(), new_residual, weight, ctx.eps
    )
    # new_residual = x + residual: both inputs receive the same gradient.
    return dres, dres, dw, None


fused_add_rms_norm_cpu.register_autograd(_fused_backward, setup_context=_fused_setup)


register(
    Implementation(
        op="norm.rms_norm",
        impl_id="cpu.fixed_order",
        version="1",
        fn=rms_norm_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "run_to_run"}),
        priority=10,
    )
)

register(
    Implementation(
        op="norm.fused_add_rms_norm",
        impl_id="cpu.fixed_order",
        version="1",
        fn=fused_add_rms_norm_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "run_to_run"}),
        priority=10,
    )
)
