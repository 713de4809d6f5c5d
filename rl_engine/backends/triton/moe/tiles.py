"""Which tile configuration each grouped GEMM of the MoE layer launches: a table per device
architecture, as data.

The layer runs six grouped GEMMs (**roles**):

========== ============================================ =========================
role        product                                      kernel
========== ============================================ =========================
gate_up     ``h = x W_gate_up[e]ᵀ`` (forward)            ``rlk_moe_grouped_gemm``
down        ``y = act W_down[e]ᵀ`` (forward)             ``rlk_moe_grouped_gemm``
dx          ``dh W_gate_up[e]`` (input gradient)         ``rlk_moe_grouped_gemm``
dact        ``w · fp32(g W_down[e])`` (input gradient)   ``rlk_moe_grouped_gemm``
dw_gate_up  ``Σ dhᵀ x`` (weight gradient)                ``rlk_moe_wgrad``
dw_down     ``Σ round(w · g)ᵀ act`` (weight gradient)    ``rlk_moe_wgrad``
========== ============================================ =========================

A configuration (:class:`GemmConfig`) is a tile shape, warps and pipeline stages, plus three
launch choices: ``w_transposed`` (the input-gradient roles read a contiguous transposed copy of
the expert weights instead of the weights with their rows as the reduction dimension),
``sorted_operands`` (the weight-gradient roles gather both operands into the sorted slot order
before the kernel, so its loads follow the slot index) and ``masked_loads`` (where a tile's
contiguous dimension is its output columns — the input and weight gradients — the columns past
the edge are masked instead of clamped to column 0, which keeps the offsets provably contiguous
for the compiler's vectorised loads; the clamped form is what the forward uses, whose contiguous
dimension is the reduction). No choice changes a bit: every
configuration multiplies the same values in the same order with fp32 accumulation — ``BLOCK_K``
consumes the reduction in steps whose products the tensor cores add in order, 16 at a time —
and ``tools/benchmarking/moe_tiles_gpu.py``, which measures the candidates, keeps only those
whose outputs equal the reference configuration's (:data:`DEFAULT`) on raw bits; the GPU tests
check every configuration a table ships.

The table of an architecture (``tile_tables/<arch>.json``, e.g. ``sm90``) is written by that
tool from its measurements: for each role and 16-bit dtype, rows of ``max_slots_per_expert``
(the mean number of slots per expert, ``T·K / E``, a host number: choosing costs no
synchronisation) and the configuration that was fastest at that load. A call takes the first row
whose bound is at least its load; beyond the largest measured load (a table does not extrapolate:
the best tile changes with the load), where no table exists (other architectures, fp32, the CPU
interpreter) and for a role without rows, :data:`DEFAULT`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from rl_engine.backends.triton import ArchFiles, arch_of
from rl_engine.utils.schema import StrictModel

__all__ = ["ROLES", "DEFAULT", "GemmConfig", "TileRow", "TileTable", "select", "load_table", "shipped_configs",
           "table_path"]

ROLES = ("gate_up", "down", "dx", "dact", "dw_gate_up", "dw_down")
Role = Literal["gate_up", "down", "dx", "dact", "dw_gate_up", "dw_down"]

_KEY = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(T?)(S?)(M?)")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One grouped-GEMM launch: ``block_m`` slots (or, for a weight gradient, output rows) ×
    ``block_n`` output columns per program, the reduction in steps of ``block_k``; ``num_warps``,
    ``num_stages`` (software pipeline depth); ``w_transposed``, ``sorted_operands`` and
    ``masked_loads`` (module docstring)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    w_transposed: bool = False
    sorted_operands: bool = False
    masked_loads: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name}: expected a positive power of two, got {v!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages: expected a positive int, got {self.num_stages!r}")

    @property
    def key(self) -> str:
        flags = ("T" if self.w_transposed else "") + ("S" if self.sorted_operands else "") + (
            "M" if self.masked_loads else "")
        return f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}{flags}"

    @classmethod
    def from_key(cls, key: str) -> GemmConfig:
        """The configuration whose :attr:`key` is ``key`` (``"16x128x128w4s3"``, ``"...T"``, ``"...SM"``)."""
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"key: expected BMxBNxBKwWARPSsSTAGES[T][S][M], got {key!r}")
        bm, bn, bk, w, st, t, so, ml = m.groups()
        return cls(int(bm), int(bn), int(bk), int(w), int(st), w_transposed=bool(t), sorted_operands=bool(so),
                   masked_loads=bool(ml))


#: The reference configuration: what every role launches without a table, and what the tuning
#: tool compares each candidate's bits against.
DEFAULT = GemmConfig()


class _Config(StrictModel):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    w_transposed: bool = False
    sorted_operands: bool = False
    masked_loads: bool = False


class TileRow(StrictModel):
    """One row: loads up to ``max_slots_per_expert`` (``None``: any load) launch ``config``; ``ms`` /
    ``default_ms`` are the measured medians (ms) of that configuration and of :data:`DEFAULT` at
    the load the row was chosen at."""

    role: Role
    dtype: Literal["bfloat16", "float16"]
    max_slots_per_expert: float | None = Field(default=None, gt=0)
    config: _Config
    ms: float | None = None
    default_ms: float | None = None


class TileTable(StrictModel):
    schema_version: Literal[1]
    arch: str
    source: dict[str, str]
    rows: list[TileRow]


def _config(row: TileRow) -> GemmConfig:
    return GemmConfig(**row.config.model_dump())


def load_table(path: str | Path) -> dict[tuple[str, torch.dtype], tuple[tuple[float, GemmConfig], ...]]:
    """The rows of a table file by ``(role, dtype)``, ordered by bound (``inf`` for an unbounded row).

    Raises:
        ValueError: the file is not a valid table (the message names the field), a configuration
            is invalid, or a role's rows repeat a bound or put the unbounded row before another.
    """
    table = TileTable.model_validate(json.loads(Path(path).read_text()))
    out: dict[tuple[str, torch.dtype], list[tuple[float, GemmConfig]]] = {}
    for row in table.rows:
        bound = float("inf") if row.max_slots_per_expert is None else row.max_slots_per_expert
        out.setdefault((row.role, getattr(torch, row.dtype)), []).append((bound, _config(row)))
    for key, rows in out.items():
        bounds = [b for b, _ in rows]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{path}: rows of {key[0]} ({key[1]}): expected strictly increasing "
                             f"max_slots_per_expert, got {bounds}")
    return {k: tuple(v) for k, v in out.items()}


_FILES = ArchFiles(Path(__file__).with_name("tile_tables"), load_table)
table_path = _FILES.path


def _arch_table(arch: str) -> dict[tuple[str, torch.dtype], tuple[tuple[float, GemmConfig], ...]]:
    return _FILES.get(arch) or {}


def select(role: str, dtype: torch.dtype, slots_per_expert: float, device: torch.device) -> GemmConfig:
    """The configuration ``role`` launches for ``dtype`` at a mean load of ``slots_per_expert``
    on ``device`` (:data:`DEFAULT` for a device without a table and for the CPU interpreter)."""
    arch = arch_of(device)
    if arch is None:
        return DEFAULT
    rows = _arch_table(arch).get((role, dtype))
    for bound, cfg in rows or ():
        if slots_per_expert <= bound:
            return cfg
    return DEFAULT  # beyond the largest measured load: the reference configuration


def shipped_configs(arch: str) -> list[GemmConfig]:
    """:data:`DEFAULT` and every configuration the table of ``arch`` can launch (the GPU tests
    cover each)."""
    out = [DEFAULT]
    for rows in _arch_table(arch).values():
        for _, cfg in rows:
            if cfg not in out:
                out.append(cfg)
    return out
