"""GEMM entry points."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, require_same_device, require_tensor

__all__ = ["linear", "check_out_dtype"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    r"""Affine map ``y = x Wᵀ + b``.

    .. math:: y_{\dots, n} = \sum_{k} x_{\dots, k} W_{n, k} + b_n

    Shapes:
        x: ``[..., K]``; weight: ``[N, K]``; bias: ``[N]`` or ``None``; returns ``[..., N]``.

    Args:
        out_dtype: ``None`` (or ``x.dtype``): the output has ``x``'s dtype. ``torch.float32``
            with 16-bit inputs — the **fp32-output variant** (an fp32 LM head: bf16 hidden
            states and weight in, fp32 logits out): the same sum, rounded once to float32
            instead of to the input dtype, the bias added in fp32. Its backward rounds the fp32
            output gradient once to the input dtype and runs the 16-bit backward.

    Contract ``gemm.linear`` (``contracts/operators/gemm.linear.json``): fp32 or bf16, and fp16
    on CUDA/ROCm devices (16-bit in and out, fp32 accumulation); **row invariant** (output row
    depends only on its input row) and **chunk invariant** over output features (any slice of
    ``weight`` rows gives the same bits as the same columns of the full product); deterministic
    run to run; backward ``dx`` row invariant, ``dW``/``db`` deterministic.

    Raises:
        TypeError / ValueError: an argument has the wrong type, dtype, shape, device, is
            non-contiguous or contains NaN where the NaN policy scans it (``x``; ``weight`` and
            ``bias`` only under ``"raise_all"``: :mod:`rl_engine.utils.checks`); ``K == 0`` (an
            empty reduction); ``out_dtype`` other than ``None``, ``x.dtype`` or ``torch.float32``
            (message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    # float16 only where an implementation has it (the Triton GPU backend); CPU: fp32/bf16.
    gpu = isinstance(x, torch.Tensor) and x.device.type == "cuda"
    require_tensor("x", x, dtypes=FLOAT_DTYPES + ((torch.float16,) if gpu else ()), min_ndim=1, finite=True)
    require_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, finite="param")
    if x.shape[-1] == 0:
        raise ValueError(f"x: expected a last (reduction) dimension K >= 1, got shape {tuple(x.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [N, {x.shape[-1]}] to match x's last dim, got {tuple(weight.shape)}")
    if bias is not None:
        require_tensor("bias", bias, dtypes=(x.dtype,), ndim=1, finite="param")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias: expected shape [{weight.shape[0]}], got {tuple(bias.shape)}")
    require_same_device(x=x, weight=weight, bias=bias)
    out = check_out_dtype("out_dtype", out_dtype, x.dtype)
    features = {"K": x.shape[-1], "N": weight.shape[0], "bias": bias is not None}
    if out is None:
        req = make_request("gemm.linear", x, features=features)
        return dispatch(req, x, weight, bias)
    req = make_request("gemm.linear", x, features=features, variants=frozenset({"fp32_out"}))
    return dispatch(req, x, weight, bias, out_dtype=out)


def check_out_dtype(name: str, out_dtype: object, in_dtype: torch.dtype) -> torch.dtype | None:
    """``None`` when ``out_dtype`` asks for the input dtype, ``torch.float32`` for the fp32-output
    variant of 16-bit inputs; anything else raises ``ValueError`` naming ``name``."""
    if out_dtype is None or out_dtype == in_dtype:
        return None
    if out_dtype != torch.float32:
        raise ValueError(f"{name}: expected None, the input dtype ({in_dtype}) or torch.float32, got {out_dtype!r}")
    return torch.float32
