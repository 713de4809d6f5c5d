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

from rl_engine.backends._customop import wire_fused_add_rms_norm, wire_rms_norm
from rl_engine.utils.reductions import fixed_order_sum
from rl_engine.runtime.registry import Implementation, register
from rl_engine.utils import portable

_DTYPES = (torch.float32, torch.bfloat16)


def _rstd(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(fixed_order_sum(h²) / H + eps)`` per row of fp32 ``h`` ``[M, H]`` → ``[M, 1]``."""
    var = fixed_order_sum(h * h) / h.shape[-1]
    return portable.sqrt(var + eps).reciprocal().unsqueeze(-1)


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


@torch.library.custom_op("rlk::rms_norm_cpu_backward", mutates_args=(), device_types="cpu")
def rms_norm_cpu_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    dx, dw = _backward(grad.reshape(-1, H), x.reshape(-1, H), weight, eps, None)
    return dx.reshape(x.shape), dw


wire_rms_norm(rms_norm_cpu, rms_norm_cpu_backward)


# --------------------------------------------------------------------------- fused_add_rms_norm


@torch.library.custom_op("rlk::fused_add_rms_norm_cpu", mutates_args=(), device_types="cpu")
def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    new_residual = (x.float() + residual.float()).to(x.dtype)
    out = _forward(new_residual.reshape(-1, H), weight, eps).reshape(x.shape)
    return out, new_residual


@torch.library.custom_op("rlk::fused_add_rms_norm_cpu_backward", mutates_args=(), device_types="cpu")
def fused_add_rms_norm_cpu_backward(
    grad_out: torch.Tensor, grad_residual: torch.Tensor, new_residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    H = new_residual.shape[-1]
    dres, dw = _backward(
        grad_out.reshape(-1, H), new_residual.reshape(-1, H), weight, eps, grad_residual.reshape(-1, H)
    )
    return dres.reshape(new_residual.shape), dw


wire_fused_add_rms_norm(fused_add_rms_norm_cpu, fused_add_rms_norm_cpu_backward)


for _op, _fn in (("norm.rms_norm", rms_norm_cpu), ("norm.fused_add_rms_norm", fused_add_rms_norm_cpu)):
    register(
        Implementation(
            op=_op,
            impl_id="cpu.fixed_order",
            version="2",
            fn=_fn,
            families=("cpu",),
            dtypes=_DTYPES,
            guarantees=frozenset({"row", "run_to_run", "threads", "isa"}),
            priority=10,
        )
    )
