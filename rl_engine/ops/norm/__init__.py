"""Normalisation entry points: ``rms_norm`` and ``fused_add_rms_norm``."""

from __future__ import annotations

import math

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, require_same_device, require_tensor

__all__ = ["rms_norm", "fused_add_rms_norm"]


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a finite float > 0, got {eps!r}")
    return float(eps)


def _check_x_weight(x: torch.Tensor, weight: torch.Tensor) -> int:
    require_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1, finite=True)
    H = x.shape[-1]
    if H == 0:
        raise ValueError(f"x: expected a non-empty last dimension, got shape {tuple(x.shape)}")
    require_tensor("weight", weight, dtypes=(x.dtype,), ndim=1, finite="param")
    if weight.shape[0] != H:
        raise ValueError(f"weight: expected shape [{H}] to match x's last dim, got {tuple(weight.shape)}")
    return H


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    r"""Root-mean-square normalisation over the last dimension (HF ``Qwen3RMSNorm`` semantics).

    .. math:: y = w \odot \operatorname{round}\Big(x \big/ \sqrt{\tfrac{1}{H}\textstyle\sum_k x_k^2 + \varepsilon}\Big)

    Rounding points (the same as HF's ``hidden.float()``, ``h * rsqrt(var + eps)``,
    ``weight * h.to(input_dtype)``): ``x`` is widened to fp32; the sum of squares, ``var = sum / H``
    and ``r = 1 / sqrt(var + eps)`` are fp32 (HF's ``rsqrt`` is replaced by two correctly rounded
    operations); ``n = x · r`` is rounded to ``x.dtype``; ``y = weight · n`` is rounded to
    ``x.dtype`` once more. For fp32 inputs the two roundings to ``x.dtype`` are no-ops.

    Shapes:
        x: ``[..., H]``; weight: ``[H]``; returns ``[..., H]`` in ``x.dtype``.

    Contract ``norm.rms_norm``: fp32 or bf16 (bf16 in and out, fp32 math); **row invariant**
    (a row's output depends only on that row: the sum of squares uses one fixed order
    independent of the batch); deterministic run to run. Backward: ``dx`` row invariant,
    ``dweight`` (a sum over rows in a fixed order) deterministic.

    Raises:
        TypeError / ValueError: ``x`` or ``weight`` has the wrong type, dtype, shape or device,
            is non-contiguous or contains NaN where the NaN policy scans it (``weight`` only under
            ``"raise_all"``: :mod:`rl_engine.utils.checks`), ``x``'s last dim is 0, or ``eps`` is
            not a finite float > 0 (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    H = _check_x_weight(x, weight)
    eps = _check_eps(eps)
    require_same_device(x=x, weight=weight)
    req = make_request("norm.rms_norm", x, features={"H": H})
    return dispatch(req, x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Residual add followed by :func:`rms_norm` (vLLM's ``fused_add_rms_norm``, out of place).

    .. math:: r' = \operatorname{round}(x + r), \qquad \text{out} = \operatorname{rms\_norm}(r', w, \varepsilon)

    ``x + residual`` is one fp32 addition rounded once to ``x.dtype`` (the residual stream is
    kept in the activation dtype, as in vLLM and HF); ``out`` is then bit for bit
    ``rms_norm(new_residual, weight, eps)``, so the fused call equals add-then-norm.

    Shapes:
        x, residual: ``[..., H]`` (same shape and dtype); weight: ``[H]``; returns
        ``(out, new_residual)``, both ``[..., H]`` in ``x.dtype``.

    Contract ``norm.fused_add_rms_norm``: fp32 or bf16; **row invariant** and deterministic,
    forward and backward (``dx = dresidual`` row invariant, ``dweight`` deterministic).

    Raises:
        TypeError / ValueError: as :func:`rms_norm`, and ``residual`` not matching ``x`` in
            dtype, shape or device.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    H = _check_x_weight(x, weight)
    require_tensor("residual", residual, dtypes=(x.dtype,), finite=True)
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected shape {tuple(x.shape)} (the shape of x), got {tuple(residual.shape)}")
    eps = _check_eps(eps)
    require_same_device(x=x, residual=residual, weight=weight)
    req = make_request("norm.fused_add_rms_norm", x, features={"H": H})
    return dispatch(req, x, residual, weight, eps)
