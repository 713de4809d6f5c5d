"""Where each kernel variant may run: device, dtype, layout and switch conditions (pure rules,
no device touched for CPU tensors), and the choice of ``configs.Variant`` they give the launchers.

Nothing here imports triton at import time (``has_gluon_hopper`` imports it when asked). A rule
that answers False sends the call to another variant with the same bits (GPU tests), so these
rules decide speed and what the hardware can do, never a row's value.
"""

from __future__ import annotations

import functools

import torch

from rl_engine.backends.triton import arch_of
from rl_engine.backends.triton.attention import configs
from rl_engine.backends.triton.attention.configs import COMPILED_CUDA, AttnConfig, Variant, device_index
from rl_engine.backends.triton.attention.tuning import current_tuning

__all__ = [
    "WG_DECODE_PAGE_SIZES",
    "capability",
    "copyable_rows",
    "use_pdl",
    "tma_eligible",
    "decode_tma_eligible",
    "has_gluon_hopper",
    "wg_eligible",
    "wg_decode_eligible",
    "wgt_decode_eligible",
    "train_variant",
    "decode_variant",
]

#: The page sizes ``hopper_warpgroup.rlk_attn_split_wg`` and
#: ``hopper_transposed_decode.rlk_attn_split_wgt`` copy (a 64-key block is ``64 / page_size`` page
#: copies, at most four).
WG_DECODE_PAGE_SIZES = (16, 32)


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)


def copyable_rows(*rows: torch.Tensor) -> bool:
    """Whether key / value rows ``[N, Hkv, D]`` fit a TMA copy of their ``[N, Hkv·D]`` view: heads
    contiguous (head stride ``D``, unit stride along ``D``), a 16-byte aligned base address and
    row stride (the copy's rules; ``tma_eligible``, ``decode_tma_eligible``)."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
               and (t.stride(0) * t.element_size()) % 16 == 0 for t in rows)


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (``AttentionTuning.pdl``,
    a compiled CUDA kernel, sm90 or newer)."""
    if not (current_tuning().pdl and COMPILED_CUDA and device.type == "cuda"):
        return False
    return capability(device_index(device)) >= (9, 0)


def tma_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttnConfig) -> bool:
    """Whether ``launch.varlen_forward`` loads key / value blocks by TMA copies
    (``Variant.PACKED_TMA``): ``AttentionTuning.tma_loads`` on, one value slice, an sm90+ CUDA
    device, ``k`` / ``v`` rows whose heads are contiguous (``[T, Hkv, D]`` with head stride ``D``) at 16-byte aligned
    addresses and row strides (the copy's rules), and a NaN policy other than ``"propagate"``:
    the copies read a block's rows past its queries (later tokens, the next sequence) unclamped,
    which is exact only for finite inputs (masked ``P = +0`` times a finite value): every policy
    but ``"propagate"`` assumes those (``"raise"`` checks them; under the default a NaN input
    may reach other rows), while under ``"propagate"`` a NaN must stay in its own rows.
    Otherwise the pointer loads, with the same bits. Not in the Triton interpreter (CPU tensors):
    its ``tl.dot`` is numpy's matmul, whose bits change with the operand layout (the copies give
    a transposed key view) differently for different tile rows, an artifact of the interpreter;
    its TMA test forces the copies at one tile shape."""
    from rl_engine.utils.checks import current_nan_policy

    if not current_tuning().tma_loads or cfg.v_slices != 1 or current_nan_policy() == "propagate":
        return False
    if q.device.type != "cuda" or capability(device_index(q.device)) < (9, 0):
        return False
    return copyable_rows(k, v)


def decode_tma_eligible(k_rows: torch.Tensor, v_rows: torch.Tensor, paged: bool, device: torch.device) -> bool:
    """Whether a decode step (``launch.cached_forward``, decode path) loads the blocks every row of
    its tiles sees entirely by TMA copies (``Variant.CACHE_TMA``): ``AttentionTuning.decode_tma_loads``
    on, a contiguous cache (one ``page_rows`` column; a 16-row page cannot hold a 64-row box), an sm90+
    CUDA device, storage rows whose heads are contiguous (``[N, Hkv, D]``, head stride ``D``) at
    16-byte aligned addresses and row strides, 16-bit rows. The copies read only rows at or
    before every query position of the tile (written cache rows); the masked blocks, whose rows
    may run past a sequence's end into stale slots, keep the pointer loads clamped to the tile's
    last position, so no NaN policy is needed. ``device``: the step's (the query's) device.
    Otherwise the pointer loads, with the same bits. (fp32 keeps the pointer loads: its IEEE
    products are the correctness path, not the speed target.)"""
    if not current_tuning().decode_tma_loads or paged or device.type != "cuda" or k_rows.dtype == torch.float32:
        return False
    if capability(device_index(device)) < (9, 0):
        return False
    return copyable_rows(k_rows, v_rows)


@functools.lru_cache(maxsize=None)
def has_gluon_hopper() -> bool:
    """Whether this Triton has the Gluon Hopper API the warpgroup kernel is written against
    (Triton 3.6: the names the ``hopper_*`` modules import, and TMA copies by
    ``async_copy_global_to_shared``, which Triton 3.9 renamed ``async_load``)."""
    import triton

    if not triton.__version__.startswith("3.6."):
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper
    except ImportError:
        return False
    names = ("fence_async_shared", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait")
    return all(hasattr(hopper, n) for n in names) and hasattr(hopper.tma, "async_copy_global_to_shared")


def _wg_query(q: torch.Tensor) -> bool:
    """The conditions both Hopper warpgroup kernels put on the query: 16-bit with ``D = 128`` on an
    sm90 CUDA device (``wgmma`` is Hopper's; sm100 has none)."""
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[2] != 128:
        return False
    return q.device.type == "cuda" and capability(device_index(q.device))[0] == 9 and torch.version.hip is None


def wg_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: AttnConfig | None) -> bool:
    """Whether ``launch.varlen_forward`` runs the Hopper warpgroup kernel (``hopper_warpgroup.rlk_attn_fwd_wg``):
    ``AttentionTuning.wg_forward`` on, no forced ``config`` (tests that force one compare the Triton kernel's
    tiles), 16-bit inputs with ``D = 128``, an sm90 device (``wgmma`` is Hopper's; sm100 has none), Triton
    3.6's Gluon Hopper API, and the TMA copies' conditions (``tma_eligible``: the copies read rows past a
    tile's queries unclamped). Otherwise the Triton kernel, with the same bits (GPU tests)."""
    if not current_tuning().wg_forward or config is not None or not _wg_query(q):
        return False
    if not tma_eligible(q, k, v, configs.select_prefill(q.dtype, q.shape[2], arch=arch_of(q.device))) \
            or not has_gluon_hopper():
        return False
    return True


def wg_decode_eligible(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, page_size: int, paged: bool,
                       window: int | None) -> bool:
    """Whether a decode step's splits run ``hopper_warpgroup.rlk_attn_split_wg``
    (``Variant.WARPGROUP_PAGED_DECODE``): ``AttentionTuning.wg_decode`` on, a paged cache of
    ``WG_DECODE_PAGE_SIZES`` pages, no window, 16-bit inputs with ``D = 128``, an sm90 device with Triton
    3.6's Gluon Hopper API, and storage rows a TMA copy can read (``copyable_rows``) with row indices below
    ``2^31`` (the copies' coordinates). Otherwise ``portable_forward.rlk_attn_fwd_split``, with the same bits
    (GPU tests)."""
    if (not current_tuning().wg_decode or not paged or window is not None
            or int(page_size) not in WG_DECODE_PAGE_SIZES):
        return False
    if not _wg_query(q) or k_rows.shape[0] >= 1 << 31:
        return False
    return copyable_rows(k_rows, v_rows) and has_gluon_hopper()


def wgt_decode_eligible(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, page_size: int, paged: bool,
                        window: int | None, one: bool, tile_rows: int) -> bool:
    """Whether a decode step's splits may run ``hopper_transposed_decode.rlk_attn_split_wgt``
    (``Variant.TRANSPOSED_DECODE``): ``AttentionTuning.wgt_decode`` on, a contiguous cache or one of
    ``WG_DECODE_PAGE_SIZES`` pages, no window, 16-bit inputs with ``D = 128`` on sm90 with Triton
    3.6's Gluon Hopper API (``_wg_query``), storage rows a TMA copy can read with row indices below
    ``2^31``, and decode tiles of at most 16 query rows (``one``: one token a sequence, ``G`` rows;
    else ``tile_rows``). Otherwise the other kernels, with the same bits (GPU tests)."""
    if (not current_tuning().wgt_decode or window is not None
            or (paged and int(page_size) not in WG_DECODE_PAGE_SIZES)):
        return False
    rows = q.shape[1] // k_rows.shape[1] if one else tile_rows
    if rows > 16 or not _wg_query(q) or k_rows.shape[0] >= 1 << 31:
        return False
    return copyable_rows(k_rows, v_rows) and has_gluon_hopper()


def train_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttnConfig) -> Variant:
    """The variant of a train-path forward through ``launch.attend``: ``PACKED_TMA`` where
    ``tma_eligible``, else ``POINTER_LOADS``."""
    return Variant.PACKED_TMA if tma_eligible(q, k, v, cfg) else Variant.POINTER_LOADS


def decode_variant(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, page_size: int, paged: bool,
                   window: int | None, *, one: bool, cfg: AttnConfig, programs: int | None) -> Variant:
    """The variant of a decode step (``launch.cached_forward``, decode path). ``cfg``: the step's
    tile (sizes the table and the combine); ``programs``: its (tile, kv head, split) programs,
    ``None`` when the caller forced ``cfg`` (then only the portable kernels run, so that a forced
    tile is what runs); ``one``: one query token per sequence, no tile table.

    The splits run the transposed Hopper kernel where it is eligible and its band
    (``configs.wgt_decode_programs``, its own value slices counted) takes the step (four blocks a
    step where ``configs.wgt_quad_blocks`` says so); else, over pages, the warpgroup kernel where it
    is eligible and its band (``configs.wg_decode_programs``) takes the step; else the portable
    kernels, their unmasked run by TMA copies over a contiguous cache (``decode_tma_eligible``)."""
    if programs is not None:
        wgt_programs = programs * current_tuning().wgt_value_slices
        if (wgt_decode_eligible(q, k_rows, v_rows, page_size, paged, window, one, cfg.block_m)
                and configs.wgt_decode_programs(wgt_programs, paged, q.device)):
            if configs.wgt_quad_blocks(wgt_programs, paged, q.device):
                return Variant.TRANSPOSED_DECODE_QUAD
            return Variant.TRANSPOSED_DECODE
        if (wg_decode_eligible(q, k_rows, v_rows, page_size, paged, window)
                and configs.wg_decode_programs(programs * cfg.v_slices, q.device)):
            return Variant.WARPGROUP_PAGED_DECODE
    return Variant.CACHE_TMA if decode_tma_eligible(k_rows, v_rows, paged, q.device) else Variant.POINTER_LOADS
