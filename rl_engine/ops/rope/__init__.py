"""Rotary position embedding entry points: ``apply_rope`` and its table ``rope_cos_sin``."""

from __future__ import annotations

import math

import torch

from rl_engine.utils.rope_tables import MAX_POSITION, rope_cos_sin, rope_inv_freq
from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import check_index_range, FLOAT_DTYPES, reads_back, require_same_device, require_tensor

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq", "MAX_POSITION"]


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, *, theta: float = 10000.0, rotary_dim: int | None = None
) -> torch.Tensor:
    r"""Rotate-half rotary position embedding at explicit positions (HF Qwen3/Llama layout).

    With ``R = rotary_dim`` (default ``D``), ``x_1 = x[..., :R/2]``, ``x_2 = x[..., R/2:R]``,
    ``θ_{t,i} = p_t · theta^{-2i/R}``:

    .. math:: \text{out}_1 = x_1 \cos θ - x_2 \sin θ, \qquad \text{out}_2 = x_2 \cos θ + x_1 \sin θ

    i.e. ``x·cos + rotate_half(x)·sin`` with cos/sin duplicated over the two halves; features
    ``R..D`` pass through unchanged. cos/sin are :func:`rope_cos_sin`: exact float64 angles and
    a float64 polynomial rounded once to fp32, depending only on ``(position, i)``; the
    rotation is fp32 and rounded once to ``x.dtype`` (HF casts cos/sin to ``x.dtype`` first
    and rounds each product, so bf16 results differ from HF by a bf16 ulp or so).

    Positions are explicit, so a decode token at position ``p`` gets exactly the bits of row
    ``p`` of a full prefill, and packed sequences simply carry their own positions.

    Shapes:
        x: ``[T, H, D]`` (tokens, heads, head_dim); positions: ``[T]`` int32/int64 in
        ``[0, 2^31)``; returns ``[T, H, D]`` in ``x.dtype``.

    Contract ``rope.apply_rope``: fp32 or bf16 (bf16 in and out, fp32 math); **row invariant**
    over tokens (with their positions) and deterministic run to run, forward and backward
    (``dx`` is the transposed rotation of ``dy``; positions get no gradient).

    Raises:
        TypeError / ValueError: ``x`` or ``positions`` has the wrong type, dtype, shape or
            device, is non-contiguous, contains NaN where the NaN policy scans it
            (:mod:`rl_engine.utils.checks`), a position is out of range, ``theta`` is
            not a finite float > 0, or ``rotary_dim`` is not an even int in ``[2, D]`` (the
            message names the argument). An out-of-range position on a GPU under the default
            policy, which reads nothing back, stops the process at a device-side assertion
            instead (``docs/design/host-path.md``).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3, finite=True)
    T, _, D = x.shape
    require_tensor("positions", positions, dtypes=(torch.int64, torch.int32), ndim=1)
    if positions.shape[0] != T:
        raise ValueError(f"positions: expected shape [{T}] (one position per token of x), got {tuple(positions.shape)}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta: expected a finite float > 0, got {theta!r}")
    R = D if rotary_dim is None else rotary_dim
    if isinstance(R, bool) or not isinstance(R, int) or R < 2 or R > D or R % 2:
        raise ValueError(f"rotary_dim: expected an even int in [2, {D}] (head_dim {D}), got {rotary_dim!r}")
    require_same_device(x=x, positions=positions)
    req = make_request("rope.apply_rope", x, features={"D": D, "rotary_dim": R})
    if reads_back(positions):
        check_index_range("positions", positions, MAX_POSITION, what="values")
    # else (a GPU under the default NaN policy): the table lookup, rope_cos_sin, asserts on the
    # device that every position lies in its device table, a tighter bound — one check, not two
    return dispatch(req, x, positions, float(theta), int(R))
