"""Elementwise math whose bits do not depend on the thread count or the instruction set.

``torch.exp``, ``torch.log`` and ``torch.sqrt`` on CPU call Intel MKL's vector math library for
contiguous float tensors, and MKL picks a code path per instruction set (SSE4.2, AVX2, AVX-512;
``MKL_ENABLE_INSTRUCTIONS`` and ``MKL_CBWR`` switch it, and MKL takes different paths on AMD and
Intel CPUs): the last bit of the result differs between them. ``torch.sigmoid``, ``softmax`` and
``addcmul`` differ between ATen's own per-ISA kernels (``ATEN_CPU_CAPABILITY``). The functions here
are built only from operations that every instruction set rounds identically — IEEE ``+ - * /``
of two operands, exact operations (``trunc``, ``round``, ``abs``, ``max``, comparisons, integer
arithmetic and bit reinterpretation) and conversions between float widths — in one fixed
order, so their bits are a function of the input alone, on any x86-64 or Arm CPU.

Accuracy: :func:`exp` and :func:`log` evaluate float64 polynomials whose error is below
``2^-50`` relative, then round once to the output dtype, so float32 results are the
correctly rounded value except within ``2^-40`` of a rounding boundary (the result is then one of
the two neighbours, always the same one). :func:`sqrt` is correctly rounded (IEEE ``sqrt``).
"""

from __future__ import annotations

import functools
import math
from decimal import Decimal, localcontext

import torch

__all__ = ["exp", "log", "sqrt", "pow2", "normal"]

_LN2 = math.log(2.0)
# ln 2 split for :func:`log`: the high part has 32 trailing zero bits, so e · _LN2_HI is exact.
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = _LN2 - _LN2_HI
#: Table size of :func:`exp`: ``e^x = 2^k · 2^(j/N) · e^r`` with ``n = round(x·N/ln2) = k·N + j``.
_EXP_N = 256
# ln2/N split for Cody–Waite range reduction: the high part has 24 trailing zero bits, so
# n · _C_HI is exact for |n| < 2^24 and x - n·_C_HI loses nothing.
_C = _LN2 / _EXP_N
_C_HI = float.fromhex(float.hex(_C)[:10] + "p" + float.hex(_C).split("p")[1])
with localcontext() as _ctx:
    _ctx.prec = 40
    _C_LO = float(Decimal(2).ln() / _EXP_N - Decimal(_C_HI))
_INV_C = _EXP_N / _LN2
# e^r for |r| ≤ ln2/(2N) < 2^-8.5: Taylor to r^5 errs by < r^6/720 < 2^-60.
_EXP_COEFFS = (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)
#: Elements per step of the float64 evaluation: a step's temporaries stay in the L2 cache.
_CHUNK = 1 << 15


@functools.lru_cache(maxsize=1)
def _exp_table_values() -> tuple[float, ...]:
    """``2^(j/N)``, ``j = 0 … N-1``, correctly rounded to float64 (exact decimal arithmetic)."""
    with localcontext() as ctx:
        ctx.prec = 40
        ln2 = Decimal(2).ln()
        return tuple(float((ln2 * j / _EXP_N).exp()) for j in range(_EXP_N))


def _exp_table(device: torch.device) -> torch.Tensor:
    """The table on ``device``, made once per device (:func:`_device_exp_table`), except while
    tracing (``torch.compile``, fake tensors), where a fresh one stays in the trace."""
    if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return torch.tensor(_exp_table_values(), dtype=torch.float64, device=device)
    return _device_exp_table(device)


@functools.lru_cache(maxsize=None)
def _device_exp_table(device: torch.device) -> torch.Tensor:
    """The table on ``device``, kept: on a GPU, making it from the host values is a copy from
    pageable memory that waits for the device, which no call after the first pays (nor a
    CUDA-graph capture meets). Read only (``_exp64`` indexes it)."""
    return torch.tensor(_exp_table_values(), dtype=torch.float64, device=device)


def pow2(n: torch.Tensor) -> torch.Tensor:
    """``2^n`` in float64 for an integer tensor ``n`` with ``-1022 ≤ n ≤ 1023``, built from bits (exact)."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _exp64(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``exp`` of a finite float64 tensor with ``-745.5 ≤ x ≤ 709.5`` (caller clamps), in float64."""
    n = torch.round(x * _INV_C)
    r = x - n * _C_HI
    r.sub_(n * _C_LO)
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p.mul_(r).add_(c)
    ni = n.to(torch.int64)
    # index_select, not ``table[idx]``: a 0-dim index tensor would be read on the host (a GPU sync)
    idx = (ni & (_EXP_N - 1)).reshape(-1)
    p.mul_(table.index_select(0, idx).reshape(ni.shape))
    # 2^k split in two factors so neither leaves float64's normal range (k down to -1084).
    k = ni >> 8
    half = k >> 1
    return p.mul_(pow2(half)).mul_(pow2(k - half))


def _exp64_clamped(xd: torch.Tensor) -> torch.Tensor:
    """The portable float64 ``exp`` of any float64 tensor: ``±inf`` and overflow by clamping, nan propagates."""
    return _exp64(xd.clamp(-746.0, 710.0), _exp_table(xd.device))


def exp(x: torch.Tensor) -> torch.Tensor:
    """Element-wise ``e^x``, the same bits on every CPU and thread count.

    **Definition.** ``n = round(x · N/ln2)``, ``r = x - n·ln2/N`` (Cody–Waite),
    ``E(x) = 2^(n div N) · T[n mod N] · P(r)`` with ``N = 256``, ``T[j] = 2^(j/N)`` correctly
    rounded and ``P`` the degree-5 Taylor polynomial, all in float64 (relative error below
    ``2^-50``); the result is ``E(x)`` rounded once to float32, then to ``x.dtype`` (for float64
    inputs: ``E(x)`` itself).

    **Fast path** (float32, bfloat16, float16 inputs): the library's float64 ``exp`` (MKL or
    SLEEF, error below ``2^-50`` on every instruction set) rounded to float32 is the same value
    wherever it lies more than ``2^-20`` float32 ulp from a rounding boundary, because then
    ``E(x)`` and the exact ``e^x`` round the same way. Elements closer to a boundary (about one in
    ``2^18``), and ``|x| > 87`` (overflow, subnormal and underflow ranges), are evaluated as
    ``E(x)``. Either way each element is ``round(E(x))``: the bits depend on ``x`` alone.

    Args:
        x: a float tensor (float16, bfloat16, float32 or float64), any shape.

    Returns:
        ``e^x`` in ``x.dtype``. ``exp(-inf) = +0``, ``exp(+inf) = +inf``, ``exp(nan) = nan``;
        results beyond the dtype's range overflow to ``inf`` or underflow to ``+0`` (or a
        subnormal) as IEEE rounding gives.
    """
    if x.dtype == torch.float64:
        return _exp64_clamped(x)
    if x.device.type != "cpu":
        # No host round trip off the CPU: every element takes the definition's path.
        return _exp64_clamped(x.to(torch.float64)).to(torch.float32).to(x.dtype)
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.float32)
    for i in range(0, flat.numel(), _CHUNK):
        xd = flat[i : i + _CHUNK].to(torch.float64)
        y64 = torch.exp(xd)
        y = y64.to(torch.float32)
        yd = y.to(torch.float64)
        d = y64.sub_(yd).abs_()
        # ulp of a normal float32 y: its binade 2^e (the float64 exponent bits) times 2^-23.
        ulp = (yd.view(torch.int64) & 0x7FF0000000000000).view(torch.float64).mul_(2.0**-23)
        tol = ulp * 2.0**-20
        hard = (d - ulp * 0.5).abs_() < tol
        hard |= (d - ulp * 0.25).abs_() < tol  # the boundary below a power of two
        hard |= xd.abs() > 87.0
        if bool(hard.any()):
            idx = hard.nonzero().squeeze(1)
            y[idx] = _exp64_clamped(xd[idx]).to(torch.float32)
        out[i : i + _CHUNK] = y
    return out.view(x.shape).to(x.dtype)


def log(x: torch.Tensor) -> torch.Tensor:
    """Element-wise natural logarithm, the same bits on every CPU and thread count.

    ``x = m · 2^e`` with ``m ∈ [√½, √2)`` (from the float64 bits), ``log x = e·ln2 + 2·atanh(f)``
    with ``f = (m - 1)/(m + 1)``, ``|f| ≤ 0.172``, as an odd series to ``f^27`` (error < 2^-60).

    Args:
        x: a float tensor, any shape.

    Returns:
        ``log x`` in ``x.dtype``: ``-inf`` at ``±0``, ``nan`` for negative inputs and nan,
        ``+inf`` at ``+inf``.
    """
    xd = x.to(torch.float64)
    ok = torch.isfinite(xd) & (xd > 0)
    v = torch.where(ok, xd, 1.0)
    # Subnormal float64 inputs (below 2^-1022) are scaled up first so the exponent field is exact.
    small = v < 2.2250738585072014e-308
    v = torch.where(small, v * 18014398509481984.0, v)  # 2^54
    bits = v.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)  # [1, 2)
    big = m >= math.sqrt(2.0)
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int64) - torch.where(small, 54, 0)
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    s = torch.full_like(f, 1.0 / 27.0)
    for k in range(25, 0, -2):
        s.mul_(f2).add_(1.0 / k)
    ed = e.to(torch.float64)
    y = ed * _LN2_HI
    y.add_(ed * _LN2_LO + (2.0 * f) * s)
    y = torch.where(ok, y, torch.where(xd == 0, -torch.inf, torch.where(xd == torch.inf, torch.inf, torch.nan)))
    return y.to(x.dtype)


#: Largest element count :func:`sqrt` computes element by element on the host (Python's
#: ``math.sqrt``) instead of with tensor operations: one row statistic per token row of a
#: decode-sized call costs a few microseconds that way against some 25 tensor operations.
SCALAR_SQRT_MAX = 64


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Element-wise correctly rounded square root of a float32 tensor.

    A float64 estimate rounded to the output dtype is corrected to the IEEE result by comparing
    ``x`` with the squares of the two rounding midpoints around it, which are exact in float64.
    The result is IEEE ``sqrt`` (``-0 → -0``, negative → nan), whatever the CPU.

    A small CPU tensor (at most :data:`SCALAR_SQRT_MAX` elements, no gradient, not under
    ``torch.compile``) takes the host path: Python's ``math.sqrt`` of each element as a float64,
    rounded once to float32. IEEE 754 requires ``sqrt`` correctly rounded, and rounding a correctly
    rounded binary64 square root of a binary32 value to binary32 gives the correctly rounded
    binary32 square root (53 ≥ 2·24 + 2 bits), so both paths return the same bits; NaN results
    are the default quiet NaN on both.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected a float32 tensor, got {x.dtype}")
    if (x.device.type == "cpu" and x.numel() <= SCALAR_SQRT_MAX and not x.requires_grad and type(x) is torch.Tensor
            and not torch.compiler.is_compiling()):
        return _sqrt_scalars(x)
    xd = x.to(torch.float64)
    ok = torch.isfinite(xd) & (xd > 0)
    v = torch.where(ok, xd, 1.0)
    s = (v * torch.rsqrt(v)).to(x.dtype)  # within a few ulp of the result
    for _ in range(2):
        up = torch.nextafter(s, torch.full_like(s, torch.inf))
        dn = torch.nextafter(s, torch.zeros_like(s))
        sd = s.to(torch.float64)
        hi = (sd + up.to(torch.float64)) * 0.5  # exact: 25 significant bits
        lo = (sd + dn.to(torch.float64)) * 0.5
        # Ties go to the neighbour with an even significand, as IEEE round-to-nearest-even does.
        go_up = (v > hi * hi) | ((v == hi * hi) & ((s.view(torch.int32) & 1) == 1))
        go_dn = (v < lo * lo) | ((v == lo * lo) & ((s.view(torch.int32) & 1) == 1))
        s = torch.where(go_up, up, torch.where(go_dn, dn, s))
    special = torch.where(xd == torch.inf, torch.inf, torch.where(xd == 0, xd, torch.nan)).to(x.dtype)
    return torch.where(ok, s, special)


def _sqrt_scalars(x: torch.Tensor) -> torch.Tensor:
    """:func:`sqrt`'s host path: ``+0 → +0``, ``-0 → -0``, ``+inf → +inf``, a positive finite
    value → ``math.sqrt``, anything else (negative, ``-inf``, NaN) → the default NaN."""
    out = [math.sqrt(v) if 0 < v < math.inf else v if v == 0 or v == math.inf else math.nan
           for v in x.reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.float64).to(torch.float32).reshape(x.shape)


def normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Float32 draws of mean 0 and variance 1 whose bits depend only on the generator's seed.

    ``torch.randn`` on CPU fills with a vectorised Box–Muller whose results follow ATen's
    instruction set; this uses four uniform integers per element from ``torch.randint`` (the
    Mersenne Twister, scalar on every CPU), ``x = √(3/4)·Σ_{j<4} u_j`` with
    ``u_j = (n_j + ½)/2^23 - 1 ∈ (-1, 1)`` — an Irwin–Hall approximation of the normal, bounded
    by ``±2√3`` — computed with exact float64 additions and one rounding to float32.
    """
    n = 1
    for s in shape:
        n *= s
    acc = torch.zeros(n, dtype=torch.float64)
    for _ in range(4):
        u = torch.randint(0, 1 << 24, (n,), generator=generator, dtype=torch.int64).to(torch.float64)
        acc.add_(u.add_(0.5).mul_(2.0**-23).sub_(1.0))
    return acc.mul_(math.sqrt(0.75)).to(torch.float32).reshape(shape)
