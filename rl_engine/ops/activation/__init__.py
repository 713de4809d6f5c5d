"""Activation entry points: ``silu_and_mul`` (the gated MLP activation of Qwen3/Llama)."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, require_tensor

__all__ = ["silu_and_mul"]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    r"""Gated SiLU: the first half of the last dimension gates the second.

    .. math:: y = \operatorname{silu}(a) \odot b, \quad \operatorname{silu}(a) = \frac{a}{1 + e^{-a}},
        \quad a = x_{\dots, :d},\; b = x_{\dots, d:}

    Computed in fp32 from the widened inputs and rounded once to ``x.dtype`` (HF and vLLM
    round ``silu(a)`` to the activation dtype before the product; in bf16 the results differ
    by at most one bf16 ulp, in fp32 they agree up to the ``exp`` implementation).

    Shapes:
        x: ``[..., 2d]`` (gate columns first, as a fused ``gate_up_proj`` output); returns
        ``[..., d]`` in ``x.dtype``.

    Contract ``activation.silu_and_mul``: fp32 or bf16 (bf16 in and out, fp32 math);
    **row invariant** and **chunk invariant** (elementwise: any slice of rows, or the same
    feature columns of both halves, gives the same bits); deterministic run to run; the same
    for the gradient.

    Raises:
        TypeError / ValueError: ``x`` has the wrong type or dtype, is 0-dimensional,
            non-contiguous, contains NaN where the NaN policy scans it (:mod:`rl_engine.utils.checks`),
            or its last dim is odd or 0 (the message names it).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1, finite=True)
    n = x.shape[-1]
    if n == 0 or n % 2:
        raise ValueError(f"x: expected a positive even last dimension 2d, got shape {tuple(x.shape)}")
    req = make_request("activation.silu_and_mul", x, features={"d": n // 2})
    return dispatch(req, x)
