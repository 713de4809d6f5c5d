"""The attention kernels' tuning switches as one context-scoped setting.

``AttentionTuning`` holds every switch the selection rules and launchers read; the shipped
values are its defaults. ``attention_tuning(**changes)`` sets some of them for a block of code
(the current thread or task only) and restores the previous setting in ``finally``, an
exception included; blocks nest. Nothing else changes a switch: no module global is rewritten.

Every switch except ``split_blocks`` only decides speed (which kernel, tile walk, copy or launch
form runs); the GPU tests prove the rows raw-bit equal either way. ``split_blocks`` is the
contract's KV split size (16 blocks of 64 keys); the Triton-interpreter tests shrink it to reach
the multi-split paths with small inputs, which changes the rows past the smaller split.

Imports nothing from triton (``import rl_engine`` stays free of it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace

__all__ = ["AttentionTuning", "GRID_ORDERS", "attention_tuning", "current_tuning"]

#: The split kernel's grid orders (``configs.split_grid_order``), besides ``"auto"``.
GRID_ORDERS = ("tiles", "heads", "splits")

#: ``(key ring slots, value ring slots, register cap or None)`` of a Hopper warpgroup forward launch.
RingConfig = tuple[int, int, "int | None"]
#: ``(lo, hi)`` programs per SM.
Band = tuple[float, float]


@dataclass(frozen=True)
class AttentionTuning:
    """The switches of the attention kernels (defaults: the shipped values, measured on the H200).

    Portable Triton kernels:

    * ``split_blocks``: blocks of 64 keys per KV split (the contract's 16: 1024 keys). Changes bits.
    * ``split_runs``: the block walk. 16-bit inputs walk the masked edge blocks and, without any
      mask, the interior blocks every row of a tile sees entirely (three runs); fp32 (IEEE products
      by FMA: a correctness path, not the speed target) walks every block with the masks (one run,
      a third of the code to compile). ``None``: by dtype; ``True`` / ``False`` forces one walk
      (the tests compare both).
    * ``tile_free_rows``: ``None``: the rule of ``configs.tile_free_rows`` (every decode step of
      one token per sequence forms its tile rows from ``q_pos``); ``True`` / ``False`` forces it.
    * ``pdl``: programmatic dependent launch on sm90+ (``eligibility.use_pdl``): the kernel that
      reads a tile table (or the split workspace) is launched while the kernel writing it still
      runs and waits on the device before its first load; 2-5 % of a short decode step on the
      H200 (batch 1, 512 keys: 12.5 against 13.0 µs). ``False``: plain launches.
    * ``tma_loads``: the train path's forward loads its key / value blocks by TMA copies
      (``eligibility.tma_eligible``). H200, pointer loads -> TMA: prefill 0.53 -> 0.59 / 0.51 ->
      0.60 of SDPA at 32 x 512 / 4 x 4096, the training forward 0.44 -> 0.48 / 0.53, forward +
      backward 0.58 -> 0.60.
    * ``decode_tma_loads``: decode steps over a contiguous cache load the blocks of their unmasked
      run by TMA copies (``eligibility.decode_tma_eligible``).
    * ``auto_value_slices``: ``launch.cached_forward`` picks a value slicing by
      ``configs.value_slices`` for decode steps with few programs (batch 1 on the H200: 0.72 ->
      0.82 of SDPA at 512 keys and 0.40 -> 0.51 at 4096 with 4 slices, 32768 keys unsliced).
    * ``max_paged_v_slices``: most value slices ``configs.value_slices`` picks over a cache of pages
      shorter than a key block (the paged few-programs tile, the ``few_paged_decode`` table;
      two beat four there, measured in ``value_slices``' docstring).
    * ``four_block_steps``: sliced few-programs decode steps walk their unmasked run four blocks
      a step (``configs.quad_blocks``).
    * ``split_grid``: the split kernel's grid order (``configs.split_grid_order``): ``"tiles"``
      (tiles fastest, then kv heads, then splits), ``"heads"`` (kv heads fastest: the programs
      that start together read the same cache rows' heads), ``"splits"`` (splits and value slices
      fastest: together they read one sequence's consecutive splits, the slices of a split the
      same keys), or ``"auto"`` (the rule). Launch order only. H200 (decode benchmark,
      ``.grid_*`` rows): batch 1 × 4096 keys splits-first 12.51 µs against 12.93 tiles-first
      (16-token pages 14.77 against 15.98; 32768 keys equal within 0.3 %), batch 64 heads-first
      248.5 against 250.1 µs at 4096 keys (pages 267.7 / 268.8; 32768 keys 1927 / 1939, pages
      1940 / 1953) and splits-first slower there (256.1).

    Hopper warpgroup kernels (``hopper_warpgroup``):

    * ``wg_forward``: the train path's forward runs ``rlk_attn_fwd_wg`` where
      ``eligibility.wg_eligible`` allows.
    * ``wg_forward_rings``: the forward's launch configuration by whether the launch merges KV
      splits (index 0: no merge, 1: some sequence longer than one split): TMA ring slots for key
      and value blocks (16 KiB each, ``Q`` 16 KiB) and the register cap per thread (``maxnreg``;
      ``None``: the compiler's choice). One key and two value slots (64 KiB) at 160 or 168
      registers let three programs share an SM instead of two (3 × 128 × 168 = 64 512 of 65 536);
      the walks' loops do not spill at the shipped caps, except one reloaded loop invariant a trip
      with a window and merges (the merges between walks spill a few bytes, outside the loops;
      offline sm_90 compile, ``benchmarks/profiling/attention_resources_sm90.py``). H200 (the
      probe, three programs against two uncapped slots each): 0.69 -> 0.83 of SDPA at 32 x 512,
      0.69 -> 0.77 at 4 x 4096; two key slots and one value slot give 0.79 at 32 x 512. Launches
      without merges take 168 (round-robin: 0.887 at 160 -> 0.910 of SDPA at 32 x 512); launches
      with merges take 160 (0.853 at 160 against 0.818 at 168, 4 x 4096). The probe tool
      ``tools/benchmarking/attention_wg_gpu.py`` checks and times others.
    * ``wg_forward_block_m``: the forward tile's query rows (one warpgroup, 16 rows a warp;
      128-row tiles of two warpgroups are slower on the H200).
    * ``wg_decode``: paged decode steps run their splits on ``rlk_attn_split_wg`` where
      ``eligibility.wg_decode_eligible`` and ``configs.wg_decode_programs`` allow.
    * ``wg_decode_band``: the paged decode launches whose splits take ``rlk_attn_split_wg``: from
      ``lo`` to ``hi`` programs per SM (value slices counted; ``configs.wg_decode_programs``).
    * ``wg_decode_slots``: ``rlk_attn_split_wg``'s TMA ring slots (key and value blocks, 16 KiB
      each at ``D = 128``, 16-bit). H200 (16-token pages, batch 1-64 at 4096 and 32768 keys): 2
      slots fastest at every size (batch 1 x 32768 keys 43.1 µs against 45.3 / 50.1 / 52.3 with
      3 / 4 / 6; batch 4 x 4096 23.8 against 25.0 / 25.0 / 37.3).

    Hopper transposed decode (``hopper_transposed_decode``):

    * ``wgt_decode``: decode steps run their splits on ``rlk_attn_split_wgt`` where
      ``eligibility.wgt_decode_eligible`` and ``configs.wgt_decode_programs`` allow.
    * ``wgt_decode_bands``: its launches from ``lo`` to ``hi`` programs per SM (value slices
      counted), ``(contiguous cache, paged cache)``.
    * ``wgt_value_slices``: value slices of its launches (1 or 2; its ``Vᵀ·Pᵀ`` product needs
      64-row slices).
    * ``wgt_quad_programs``: launches of at most this many programs per SM (value slices counted)
      walk their unmasked runs four blocks a step (``configs.wgt_quad_blocks``; 64 value columns:
      two slices). 0 turns four blocks a step off, ``inf`` on for every launch.
    * ``wgt_decode_slots`` / ``wgt_quad_slots``: its TMA ring slots (key and value blocks, 16 KiB
      each at ``D = 128``, 16-bit; 8 KiB for 64 value columns) for one block a step, and slots of
      four blocks for four blocks a step (2: 211 KiB at 64 value columns).
    """

    split_blocks: int = 16
    split_runs: bool | None = None
    tile_free_rows: bool | None = None
    pdl: bool = True
    tma_loads: bool = True
    decode_tma_loads: bool = True
    auto_value_slices: bool = True
    max_paged_v_slices: int = 2
    four_block_steps: bool = True
    split_grid: str = "auto"
    wg_forward: bool = True
    wg_forward_rings: tuple[RingConfig, RingConfig] = ((1, 2, 168), (1, 2, 160))
    wg_forward_block_m: int = 64
    wg_decode: bool = True
    wg_decode_band: Band = (0.5, 2.0)
    wg_decode_slots: int = 2
    wgt_decode: bool = True
    wgt_decode_bands: tuple[Band, Band] = ((0.0, 4.0), (0.0, 4.0))
    wgt_value_slices: int = 2
    wgt_quad_programs: float = 1.0
    wgt_decode_slots: int = 2
    wgt_quad_slots: int = 2

    def __post_init__(self) -> None:
        if self.split_blocks < 1:
            raise ValueError(f"split_blocks: expected at least 1, got {self.split_blocks}")
        if self.split_grid not in ("auto", *GRID_ORDERS):
            raise ValueError(f"split_grid: expected 'auto' or one of {GRID_ORDERS}, got {self.split_grid!r}")
        if self.wgt_value_slices not in (1, 2):
            raise ValueError(f"wgt_value_slices: expected 1 or 2 (64-column value slices at least), "
                             f"got {self.wgt_value_slices}")


_TUNING: contextvars.ContextVar[AttentionTuning] = contextvars.ContextVar("rlk_attention_tuning",
                                                                          default=AttentionTuning())


def current_tuning() -> AttentionTuning:
    """The setting in effect here (the shipped defaults outside any ``attention_tuning`` block)."""
    return _TUNING.get()


@contextlib.contextmanager
def attention_tuning(**changes: object) -> Iterator[AttentionTuning]:
    """Inside the block, the current setting with the fields ``changes`` replaced (unknown names and
    invalid values raise before the block runs); the previous setting is restored in ``finally``.
    Yields the setting in effect inside the block."""
    token = _TUNING.set(replace(_TUNING.get(), **changes))
    try:
        yield _TUNING.get()
    finally:
        _TUNING.reset(token)
