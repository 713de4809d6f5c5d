"""Tile configurations of the Triton ``gemm.linear`` kernels (pure data: no triton import).

Numerics: every configuration computes each output element as the same sequence of
operations — a fp32 accumulator starting at +0, the K dimension consumed from k = 0 upwards in
fixed-width steps (16-bit inputs: one tensor-core MMA per 16 products, in order; fp32: one
IEEE fma per product, in order, ``input_precision="ieee"``), then the bias added in fp32 and a
single rounding to the output dtype. Tile shape, warps and pipeline depth decide only *which*
program computes an element and how loads are scheduled, never the arithmetic of that element.
So the configuration may follow M (and N) without breaking row or column invariance; the GPU
test module proves it for every configuration listed here (raw bits, config against config).

``BLOCK_K`` could plausibly enter the K order (a tile's dot consumes BLOCK_K products), so its
effect on the bits is measured: on the H200 (``tools/benchmarking/gemm_sweep.py``, its bits
part) forward and dx outputs are raw-bit equal across BLOCK_K 32..512 (fp32 16..64), BLOCK_M 16..256, BLOCK_N
16..256, 2..8 warps, 2..6 stages, TMA vs pointer loads, persistent vs one program per tile and
warp-specialised vs not, for bf16, fp16 and fp32, at K = 4096 and at K = 1000 (a K tail) —
consistent with the tensor cores consuming K in steps of 16 in order whatever the tile, so a
larger BLOCK_K only groups more steps per loop iteration.

Which configuration a call launches is data: a table per device architecture,
``tile_tables/<arch>.json`` (:class:`GemmTable`: forward rows bounded by M and N, first match
wins, and the weight gradient's configuration, per dtype), with the measurements it came from.
A device without a table runs :data:`FALLBACK_ARCH`'s. Every configuration of every shipped table
is covered by the GPU bits tests (:func:`shipped_configs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from rl_engine.backends.triton import ArchFiles
from rl_engine.utils.schema import StrictModel

__all__ = ["TileConfig", "FALLBACK_ARCH", "GemmTable", "load_table", "table_path", "shipped_arches", "forward_table",
           "select_forward", "select_weight_grad", "shipped_configs", "tail_split", "tail_config"]


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

    @classmethod
    def from_key(cls, key: str) -> TileConfig:
        """The configuration whose :attr:`key` is ``key`` (``"64x128x64_w4_s4_g8_tma_persistent"``)."""
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"key: expected BMxBNxBK_wWARPS_sSTAGES_gGROUP[_tma][_persistent][_warp_specialize]"
                             f"[_epilogue_subtile], got {key!r}")
        bm, bn, bk, w, s, g = (int(v) for v in m.groups()[:6])
        return cls(bm, bn, bk, w, s, g, **{f: bool(v) for f, v in zip(_FLAGS, m.groups()[6:])})


_FLAGS = ("tma", "persistent", "warp_specialize", "epilogue_subtile")
_KEY = re.compile(r"(\d+)x(\d+)x(\d+)_w(\d+)_s(\d+)_g(\d+)" + "".join(f"(_{f})?" for f in _FLAGS))


C = TileConfig

#: The architecture whose table serves devices that have none (the one measured so far: the
#: H200). Pre-Hopper devices run its tiles with pointer loads (``kernels.tma_supported``).
FALLBACK_ARCH = "sm90"


class _Config(StrictModel):
    block_m: int = Field(gt=0)
    block_n: int = Field(gt=0)
    block_k: int = Field(gt=0)
    num_warps: int = Field(gt=0)
    num_stages: int = Field(gt=0)
    group_m: int = Field(default=8, gt=0)
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False
    epilogue_subtile: bool = False


class ForwardRow(StrictModel):
    """Calls with ``M <= max_m`` and ``N <= max_n`` (``None``: unbounded) launch ``config``; the
    first matching row of a dtype wins. ``note``: why the row is what it is."""

    dtype: Literal["bfloat16", "float16", "float32"]
    max_m: int | None = Field(default=None, gt=0)
    max_n: int | None = Field(default=None, gt=0)
    config: _Config
    note: str | None = None


class WeightGradRow(StrictModel):
    dtype: Literal["bfloat16", "float16", "float32"]
    config: _Config


class GemmTable(StrictModel):
    """``tile_tables/<arch>.json``: the forward rows (also the ``dx = dy W`` product's, with
    ``N`` = K) and the weight gradient's configuration, per dtype, and where they were measured."""

    schema_version: Literal[1]
    arch: str
    source: dict[str, str]
    forward: list[ForwardRow]
    weight_grad: list[WeightGradRow]


ForwardTable = dict[torch.dtype, tuple[tuple[int | None, int | None, TileConfig], ...]]


def load_table(path: str | Path) -> tuple[ForwardTable, dict[torch.dtype, TileConfig]]:
    """A table file's forward rows by dtype (``(max_m, max_n, config)``, in file order) and its
    weight-gradient configuration by dtype.

    Raises:
        ValueError: the file is not a valid table (the message names the field), or a dtype's
            forward rows do not end with a row unbounded in M and N (selection must be total), or
            a dtype has forward rows and no weight-gradient row, or either twice.
    """
    table = GemmTable.model_validate(json.loads(Path(path).read_text()))
    forward: dict[torch.dtype, list[tuple[int | None, int | None, TileConfig]]] = {}
    for row in table.forward:
        forward.setdefault(getattr(torch, row.dtype), []).append((row.max_m, row.max_n, TileConfig(**row.config.model_dump())))
    wgrad: dict[torch.dtype, TileConfig] = {}
    for row in table.weight_grad:
        dt = getattr(torch, row.dtype)
        if dt in wgrad:
            raise ValueError(f"{path}: weight_grad: expected one row per dtype, got {row.dtype} twice")
        wgrad[dt] = TileConfig(**row.config.model_dump())
    for dt, rows in forward.items():
        if rows[-1][:2] != (None, None):
            raise ValueError(f"{path}: forward rows of {dt}: expected the last row unbounded (max_m and max_n null), "
                             f"got max_m={rows[-1][0]}, max_n={rows[-1][1]}")
        if dt not in wgrad:
            raise ValueError(f"{path}: weight_grad: expected a row for {dt} (it has forward rows)")
    return {dt: tuple(rows) for dt, rows in forward.items()}, wgrad


_FILES = ArchFiles(Path(__file__).with_name("tile_tables"), load_table, fallback=FALLBACK_ARCH)
table_path = _FILES.path
shipped_arches = _FILES.arches


def forward_table(dtype: torch.dtype, arch: str | None = None) -> tuple[tuple[int | None, int | None, TileConfig], ...]:
    """The forward rows ``arch`` launches for ``dtype`` (:data:`FALLBACK_ARCH`'s where ``arch`` is
    ``None`` or has no table)."""
    return _FILES.get(arch)[0][dtype]


@functools.lru_cache(maxsize=4096)
def select_forward(dtype: torch.dtype, m: int, n: int, arch: str | None = None) -> TileConfig:
    """Configuration for ``y = x Wᵀ`` with ``m`` rows and ``n`` output features (also used for
    ``dx = dy W`` with ``n`` = K) on ``arch``: the first row of its table with ``m <= max_m`` and
    ``n <= max_n``. Any choice gives the same bits (module docstring)."""
    for max_m, max_n, cfg in forward_table(dtype, arch):
        if (max_m is None or m <= max_m) and (max_n is None or n <= max_n):
            return cfg
    raise AssertionError("unreachable: load_table checks that the last row is unbounded")


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


def select_weight_grad(dtype: torch.dtype, arch: str | None = None) -> TileConfig:
    return _FILES.get(arch)[1][dtype]


def shipped_configs(dtype: torch.dtype) -> list[TileConfig]:
    """Every configuration the package's tables can launch for ``dtype`` (every architecture's),
    the persistent ones' tail tiles (``tail_config``) included (the tests cover each)."""
    out: list[TileConfig] = []
    for arch in shipped_arches():
        for *_, cfg in forward_table(dtype, arch):
            for c in (cfg, tail_config(cfg)) if cfg.persistent else (cfg,):
                if c not in out:
                    out.append(c)
        wgrad = select_weight_grad(dtype, arch)
        if wgrad not in out:
            out.append(wgrad)
    return out
