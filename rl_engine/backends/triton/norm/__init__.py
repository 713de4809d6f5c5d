"""Triton ``norm.rms_norm`` and ``norm.fused_add_rms_norm`` for CUDA (validated on sm90) and ROCm
(declared, untested).

The public semantics are those of the CPU implementation (``rl_engine/backends/cpu/norm``),
with the same rounding points: ``h = fp32(x)`` (fused: ``h = fp32(round(x + residual))``),
``r = 1 / sqrt(Σ h² / H + eps)`` with correctly rounded ``/`` and ``sqrt``, ``n = round(h·r)``,
``y = round(w·n)``; backward ``dx = round(r (g − n̂ Σ(g n̂)/H) [+ dresidual])`` with
``g = dy·w``, and ``dweight = round(Σ_rows dy·n)``.

Invariance on the GPU: one program per row with reductions in a fixed chunk order whose width
depends only on ``H`` (``kernels.block_of``), so ``y`` and ``dx`` are **row invariant**;
``dweight`` is reduced per fixed row tile, then over tiles in tile order — no atomics, so
**deterministic run to run**. GPU and CPU bits need not agree (``tl.sum``'s tree differs from
``fixed_order_sum``); each platform is invariant and both meet the contract's tolerances.

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_fused_add_rms_norm, wire_rms_norm
from rl_engine.backends.triton import register_triton

__all__ = ["rms_norm_triton", "fused_add_rms_norm_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.triton.norm import kernels

    return kernels


# --------------------------------------------------------------------------- rms_norm


@torch.library.custom_op("rlk::rms_norm_triton", mutates_args=(), device_types="cuda")
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    H = x.shape[-1]
    y, _ = _kernels().forward(x.reshape(-1, H), weight, eps)
    return y.reshape(x.shape)


@torch.library.custom_op("rlk::rms_norm_triton_backward", mutates_args=(), device_types="cuda")
def rms_norm_triton_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    dx, dw = _kernels().backward(grad.reshape(-1, H), x.reshape(-1, H), weight, eps)
    return dx.reshape(x.shape), dw


wire_rms_norm(rms_norm_triton, rms_norm_triton_backward)


# --------------------------------------------------------------------------- fused_add_rms_norm


@torch.library.custom_op("rlk::fused_add_rms_norm_triton", mutates_args=(), device_types="cuda")
def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    H = x.shape[-1]
    out, new_res = _kernels().forward(x.reshape(-1, H), weight, eps, residual.reshape(-1, H))
    return out.reshape(x.shape), new_res.reshape(x.shape)


@torch.library.custom_op("rlk::fused_add_rms_norm_triton_backward", mutates_args=(), device_types="cuda")
def fused_add_rms_norm_triton_backward(
    grad_out: torch.Tensor, grad_residual: torch.Tensor, new_residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    H = new_residual.shape[-1]
    dres, dw = _kernels().backward(
        grad_out.reshape(-1, H), new_residual.reshape(-1, H), weight, eps, grad_residual.reshape(-1, H)
    )
    return dres.reshape(new_residual.shape), dw


wire_fused_add_rms_norm(fused_add_rms_norm_triton, fused_add_rms_norm_triton_backward)


for _op, _fn in (("norm.rms_norm", rms_norm_triton), ("norm.fused_add_rms_norm", fused_add_rms_norm_triton)):
    register_triton(
        _op, "triton.row_program", _fn, dtypes=_DTYPES, guarantees=frozenset({"row", "run_to_run"})
    )
