"""Tile configurations of the Triton ``gemm.linear`` kernels (pure data: no triton import).

Numerics: every configuration computes each output element as the same sequence of
operations — a fp32 accumulator starting at +0, the K dimension consumed from k = 0 upwards in
fixed-width steps (16-bit inputs: one tensor-core MMA per 16 products, in order; fp32: one
IEEE fma per product, in order, ``input_precision="ieee"``), then the bias added in fp32 and a
single rounding to the output dtype. Tile shape, warps and pipeline depth decide only *which*
program computes an element and how loads are scheduled, never the arithmetic of that element.
So the configuration may follow M (and N) without breaking row or column invariance; the GPU
test module proves it for every configuration listed here (raw bits, config against config).

``BLOCK_K`` could plausibly enter the K order (a tile's dot consumes BLOCK_K products), so it
was measured before letting it vary: on the H200 (``tools/benchmarking/gemm_sweep.py``, its bits
part) forward and dx outputs are raw-bit equal across BLOCK_K 32..512 (fp32 16..64), BLOCK_M 16..256, BLOCK_N
16..256, 2..8 warps, 2..6 stages, TMA vs pointer loads, persistent vs one program per tile and
warp-specialised vs not, for bf16, fp16 and fp32, at K = 4096 and at K = 1000 (a K tail) —
consistent with the tensor cores consuming K in steps of 16 in order whatever the tile, so a
larger BLOCK_K only groups more steps per loop iteration.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

__all__ = ["TileConfig", "FORWARD_TABLE", "select_forward", "select_weight_grad", "shipped_configs", "tail_split",
           "tail_config"]


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration.

    ``tma``: move tiles with the tensor-memory accelerator (host tensor descriptors, Hopper+)
    when the tensors' strides allow it (else pointer loads, same tile); ``persistent``: one
    program per SM walking the tiles (TMA only); ``warp_specialize``: Triton's producer/consumer
    warp specialisation of that loop; ``epilogue_subtile``: the persistent kernel stores the
    output tile as two ``[block_m, block_n/2]`` halves (less shared memory for the epilogue,
    which leaves room for another pipeline stage; stores only, same values)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False
    epilogue_subtile: bool = False

    @property
    def key(self) -> str:
        flags = "".join(f"_{f}" for f in ("tma", "persistent", "warp_specialize", "epilogue_subtile") if getattr(self, f))
        return f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}_g{self.group_m}{flags}"


C = TileConfig

# Forward tables for 16-bit inputs: (max M, max N, config); the first row with M <= max M and
# N <= max N wins (N = output features). Tuned on an H200 for the Qwen3-8B projections
# (N = 4096 down, 6144 qkv, 24576 gate_up, 151936 lm_head): reports/gpu/h200/gemm.json (achieved
# against cuBLAS) and reports/gpu/h200/gemm_small_m_sweep.json (the small-M candidates).
_BIG = 1 << 62
_WS = dict(tma=True, persistent=True, warp_specialize=True)
_TABLE_16BIT: tuple[tuple[int, int, TileConfig], ...] = (
    # decode-sized M: memory bound; few, deep programs streaming W (16×64×256 with 4 stages beats
    # more, smaller programs at qkv and down M = 1: reports/gpu/h200/gemm_small_m_sweep.json)
    (1, 4096, C(16, 64, 256, 4, 4, tma=True)),
    (16, 4096, C(16, 32, 256, 4, 6, tma=True)),
    (16, 8192, C(16, 64, 256, 4, 4, tma=True)),
    (16, _BIG, C(16, 64, 128, 4, 4, tma=True)),
    (64, 8192, C(64, 64, 128, 4, 6, tma=True)),
    (64, _BIG, C(64, 128, 64, 4, 4, tma=True)),
    (256, 8192, C(64, 128, 128, 4, 3, tma=True)),
    (256, _BIG, C(128, 128, 64, 4, 4, tma=True, persistent=True)),
    # prefill / training M: compute bound; persistent, warp-specialised 128x256 tiles, except
    # mid-sized N at M <= 2048 where 128x256 tiles leave a ragged last wave. Large M: the
    # epilogue stores two 128x128 halves, which frees shared memory for a 4th stage, and tiles
    # are grouped 16 along M for L2 reuse of the weight.
    (2048, 4096, C(128, 256, 64, 8, 3, **_WS)),
    (2048, 8192, C(128, 128, 64, 4, 5, tma=True)),
    (_BIG, _BIG, C(128, 256, 64, 8, 4, group_m=16, epilogue_subtile=True, **_WS)),
)
_TABLE_FP32: tuple[tuple[int, int, TileConfig], ...] = (
    (64, _BIG, C(32, 64, 32, 4, 3)),
    (_BIG, _BIG, C(64, 128, 32, 8, 3)),
)

FORWARD_TABLE: dict[torch.dtype, tuple[tuple[int, int, TileConfig], ...]] = {
    torch.bfloat16: _TABLE_16BIT,
    torch.float16: _TABLE_16BIT,
    torch.float32: _TABLE_FP32,
}

#: dW = dyᵀ x (output [N, K], reduction over the M rows): large tiles, any M.
_WGRAD: dict[torch.dtype, TileConfig] = {
    torch.bfloat16: C(128, 128, 64, 8, 3),
    torch.float16: C(128, 128, 64, 8, 3),
    torch.float32: C(64, 128, 32, 8, 3),
}


@functools.lru_cache(maxsize=4096)
def select_forward(dtype: torch.dtype, m: int, n: int) -> TileConfig:
    """Configuration for ``y = x Wᵀ`` with ``m`` rows and ``n`` output features (also used for
    ``dx = dy W`` with ``n`` = K). Any choice gives the same bits (module docstring)."""
    for max_m, max_n, cfg in FORWARD_TABLE[dtype]:
        if m <= max_m and n <= max_n:
            return cfg
    raise AssertionError("unreachable: the last row is unbounded")


def tail_split(tiles: int, programs: int) -> int | None:
    """Where a persistent launch of ``tiles`` output tiles on ``programs`` programs (one an SM)
    ends its full waves, when its last wave is at most half full; else ``None``.

    A persistent launch deals tile ``t`` to program ``t mod programs``: with ``tiles = q·programs
    + r`` (``q >= 1``, ``0 < r``) the launch lasts ``q + 1`` tile times while only ``r`` programs
    work in the last. For ``r <= programs / 2`` the launcher (``kernels.forward``) runs the first
    ``q·programs`` tiles as one launch (every program ``q`` tiles) and the last ``r`` as ``2r``
    half-width tiles (``tail_config``) in a second launch of one half tile a program: ``q + ½``
    tile times. Qwen3-8B on 132 SMs: 3072 tiles of 128 × 256 (qkv at M = 16384, gate_up at
    M = 4096) are 23 waves and 36 tiles, i.e. 24 → 23.5 tile times. The bits do not change: a
    half-width tile computes each of its elements exactly as the whole tile does (module
    docstring)."""
    if tiles <= 0 or programs <= 0:
        raise ValueError(f"tiles, programs: expected positive counts, got {tiles}, {programs}")
    full, rest = divmod(tiles, programs)
    if full == 0 or rest == 0 or 2 * rest > programs:
        return None
    return full * programs


def tail_config(cfg: TileConfig) -> TileConfig:
    """The half-width tile (``block_n / 2`` columns, the rest of ``cfg`` unchanged) that computes a
    persistent launch's last wave (``tail_split``)."""
    if not cfg.persistent or cfg.block_n % 32:
        raise ValueError(f"tail_config: expected a persistent configuration with block_n a multiple of 32, got {cfg.key}")
    return dataclasses.replace(cfg, block_n=cfg.block_n // 2)


def select_weight_grad(dtype: torch.dtype) -> TileConfig:
    return _WGRAD[dtype]


def shipped_configs(dtype: torch.dtype) -> list[TileConfig]:
    """Every configuration this module can launch for ``dtype``, the persistent ones' tail tiles
    (``tail_config``) included (the tests cover each)."""
    out: list[TileConfig] = []
    for *_, cfg in FORWARD_TABLE[dtype]:
        for c in (cfg, tail_config(cfg)) if cfg.persistent else (cfg,):
            if c not in out:
                out.append(c)
    if _WGRAD[dtype] not in out:
        out.append(_WGRAD[dtype])
    return out
