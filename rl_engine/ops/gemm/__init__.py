"""GEMM entry points."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, require_same_device, require_tensor

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    r"""Affine map ``y = x Wᵀ + b``.

    .. math:: y_{\dots, n} = \sum_{k} x_{\dots, k} W_{n, k} + b_n

    Shapes:
        x: ``[..., K]``; weight: ``[N, K]``; bias: ``[N]`` or ``None``; returns ``[..., N]``.

    Contract ``gemm.linear`` (``contracts/operators/gemm.linear.json``): fp32 or bf16, and fp16
    on CUDA/ROCm devices (16-bit in and out, fp32 accumulation); **row invariant** (output row
    depends only on its input row) and **chunk invariant** over output features (any slice of
    ``weight`` rows gives the same bits as the same columns of the full product); deterministic
    run to run; backward ``dx`` row invariant, ``dW``/``db`` deterministic.

    Raises:
        TypeError / ValueError: an argument has the wrong type, dtype, shape, device, is
            non-contiguous or contains NaN; ``K == 0`` (an empty reduction; message names the
            argument).
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
    req = make_request("gemm.linear", x, features={"K": x.shape[-1], "N": weight.shape[0], "bias": bias is not None})
    return dispatch(req, x, weight, bias)
