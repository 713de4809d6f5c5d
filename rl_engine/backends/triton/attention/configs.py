"""Launch configurations of the attention kernels and the rules that select them, as data.

Nothing here imports triton: the tables, the selection rules and the kernel variants are plain
Python, read by the launchers (``launch``), the eligibility rules (``eligibility``), the GPU
benchmark and the offline sm_90 compile. The switches the rules consult are the context-scoped
``tuning.AttentionTuning``.

Every table entry and rule decides speed only: ``KV_BLOCK`` (64), the head dim and the dtypes are
the same on every path; only the query tile, the warps, the pipeline depth, the value slicing and
the blocks per step change, and the GPU tests prove rows raw-bit equal across every configuration
listed here (``shipped_forward_configs``). The tiles are data, a file per device architecture
(``config_tables/<arch>.json``, :func:`table`; only ``sm90``, the H200, is measured, and devices
without a file run its tiles). The rules' bands are measured on the H200 too and live in
``tuning.AttentionTuning``'s defaults; the Hopper kernels' bands (``wg_decode_programs``,
``wgt_decode_programs``, ``wgt_quad_blocks``) apply where those kernels are eligible (sm90 only).
"""

from __future__ import annotations

import enum
import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, get_args

import torch
from pydantic import Field

from rl_engine.backends.triton import ArchFiles
from rl_engine.backends.triton.attention.tuning import GRID_ORDERS, current_tuning
from rl_engine.utils.schema import StrictModel

__all__ = [
    "KV_BLOCK",
    "SPLIT_BLOCKS",
    "COMBINE_COLUMNS",
    "COMPILED_CUDA",
    "LOG2E",
    "AttnConfig",
    "Variant",
    "TABLE_NAMES",
    "FALLBACK_ARCH",
    "AttentionTileTable",
    "table_path",
    "load_tables",
    "shipped_arches",
    "table",
    "CANDIDATE_CONFIGS",
    "MAX_V_SLICES",
    "MIN_V_COLUMNS",
    "score_scale",
    "split_runs",
    "supported_head_dim",
    "HEAD_DIMS",
    "multi_block_steps",
    "select_prefill",
    "select_decode",
    "select_backward",
    "sm_count",
    "device_index",
    "few_programs",
    "one_wave",
    "value_slices",
    "pair_blocks",
    "quad_blocks",
    "quad_tile",
    "shipped_forward_configs",
    "split_grid_order",
    "combine_group",
    "num_splits",
    "tile_free_rows",
    "use_decode_path",
    "wg_decode_programs",
    "wgt_decode_programs",
    "wgt_quad_blocks",
    "wgt_tile_rows",
]


#: Keys per block, at absolute positions 0, 64, 128, ... (the same on every path and kernel).
KV_BLOCK = 64
#: Blocks per KV split (1024 keys), splits at absolute positions 0, 1024, 2048, ... (the default of
#: ``tuning.AttentionTuning.split_blocks``, which the launchers read).
SPLIT_BLOCKS = 16
#: Accumulator columns per ``rlk_attn_combine`` program (grid (tiles, kv heads, D / 32)).
COMBINE_COLUMNS = 32
#: Whether the kernels run compiled for CUDA (not the Triton interpreter, not ROCm): inline PTX
#: (``ex2.approx.ftz``, ``griddepcontrol``) is available. Decided once, when this module is imported.
COMPILED_CUDA = os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.version.hip is None


#: ``log2 e`` (float64): the kernels' scores are in base-2 units (``device.rlk_attn_step``).
LOG2E = 1.4426950408889634


def score_scale(scale: float) -> float:
    """The kernels' score scale ``c = scale · log2 e``, computed in float64 and passed as the
    kernels' fp32 argument (one rounding): every launch of every path gets the same ``c``."""
    return float(scale) * LOG2E


@dataclass(frozen=True)
class AttnConfig:
    """One launch configuration: query rows per tile, warps, software-pipeline depth.

    ``KV_BLOCK`` (64), the head dim and the dtypes are the same on every path; only the query
    tile may change, and the GPU tests prove that rows are raw-bit equal across every
    configuration listed here (``shipped_forward_configs``)."""

    block_m: int
    num_warps: int
    num_stages: int
    #: programs per (tile, kv head[, split]) that each accumulate ``D / v_slices`` columns of
    #: ``P·V`` (scores and softmax state computed alike in each): parallelism for decode steps
    #: with few programs (``value_slices``). The scores, the state and each output column's
    #: products are the same, so the same bits.
    v_slices: int = 1
    #: 64-key blocks per step of the unmasked run (1, 2 or 4): with 2 (``rlk_attn_pair``), the
    #: second block's loads and scores are issued before the first block's state update, for the
    #: compiler to overlap; with 4 (``rlk_attn_quad``, 16-row tiles), one batched score product
    #: gives each warp one block, and the row maxima and sums stay inside the warps. The same
    #: blocks in the same order, so the same bits.
    unroll: int = 1

    @property
    def key(self) -> str:
        v = f"_v{self.v_slices}" if self.v_slices > 1 else ""
        u = f"_u{self.unroll}" if self.unroll > 1 else ""
        return f"m{self.block_m}_w{self.num_warps}_s{self.num_stages}{v}{u}"


class Variant(enum.Enum):
    """The kernel variant ``launch.attend`` runs, chosen by ``eligibility.train_variant`` (the train
    path) and ``eligibility.decode_variant`` (decode steps). Every variant gives the same bits
    (GPU tests).

    * ``POINTER_LOADS``: the portable Triton kernels with key / value blocks by pointer loads.
    * ``PACKED_TMA``: the prefill kernel loads every block by TMA copies (``tma_eligible``: the
      train path's packed rows only, where every row a block reads past its queries is a finite
      input or the copy's zero fill).
    * ``CACHE_TMA``: the blocks every row of a tile sees entirely (the unmasked run) arrive by TMA
      copies, the masked blocks by pointer loads clamped to the tile's last position
      (``decode_tma_eligible``: a contiguous cache, whose rows past a sequence's end may be stale);
      either kernel, any value slicing.
    * ``WARPGROUP_PAGED_DECODE``: the splits of a decode step run the Hopper warpgroup kernel
      (``hopper_warpgroup.rlk_attn_split_wg``, ``wg_decode_eligible``: a paged cache of 16- or
      32-key pages, each block's pages by TMA copies; the output only) instead of
      ``rlk_attn_fwd_split`` (the same workspace and combine) or, at one KV split, of the prefill
      kernel (its programs finish their rows).
    * ``TRANSPOSED_DECODE``: the splits of a decode step run the transposed Hopper kernel
      (``hopper_transposed_decode.rlk_attn_split_wgt``, ``wgt_decode_eligible``: a contiguous cache
      or 16- / 32-key pages, decode tiles of at most 16 rows; the output only), as
      ``WARPGROUP_PAGED_DECODE`` does; ``TRANSPOSED_DECODE_QUAD``: its unmasked runs four blocks a
      step (``wgt_quad_blocks``).
    """

    POINTER_LOADS = "pointer_loads"
    PACKED_TMA = "packed_tma"
    CACHE_TMA = "cache_tma"
    WARPGROUP_PAGED_DECODE = "warpgroup_paged_decode"
    TRANSPOSED_DECODE = "transposed_decode"
    TRANSPOSED_DECODE_QUAD = "transposed_decode_quad"

    @property
    def transposed(self) -> bool:
        """Whether the splits run ``rlk_attn_split_wgt`` (one or four blocks a step)."""
        return self in (Variant.TRANSPOSED_DECODE, Variant.TRANSPOSED_DECODE_QUAD)


C = AttnConfig

#: The tables of the configuration each launch takes, by name: ``prefill``, ``paged_prefill``
#: (pages shorter than a key block; a subset of ``(dtype, head_dim)``), ``decode`` (the default
#: decode tile), ``few_decode`` / ``few_paged_decode`` (steps with fewer (sequence, kv head) pairs
#: than SMs, within one wave: ``one_wave``), ``many_decode`` (the other decode steps) and
#: ``backward``. Each is data, one file per device architecture (``config_tables/<arch>.json``, with
#: the measurements behind each table); a device without a file runs ``FALLBACK_ARCH``'s.
TABLE_NAMES = ("prefill", "paged_prefill", "decode", "few_decode", "few_paged_decode", "many_decode", "backward")
#: The tables every ``(dtype, head_dim)`` must have a row in.
_COMPLETE = tuple(n for n in TABLE_NAMES if n != "paged_prefill")
FALLBACK_ARCH = "sm90"
DtypeName = Literal["bfloat16", "float16", "float32"]

ConfigTable = dict[tuple[torch.dtype, int], AttnConfig]


class _Tile(StrictModel):
    block_m: int = Field(gt=0)
    num_warps: int = Field(gt=0)
    num_stages: int = Field(gt=0)


class _Row(StrictModel):
    dtype: DtypeName
    head_dim: int
    config: _Tile


class _Table(StrictModel):
    note: str
    rows: list[_Row]


class AttentionTileTable(StrictModel):
    """``config_tables/<arch>.json``: every table of :data:`TABLE_NAMES` by name."""

    schema_version: Literal[1]
    arch: str
    source: dict[str, str]
    tables: dict[Literal[TABLE_NAMES], _Table]  # type: ignore[valid-type]


def load_tables(path: str | Path) -> dict[str, ConfigTable]:
    """A table file's tables by name, each ``(dtype, head_dim) -> AttnConfig``.

    Raises:
        ValueError: the file is not a valid table file (the message names the field), a table is
            missing, a row repeats a ``(dtype, head_dim)`` or names an unsupported head dim, or a
            table other than ``paged_prefill`` lacks a supported ``(dtype, head_dim)``.
    """
    doc = AttentionTileTable.model_validate(json.loads(Path(path).read_text()))
    missing = [n for n in TABLE_NAMES if n not in doc.tables]
    if missing:
        raise ValueError(f"{path}: tables: expected {list(TABLE_NAMES)}, missing {missing}")
    out: dict[str, ConfigTable] = {}
    for name, table in doc.tables.items():
        rows: ConfigTable = {}
        for row in table.rows:
            key = (getattr(torch, row.dtype), row.head_dim)
            if row.head_dim not in HEAD_DIMS:
                raise ValueError(f"{path}: {name}: head_dim {row.head_dim} is not one of {HEAD_DIMS}")
            if key in rows:
                raise ValueError(f"{path}: {name}: ({row.dtype}, {row.head_dim}) appears twice")
            rows[key] = AttnConfig(row.config.block_m, row.config.num_warps, row.config.num_stages)
        if name in _COMPLETE:
            gaps = [(n, d) for n in get_args(DtypeName) for d in HEAD_DIMS if (getattr(torch, n), d) not in rows]
            if gaps:
                raise ValueError(f"{path}: {name}: expected a row for every dtype and head dim, missing {gaps}")
        out[name] = rows
    return out


_FILES = ArchFiles(Path(__file__).with_name("config_tables"), load_tables, fallback=FALLBACK_ARCH)
table_path = _FILES.path
shipped_arches = _FILES.arches


def table(name: str, arch: str | None = None) -> ConfigTable:
    """The table ``name`` (:data:`TABLE_NAMES`) of ``arch`` (``None``: :data:`FALLBACK_ARCH`; an
    architecture without a file: the fallback's)."""
    if name not in TABLE_NAMES:
        raise ValueError(f"name: expected one of {TABLE_NAMES}, got {name!r}")
    return _FILES.get(arch)[name]


#: Candidate configurations the GPU benchmark times (``--configs all``) and the GPU tests prove
#: raw-bit equal to the shipped ones (forward: every row on every config and path; backward: the
#: contract holds for any fixed choice): pick the fastest into the tables above.
CANDIDATE_CONFIGS: dict[str, tuple[AttnConfig, ...]] = {
    "prefill": (C(128, 8, 2), C(128, 8, 3), C(128, 4, 2), C(64, 4, 2), C(64, 4, 3), C(64, 8, 3)),
    # (1 or 8 warps and 4 stages are not within 5% of the best decode tile at batch 1 / 4 / 64 on
    # the H200, so they are not candidates)
    "decode": (C(16, 4, 3), C(16, 4, 2), C(16, 2, 2), C(16, 4, 3, unroll=2), C(16, 2, 2, unroll=2)),
    "backward": (C(64, 4, 2), C(64, 8, 2), C(64, 4, 3), C(128, 8, 2)),
}


#: The head dims the kernels are built for: powers of two (``tl.arange``), at least 16
#: (``tl.dot``), every one with a row in each complete table.
HEAD_DIMS = (32, 64, 128, 256)
#: The largest head dim whose decode steps walk two or four key blocks a step (``multi_block_steps``).
MULTI_BLOCK_MAX_HEAD_DIM = 128


def split_runs(dtype: torch.dtype) -> bool:
    """Whether the kernels skip the masks on blocks every row of a tile sees entirely (the three-run
    walk of 16-bit inputs; ``AttentionTuning.split_runs`` forces either walk)."""
    forced = current_tuning().split_runs
    return dtype != torch.float32 if forced is None else bool(forced)


def supported_head_dim(d: int) -> bool:
    return d in HEAD_DIMS


def multi_block_steps(head_dim: int) -> bool:
    """Whether a decode step at ``head_dim`` may walk two or four key blocks a step
    (``pair_blocks``, ``quad_blocks``). Each pipeline stage of such a step holds two or four key
    blocks and their values: at ``D = 128``, 16-bit, 64 / 128 KiB a stage; at ``D = 256`` twice
    that, so two stages of two blocks (256 KiB) or one of four already exceed an sm90 SM's
    228 KiB of shared memory. ``D = 256`` walks one block a step (the same blocks in the same
    order: the same bits)."""
    return head_dim <= MULTI_BLOCK_MAX_HEAD_DIM


def select_prefill(dtype: torch.dtype, head_dim: int, page_size: int | None = None, *,
                   arch: str | None = None) -> AttnConfig:
    """The prefill tile on ``arch`` (:func:`table`); ``page_size``: that of a paged cache
    (``None``: contiguous or the packed varlen layout). Every choice gives the same bits."""
    if page_size is not None and page_size < KV_BLOCK:
        paged = table("paged_prefill", arch).get((dtype, head_dim))
        if paged is not None:
            return paged
    return table("prefill", arch)[(dtype, head_dim)]


def select_decode(dtype: torch.dtype, head_dim: int, page_size: int | None = None, *, few: bool = False,
                  many: bool = False, arch: str | None = None) -> AttnConfig:
    """The decode tile on ``arch`` (:func:`table`); ``page_size``: that of a paged cache (``None``:
    contiguous); ``few``: the few-programs tile (``launch.cached_forward``: fewer (sequence, kv
    head) pairs than SMs, ``few_programs``, and the launch fits one wave, ``one_wave``); ``many``:
    the many-pairs tile (``cached_forward``'s every other decode step); neither: the ``decode``
    table, the default of ``launch.attend`` and ``launch.varlen_forward``. Every choice gives the
    same bits."""
    paged = page_size is not None and page_size < KV_BLOCK
    if few:
        return table("few_paged_decode" if paged else "few_decode", arch)[(dtype, head_dim)]
    if many:
        return table("many_decode", arch)[(dtype, head_dim)]
    return table("decode", arch)[(dtype, head_dim)]


def select_backward(dtype: torch.dtype, head_dim: int, *, arch: str | None = None) -> AttnConfig:
    """The backward's tile on ``arch`` (:func:`table`)."""
    return table("backward", arch)[(dtype, head_dim)]


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The SM count of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def few_programs(num_seqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether a decode step has fewer (sequence, kv head) pairs than the device has SMs (the
    latency-bound regime of ``FEW_DECODE_CONFIGS``); always False off CUDA."""
    return device.type == "cuda" and num_seqs * num_kv_heads < sm_count(device_index(device))


def one_wave(programs: int, device: torch.device) -> bool:
    """Whether a decode launch of ``programs`` (sequence, kv head, split) programs fits one wave of
    the few-programs tile (two 3-stage programs per SM): then ``FEW_DECODE_CONFIGS``' deeper
    pipeline pays, else the many-programs tile does. H200, 4096 keys, steps without the table:
    batch 4 (128 programs) 0.85 of SDPA with 3 stages against 0.59 with 2; batch 16 (512
    programs) 0.77 against 0.91; batch 1 at 32768 keys (256 programs) 0.62 against 0.56. Past one
    wave the many-pairs tile (2 warps, 2 stages, TMA copies) beats the 3-stage tile at 32768 keys
    on a contiguous cache (``tools/benchmarking/attention_decode_gpu.py``: batch 2 77.8 -> 70.9 µs,
    0.86 -> 0.94 of SDPA; batch 4 140.0 -> 135.2 µs; batch 8 262.9 -> 258.4 µs; batch 16 equal).
    Over small pages the two tiles are one configuration. False off CUDA."""
    return device.type == "cuda" and programs <= 2 * sm_count(device_index(device))


#: Most value slices ``value_slices`` picks; a slice keeps at least ``MIN_V_COLUMNS`` columns there
#: (any ``v_slices`` leaving 16 or more columns is valid and gives the same bits).
MAX_V_SLICES = 4
MIN_V_COLUMNS = 32


def value_slices(programs: int, head_dim: int, device: torch.device, small_pages: bool = False) -> int:
    """Value slices (``AttnConfig.v_slices``) for a decode launch of ``programs`` (tile, kv head,
    split) programs: doubled while the doubled grid still fits in one wave of the device's SMs,
    up to ``MAX_V_SLICES`` and slices of ``MIN_V_COLUMNS`` columns; 1 off CUDA. ``small_pages``
    (a paged cache whose pages are shorter than a key block: the 2-stage paged tile): doubled
    while the doubled grid fits two programs per SM, up to ``AttentionTuning.max_paged_v_slices``.

    A decode step of few sequences has few programs (batch 1, 8 kv heads, 4096 keys: 32 on a
    132-SM H200), each walking its split's blocks in sequence; slicing the ``P·V`` columns
    over more programs spreads the value loads (each slice reads the whole key block for its
    scores, and the slices share it through L2). Measured on the H200 (batch 1, D = 128, steps
    without the tile table): 8 programs (512 keys) 0.72 of SDPA unsliced, 0.82 with 4 slices (8
    slices are slower than 4); 32 programs (4096 keys) 0.40 unsliced, 0.44
    with 2, 0.51 with 4; 256 programs (32768 keys) fastest unsliced: the rule's picks. Every
    slicing gives the same bits (tested).

    Over 16-token pages two slices beat four and beat none up to two programs per SM
    (``tools/benchmarking/attention_decode_gpu.py``, four blocks a step on the paged tile): batch
    1 × 4096 keys (32 programs) 14.95 µs with four slices → 14.21 with two, batch 4 × 4096 (128
    programs) 32.05 unsliced → 29.76 µs, batch 4 × 512 (32) 8.80 → 7.86 µs; batch 1 and 2 × 512 equal
    within 1 %. Contiguous caches keep the one-wave rule (batch 1 × 4096 keys: 12.56 µs with four
    slices, 12.45 with two, within the noise)."""
    if device.type != "cuda":
        return 1
    sm = sm_count(device_index(device))
    cap, per_sm = (current_tuning().max_paged_v_slices, 2) if small_pages else (MAX_V_SLICES, 1)
    vs = 1
    while vs < cap and head_dim // (2 * vs) >= MIN_V_COLUMNS and programs * 2 * vs <= per_sm * sm:
        vs *= 2
    return vs


def pair_blocks(programs: int, paged: bool, device: torch.device) -> bool:
    """Whether a decode step on the few-programs tile walks its unmasked blocks two per step
    (``AttnConfig.unroll = 2``, ``rlk_attn_pair``). ``programs``: the launch's programs, value
    slices counted. Contiguous cache: at most one program per SM; paged cache: at most two
    programs per SM. H200 (D = 128, against one block per step):
    contiguous batch 1 at 4096 keys (128 programs with 4 value slices) 0.50 -> 0.52 of SDPA, batch
    4 at 4096 (128 programs) 0.85 -> 0.97, but batch 1 at 32768 (256 programs) 0.94 -> 0.85;
    16-token pages batch 1 at 512 / 4096 / 32768 keys (32 / 128 / 256 programs) 0.70 -> 0.77 /
    0.42 -> 0.46 / 0.82 -> 0.84, batch 4 at 4096 0.60 -> 0.63, but batch 4 at 32768 (1024
    programs) 0.91 -> 0.87. Contiguous steps of one KV split (the prefill kernel) pair too: batch
    16 at 512 keys (128 programs, unsliced) 11.29 -> 10.07 µs, 0.81 -> 0.90 of SDPA (sliced steps
    walk four blocks a step instead, ``quad_blocks``). The same bits either way (tested). False off
    CUDA."""
    if device.type != "cuda":
        return False
    sm = sm_count(device_index(device))
    return programs <= (2 * sm if paged else sm)


def quad_blocks(v_slices: int) -> bool:
    """Whether a decode step on the few-programs tile walks its unmasked blocks four per step
    (``AttnConfig.unroll = 4``, ``rlk_attn_quad``): where ``value_slices`` sliced it (``v_slices
    >= 2``: the grid is a fraction of the SMs, so each program's walk is the step's critical
    path), unless ``AttentionTuning.four_block_steps`` is off; the step runs on ``quad_tile``. H200 (batch 1, D = 128,
    bf16, 4 value slices; the benchmark's ``.no_quad`` rows, the two-block walk, side by side):
    contiguous 512 keys 0.82 -> 1.07 of SDPA, 4096 keys 0.63 -> 0.72; 16-token pages 0.76 -> 0.98
    and 0.46 -> 0.61; with the running maxima in block order 1.21 and 0.78 contiguous, 1.06 and 0.63
    on pages. Unsliced launches are slower with it (``tools/benchmarking/attention_decode_gpu.py``:
    batch 1 at 32768 keys 0.97 -> 0.80, batch 4 at 4096 keys 0.98 -> 0.82). The same bits either
    way (tested)."""
    return current_tuning().four_block_steps and v_slices >= 2


def quad_tile(cfg: AttnConfig) -> AttnConfig:
    """The few-programs tile ``cfg`` walking four blocks a step (``quad_blocks``): 4 warps, each
    holding one block of a step (the 2-warp paged tile takes 4 here). H200, batch 1 over
    16-token pages, 4 value slices: 512 keys 0.85 -> 0.98 of SDPA, 4096 keys 0.51 ->
    0.60 with 4 warps (2 stages) against 2. The same bits."""
    return replace(cfg, num_warps=4, unroll=4)


def shipped_forward_configs(dtype: torch.dtype, head_dim: int) -> list[AttnConfig]:
    """Every forward configuration a call can use for ``(dtype, head_dim)`` on any architecture
    with a table in the package (the tests cover each): the prefill tiles, the decode tiles (fewer
    and many pairs), and the few-programs decode tiles with every value slicing ``value_slices``
    can choose, each with one and two blocks per step (``pair_blocks``; one only where
    ``multi_block_steps`` is False)."""
    out: list[AttnConfig] = []
    for arch in shipped_arches():
        multi = multi_block_steps(head_dim)
        few = [replace(select_decode(dtype, head_dim, page, few=True, arch=arch), unroll=u) for page in (None, 1)
               for u in ((1, 2) if multi else (1,))]
        # sliced: by value_slices' rule; a sliced step also walks four blocks a step (quad_blocks)
        sliced = [replace(t, v_slices=v) for c in few for v in (2, 4, 8)
                  if v <= MAX_V_SLICES and head_dim // v >= MIN_V_COLUMNS
                  for t in ((c, quad_tile(c)) if multi else (c,))]
        for cfg in (select_prefill(dtype, head_dim, arch=arch), select_prefill(dtype, head_dim, page_size=1, arch=arch),
                    *(select_decode(dtype, head_dim, page, many=many, arch=arch) for page in (None, 1)
                      for many in (False, True)),
                    *few, *sliced):
            if cfg not in out:
                out.append(cfg)
    return out


_GRID_YZ = 65535  # the CUDA grid's y / z extent limit


def split_grid_order(tiles: int, kv_heads: int, split_programs: int, device: torch.device) -> int:
    """The ``ORDER`` constant of ``rlk_attn_fwd_split`` (0 tiles, 1 kv heads, 2 splits fastest) for
    ``AttentionTuning.split_grid``. ``"auto"``: splits first when the step has fewer (tile, kv head) pairs than
    SMs (``few_programs``: the slices and splits of one pair spread over the GPU), kv heads first
    otherwise. Tiles first wherever the order would put more than 65 535 programs on the grid's
    y or z axis."""
    chosen = current_tuning().split_grid
    if chosen == "auto":
        order = 2 if few_programs(tiles, kv_heads, device) else 1
    else:
        order = GRID_ORDERS.index(chosen)
    yz = ((kv_heads, split_programs), (tiles, split_programs), (tiles, kv_heads))[order]
    return order if max(yz) <= _GRID_YZ else 0


def combine_group(splits: int) -> int:
    """Splits ``rlk_attn_combine`` loads before merging them, per trip: ``splits`` (the launch's
    bound on a tile's KV splits) rounded up to a power of two, at most 16. Any group size gives
    the same bits (the splits past a tile's last merge as exact identities)."""
    if splits < 1:
        raise ValueError(f"splits: expected at least 1, got {splits}")
    return min(16, 1 << (splits - 1).bit_length())


def num_splits(max_positions: int) -> int:
    """KV splits of 1024 keys covering ``max_positions`` cache positions (at least one): the
    decode split grid (``AttentionTuning.split_blocks`` blocks a split)."""
    return max(1, -(-int(max_positions) // (KV_BLOCK * current_tuning().split_blocks)))


def tile_free_rows() -> bool:
    """Whether a decode step with one query token per sequence forms its tile rows from ``q_pos``
    (``rlk_attn_rows(ONE=True)``) instead of launching ``rlk_attn_tiles`` first. Both give the
    same integers, hence the same bits (tested); this only decides speed: every such step goes
    without the table (``AttentionTuning.tile_free_rows=False`` brings it back).
    Measured on the H200: without the table launch a step is 2.3-3.9 µs faster through the
    one-split prefill kernel, 1.7-6 µs faster on 16-token pages and 8 µs faster at batch 1 and
    32768 keys, and faster with few (sequence, kv head) pairs (batch 4 at 4096 keys 0.65 -> 0.85
    of SDPA); the 2-warp tile of steps with many pairs (``MANY_DECODE_CONFIGS``) gives 0.91 of
    SDPA without the table against 0.88 with it (batch 64 at 4096 keys; the 4-warp split kernel
    there is slower without it, 0.86 against 0.90, which is one reason it is not that step's
    tile)."""
    forced = current_tuning().tile_free_rows
    if forced is not None:
        return forced
    return True


def use_decode_path(num_tokens: int, num_seqs: int, group: int) -> bool:
    """The path rule of ``cached_attention``: the split-parallel (decode) kernels when the query
    rows average at most one 16-row tile per sequence. Both paths give the same bits (tested), so
    the rule only decides speed."""
    return num_tokens * group <= 16 * max(num_seqs, 1)


# ----------------------------------------------------------------------------------------------
# Launch-size bands of the Hopper kernels (sm90; ``eligibility`` says where they may run)


def wg_decode_programs(programs: int, device: torch.device) -> bool:
    """Whether a paged decode launch of ``programs`` (tile, kv head, split, value slice) programs
    runs its splits on the warpgroup kernel (``AttentionTuning.wg_decode_band``: half a program to two programs
    per SM). The kernel keeps a block's pages in flight by TMA copies where the Triton kernel
    gathers them by pointer loads; that pays while an SM holds at most two programs. H200
    (``tools/benchmarking/attention_decode_gpu.py``, 16-token pages, 2 ring
    slots, against the Triton kernels, µs): batch 4 x 4096 keys (256 programs with 2 value
    slices) 29.6 -> 23.1 (0.77 -> 0.99 of SDPA), batch 8 x 4096 (256) 40.7 -> 37.7, batch 1 x
    16384 (256) 30.0 -> 23.4, batch 1 x 32768 (256) 44.1 -> 40.8 (0.86 -> 0.93), batch 32 x 512
    (256, one split) 22.8 -> 19.6, batch 8 x 512 (128) 9.5 -> 7.9, batch 16 x 512 (256) 13.9 ->
    13.6, batch 2 x 4096 (128) equal. Below the band the 64-row ``wgmma`` step's longer chain per
    block costs: batch 1 x 4096 keys (64 programs) 14.2 -> 15.3. Above it, where the Triton
    kernel's smaller tiles keep three programs an SM, within 3 % either way: batch 16 x 4096
    (512) 69.0 -> 70.4, batch 2 x 32768 (512) 72.2 -> 74.6, batch 4 x 32768 (1024) 138.0 ->
    139.6, batch 32 x 4096 (1024) 135.3 -> 132.5, batch 64 x 4096 (2048) 260.1 -> 255.6, batch
    64 x 512 and 64 x 32768 equal. False off CUDA."""
    if device.type != "cuda":
        return False
    sm = sm_count(device_index(device))
    lo, hi = current_tuning().wg_decode_band
    return lo * sm <= programs <= hi * sm


def wgt_decode_programs(programs: int, paged: bool, device: torch.device) -> bool:
    """Whether a decode launch of ``programs`` (tile, kv head, split, value slice) programs runs its splits on
    ``hopper_transposed_decode.rlk_attn_split_wgt`` (``AttentionTuning.wgt_decode_bands[paged]``: up to four
    programs per SM, either cache). H200 (``tools/benchmarking/attention_decode_gpu.py``, 2 value slices,
    against the Triton and warpgroup split kernels, µs): contiguous batch 1 x 512 keys 6.78 -> 6.55, 4 x 512
    7.99 -> 7.22, 8 x 512 8.56 -> 7.14 (1.08 -> 1.30 of SDPA), 4 x 4096 23.5 -> 21.1, 1 x 16384 25.3 -> 23.1,
    1 x 32768 40.1 -> 38.0 (0.95 -> 1.00), 1 x 4096 12.7 -> 12.1 (four blocks a step); 16-key pages (against
    the Triton or the warpgroup kernel, whichever the step took) 8 x 512 8.82 -> 8.54, 4 x 4096 23.4 -> 22.6,
    1 x 16384 25.5 -> 24.6, 1 x 32768 40.7 -> 40.5, 2 x 4096 equal. Below three quarters of a program an SM
    over pages the Triton kernel's four-block walk beats this kernel's one block a step (batch 1 x 4096, 64
    programs: 14.4 against 15.6); such launches walk four blocks a step with a loader partition
    (``wgt_quad_blocks``), which beats both (14.5 -> 12.1 µs). Past four programs an SM not measured. False
    off CUDA."""
    if device.type != "cuda":
        return False
    sm = sm_count(device_index(device))
    lo, hi = current_tuning().wgt_decode_bands[bool(paged)]
    return lo * sm <= programs <= hi * sm


def wgt_quad_blocks(programs: int, paged: bool, device: torch.device) -> bool:
    """Whether a ``rlk_attn_split_wgt`` launch of ``programs`` programs (value slices counted) walks its unmasked
    runs four blocks a step (``Variant.TRANSPOSED_DECODE_QUAD``): two value slices
    (``AttentionTuning.wgt_value_slices``) and at most ``AttentionTuning.wgt_quad_programs`` programs per SM
    (its two four-block ring slots take 207-221 KiB: one program an SM), either cache (over pages the copies
    are a loader partition's, ``hopper_transposed_decode.rlk_attn_wgt_loader``). H200
    (``tools/benchmarking/attention_decode_gpu.py``, µs, one block a step -> four): contiguous batch 1 x 4096
    keys (64 programs) 12.95 -> 12.10 (0.84 of SDPA; the Triton kernels 12.68), batch 2 x 4096 (128) 12.97 ->
    12.62; past one program an SM it loses (batch 1 x 16384, 256 programs: 23.1 -> 28.3). Over 16-key pages
    each block is four page copies: issued by the computing warps it loses (batch 1 x 4096: 15.6 -> 16.6); by
    a one-warp loader partition (against one block a step without the loader) it wins at every step of at most
    one program an SM: 1 x 1024 keys 12.0 -> 9.7 µs, 1 x 2048 12.9 -> 11.0, 1 x 4096 14.5 -> 12.1 (0.71 ->
    0.86 of SDPA), 2 x 2048 13.8 -> 11.3, 4 x 512 8.2 -> 6.6, 4 x 1024 13.6 -> 9.7, 1 x 512 8.0 -> 7.1; 2 x
    4096 and 8 x 512 equal. False off CUDA."""
    tuning = current_tuning()
    if device.type != "cuda" or tuning.wgt_value_slices != 2:
        return False
    return programs <= tuning.wgt_quad_programs * sm_count(device_index(device))


def wgt_tile_rows(one: bool, group: int, tile_rows: int) -> int:
    """The query rows (``NQ``, the products' ``N``) of ``hopper_transposed_decode.rlk_attn_split_wgt``'s tile: 8 for a
    one-token step (``one``) of at most 8 query heads a kv head, else 16 (a decode tile of at most
    16 rows: ``group`` rows with ``one``, else ``tile_rows``)."""
    rows = group if one else tile_rows
    if rows > 16:
        raise ValueError(f"tile_rows: expected decode tiles of at most 16 query rows, got {rows} "
                         f"(one={one}, group={group}, tile_rows={tile_rows})")
    return 8 if rows <= 8 else 16
