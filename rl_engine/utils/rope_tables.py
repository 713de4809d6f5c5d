"""The RoPE cos/sin table, defined bit for bit.

The table is part of the operator's definition: the entry point (:mod:`rl_engine.ops.rope`) and
every backend import it from here, below both. For rotary dimension ``R`` and base ``theta``:

* ``inv_freq_i = 1 / theta^(2i/R)`` for ``i < R/2`` in float64: ``e = fl(2i/R)``, the power
  ``theta^e`` evaluated in 40-digit decimal arithmetic (Python's ``decimal``: integer
  arithmetic, the same digits on every machine, where the C library's ``pow`` picks a code
  path by CPU) and rounded to float64, then one IEEE division — HF computes the same exponent
  ``2i/R``, in fp32;
* ``angle = float64(position) · inv_freq_i``: one correctly rounded float64 product;
* ``cos(angle)``, ``sin(angle)`` from float64 ``+ - *`` only: Cody–Waite reduction
  ``r = angle - k·π/2`` (``k = round(angle · 2/π)``, π/2 split into four 20-bit pieces, exact
  products for ``k < 2^33``, plus a float64 tail), Taylor polynomials of degree 17 (sin) and 18
  (cos) on ``|r| ≲ π/4`` in Horner form (truncation error below 1e-18), and the quadrant from
  ``k mod 4``;
* one rounding to fp32.

Tables for positions ``0..N-1`` are cached per ``(R, theta, device)`` (at most
:data:`CACHE_ELEMENTS` entries each) and gathered by position; a call whose largest position is
beyond the cacheable range computes its entries directly. Both give the same bits, because
every entry is a function of ``(position, i)`` alone. Where the largest position may not be read
back (a GPU under the default NaN policy: no host synchronisation), the table covers positions
``0..`` :data:`DEVICE_TABLE_POSITIONS` ``- 1`` whatever ``R`` (built once, in pieces), and a
device-side assertion stops a position beyond it; ``nan_policy("raise")`` reads the maximum and
serves every position in ``[0, 2^31)``.

No libm call touches a tensor, and every step is an elementwise, correctly rounded IEEE
operation, so an entry depends only on ``(position, i, R, theta)``: not on how many positions
are in the call, their order, where an entry falls in a vectorised loop, the number of
threads, or the device (any device with IEEE float64 gives the same bits). Positions must lie
in ``[0, 2^31)`` (:data:`MAX_POSITION`); there the fp32 result is within one fp32 ulp of the
exact cosine/sine of the float64 angle (tested against Python's ``math.cos``/``math.sin``).
"""

from __future__ import annotations

import decimal
import functools
import math
import threading

import torch

from rl_engine.utils.checks import check_index_range, reads_back

__all__ = ["MAX_POSITION", "CACHE_ELEMENTS", "DEVICE_TABLE_POSITIONS", "rope_inv_freq", "rope_cos_sin"]

#: Positions are accepted in ``[0, MAX_POSITION)``.
MAX_POSITION = 2**31

_TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
# π/2 = P0 + P1 + P2 + P3 + P4 (+ < 3e-41): four 20-bit pieces (k·Pj exact for k < 2^33) and a
# full float64 tail, split from a 100+-bit rational value of π (Machin's formula).
_PIO2 = tuple(
    float.fromhex(h)
    for h in ("0x1.921fa00000000p+0", "0x1.5444200000000p-20", "0x1.a308c00000000p-41", "0x1.3131800000000p-61", "0x1.8a2e03707344ap-81")
)
# Taylor coefficients, each the correctly rounded float64 of (-1)^k / n!.
_SIN = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(1, 9))  # r^3 .. r^17
_COS = tuple((-1) ** k / math.factorial(2 * k) for k in range(1, 10))  # r^2 .. r^18


@functools.lru_cache(maxsize=64)
def rope_inv_freq(rotary_dim: int, theta: float) -> tuple[float, ...]:
    """``(1 / theta^(2i/rotary_dim) for i < rotary_dim/2)`` as Python floats (float64)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected a positive even int, got {rotary_dim}")
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"theta: expected a finite float > 0, got {theta}")
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        base = decimal.Decimal(theta)
        return tuple(1.0 / float(base ** decimal.Decimal((2 * i) / rotary_dim)) for i in range(rotary_dim // 2))


def _horner(r2: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """``c0 + r2·(c1 + r2·(c2 + ...))`` with one multiply and one add per step (no FMA)."""
    p = torch.full_like(r2, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * r2
        p = p + c
    return p


def _cos_sin_f64(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.round(angle * _TWO_OVER_PI)
    r = angle
    for piece in _PIO2:
        r = r - k * piece
    r2 = r * r
    s = r + (r * r2) * _horner(r2, _SIN)
    c = 1.0 + r2 * _horner(r2, _COS)
    q = torch.remainder(k.to(torch.int64), 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return cos, sin


def _direct(positions: torch.Tensor, inv: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    inv_t = torch.tensor(inv, dtype=torch.float64, device=positions.device)
    angle = positions.to(torch.float64)[:, None] * inv_t[None, :]
    cos, sin = _cos_sin_f64(angle)
    return cos.to(torch.float32), sin.to(torch.float32)


#: Largest cached table, in entries per table (``rows · R/2``): 16 MiB of fp32 each for cos, sin.
CACHE_ELEMENTS = 1 << 22
#: Positions of the table used without a host read (GPU, default NaN policy): 262,144 positions,
#: whatever ``R`` (``R = 128``: 64 MiB of fp32 each for cos and sin).
DEVICE_TABLE_POSITIONS = 1 << 18
# Positions computed per piece when a table is built (bounds the float64 temporaries).
_BUILD_PIECE = 1 << 14
_CACHE_KEYS = 8
_cache: dict[tuple[int, float, str], tuple[torch.Tensor, torch.Tensor]] = {}
_cache_lock = threading.Lock()


def _build(n: int, device: torch.device, inv: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The table for positions ``0..n-1``, computed in pieces of :data:`_BUILD_PIECE` positions."""
    pieces = [_direct(torch.arange(p, min(n, p + _BUILD_PIECE), device=device), inv) for p in range(0, n, _BUILD_PIECE)]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat([c for c, _ in pieces]), torch.cat([s_ for _, s_ in pieces])


def _cached(rows: int, rotary_dim: int, theta: float, device: torch.device, inv: tuple[float, ...],
            max_rows: int | None = None):
    """The table for positions ``0..n-1`` with ``n >= rows`` (``None``: more than ``max_rows``,
    default :data:`CACHE_ELEMENTS` ``// (R/2)``)."""
    max_rows = CACHE_ELEMENTS // (rotary_dim // 2) if max_rows is None else max_rows
    if rows > max_rows:
        return None
    key = (rotary_dim, theta, str(device))
    with _cache_lock:
        tab = _cache.get(key)
        if tab is None or tab[0].shape[0] < rows:
            n = min(max_rows, max(4096, 1 << (rows - 1).bit_length()))
            tab = _build(n, device, inv)
            _cache.pop(key, None)
            while len(_cache) >= _CACHE_KEYS:
                _cache.pop(next(iter(_cache)))
            _cache[key] = tab
        return tab


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE table at ``positions``, defined bit for bit (see the module docstring).

    Args:
        positions: ``[T]`` int32/int64 in ``[0, MAX_POSITION)``, on any device; on a GPU under
            the default NaN policy in ``[0, DEVICE_TABLE_POSITIONS)`` (checked on the device:
            beyond it the process stops at a device-side assertion naming ``positions``).
        rotary_dim: ``R``, the number of rotated features (positive, even).
        theta: the RoPE base (finite, > 0).

    Returns:
        ``(cos, sin)``, each ``[T, R/2]`` fp32 on ``positions.device`` (not duplicated over the
        two halves: entry ``[t, i]`` is the angle ``positions[t] · inv_freq_i``).

    Raises:
        ValueError: ``positions`` is not a 1-D int32/int64 tensor or is out of range, or
            ``rotary_dim`` / ``theta`` is invalid (the message names the argument).
    """
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
        got = f"{positions.dtype} tensor of shape {tuple(positions.shape)}" if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions: expected a 1-D int32/int64 tensor, got {got}")
    rotary_dim, theta = int(rotary_dim), float(theta)
    inv = rope_inv_freq(rotary_dim, theta)
    if positions.numel() == 0 or positions.device.type == "meta":
        return _direct(positions, inv)
    if not reads_back(positions):
        # No host read (a GPU under the default NaN policy): the device table, built once per
        # (R, theta, device), and a device-side assertion that every position is in it.
        rows = DEVICE_TABLE_POSITIONS
        tab = _cached(rows, rotary_dim, theta, positions.device, inv, max_rows=rows)
        check_index_range("positions", positions, rows, what="positions of the device RoPE table")
        idx = positions.to(torch.int64)
        return tab[0].index_select(0, idx), tab[1].index_select(0, idx)
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= MAX_POSITION:
        raise ValueError(f"positions: expected values in [0, {MAX_POSITION}), got range [{lo}, {hi}]")
    tab = _cached(hi + 1, rotary_dim, theta, positions.device, inv)
    if tab is None:
        return _direct(positions, inv)
    idx = positions.to(torch.int64)
    return tab[0].index_select(0, idx), tab[1].index_select(0, idx)
