"""Triton ``attention.varlen_attention`` and ``attention.cached_attention`` for CUDA (written for
sm90) and ROCm (declared, untested): the blocked online softmax of the CPU backend
(``rl_engine/backends/cpu/attention``, docs/design/attention.md) as GPU kernels.

Per query row at position ``p`` (``W`` the window or ∞): KV blocks of 64 keys at absolute
positions, the row's range ``lo = max(0, p-W+1) // 64 .. hi = p // 64``; KV splits of 16 blocks
(1024 keys) at absolute positions; inside a split the fp32 online softmax in base-2 units
(GPU-only definitions every kernel shares: ``s = q·kᵀ`` unscaled, ``c = scale · log2 e``,
``m' = max(m, rowmax(s)·c + 0)``, ``α = 2^(m - m')``, ``P = 2^fma(s, c, -m')``,
``l = fma(l, α, rowsum(P))``, ``acc = acc·α + P·V`` with ``P·V`` accumulated onto ``acc·α`` by the
MMA), split states merged in increasing split order
(``merge((M, L, A), (m, l, a)) = (M', fma(l, 2^{m-M'}, L·2^{M-M'}), fma(a, 2^{m-M'}, A·2^{M-M'}))``),
``out = ACC · (1 / L)`` (one IEEE reciprocal per row) rounded once, ``lse = (M + log2 L) · ln 2``
(natural units). Masked keys get ``s = -inf``.

GPU bits need not equal the CPU's; on the GPU every row is **raw-bit identical** whatever path
computed it (varlen, full or chunked prefill, decode in any batch, contiguous or paged cache of
any page size, any packing). The rules that make this true:

* **One query tile = up to BLOCK_M rows** ``(token, g)`` of ONE sequence and ONE kv head (GQA
  rows packed ``g`` fastest), so a K/V block is loaded once per tile. ``tl.dot`` row results
  depend only on that row: the key block (64), head dim and dtypes are identical on every path;
  only BLOCK_M (and the warp count) differs between prefill (64/128 rows) and decode (16 rows),
  and the GPU tests prove the rows bitwise equal across every shipped configuration.
* **Row sums never use ``tl.sum``** (whose association follows the register layout): ``rowsum(P)``
  and ``Σ dO⊙O`` are a fixed pairwise tree (``rlk_attn_rowsum``: the CPU's ``fold_sum``,
  ``x[:, :N/2] + x[:, N/2:]`` then halving). ``max`` is exact (``+ 0.0`` turns a ``-0`` maximum into
  ``+0``).
* **Per-row activity**: a row's state changes only in the blocks of its range ``[lo, hi]``:
  outside it every score is ``-inf``, so ``m' = m``, ``α = 1`` and ``P = +0`` exactly (a ``-inf``
  guard on the softmax shift keeps a row that has seen no key at ``(-inf, 0, +0)``), and ``acc``
  is unchanged (exact zeros added to a never ``-0`` accumulator); no per-row select. Every
  split of the tile's range is merged into every row: merging a split the row does not reach,
  ``(-inf, 0, +0)``, is an exact identity (``rlk_attn_merge``). The prefill kernel keeps the
  merged accumulator in a tile-major
  fp32 scratch between splits (one accumulator in registers); the store/reload is exact. When no
  query position reaches 1024 it is compiled without the merge (one split per tile: merging it
  into the initial state is an exact identity).
* **Shared device functions** (``device``: ``rlk_attn_block``, ``rlk_attn_split``,
  ``rlk_attn_merge``, ``rlk_attn_finish``) are used by every kernel; every kernel is compiled with
  ``enable_fp_fusion=False`` and the wanted multiply-adds are explicit ``tl.fma``, so no kernel
  or block variant contracts differently from another.
* **Masks only where needed** (16-bit inputs): a tile walks masked blocks, then the blocks every
  valid row sees entirely without any mask or select (identities there), then masked blocks;
  same operations on the visible entries, so the same bits (fp32 walks all blocks masked;
  ``AttentionTuning.split_runs`` forces either walk, the tests compare both).
* **Flash-decoding**: the decode path runs ``rlk_attn_fwd_split`` with grid (tiles, kv heads,
  splits), one 1024-key split per program into an fp32 workspace, then ``rlk_attn_combine``
  (``split_kv_combine``) folds the splits left to right with the same merge. The prefill path
  folds the same splits in the same order inside one program (``portable_forward``).
  ``cached_attention`` picks the path by ``configs.use_decode_path`` (rows per sequence), which
  cannot change a row's bits.
* **Tile tables** without host sync (``tile_tables``): one kernel ``rlk_attn_varlen_tiles`` from ``cu_seqlens``
  (train path), one single-program kernel ``rlk_attn_tiles`` from ``q_seq``/``q_pos`` (rollout
  path: a decode step is three launches, not ~30 small torch kernels and two launches; a
  decode step with one token per sequence, ``decode_only``, forms its tile rows from ``q_pos``
  and launches no table kernel where ``configs.tile_free_rows`` says so). On
  sm90+ the kernel reading a table (and the combine after the split kernel) is launched with
  programmatic dependent launch and waits on the device for its predecessor
  (``AttentionTuning.pdl``): the launch gap is hidden, nothing computed changes.
* **Paged cache**: key/value rows of position ``pos`` of batch sequence ``i`` are at storage row
  ``page_rows[i, pos // page_size] + pos % page_size`` (packed varlen layout and contiguous
  caches: one column, row ``page_rows[i, 0] + pos``), gathered per block; positions past the
  tile's last query are clamped (never read outside the stored rows) and masked. On sm90+ the
  train path's packed rows arrive by TMA copies of whole blocks (``eligibility.tma_eligible``),
  and a decode step over a contiguous cache copies the blocks every row of a tile sees entirely
  (``eligibility.decode_tma_eligible``; its masked blocks keep the clamped loads).
* **Backward** (``portable_backward``; varlen, deterministic, no atomics): ``rlk_attn_bwd_delta`` (``Σ dO⊙O`` with the
  unrounded fp32 ``O`` for 16-bit inputs), ``rlk_attn_bwd_dq`` (each query tile over its KV
  blocks, increasing, ``P = 2^fma(s, c, -lse·log2 e)`` recomputed) and ``rlk_attn_bwd_dkdv`` (each 64-key
  block of a sequence and kv head over the query blocks that see it, increasing, ``g = 0..G-1``).

Head dims 32, 64, 128 and 256 are supported (``configs.HEAD_DIMS``; the Hopper warpgroup kernels
take ``D = 128``, every other head dim runs the portable kernels, and ``D = 256`` decode steps walk
one key block a step, ``configs.multi_block_steps``); others are rejected by the call check (a
reason in the strict-policy error). The rollout layout must be what ``rl_engine.ops.attention.cached_attention``
builds (a sequence's query rows contiguous, in batch order, at consecutive positions).

Modules, by role (none imports a module above it in this list; ``launch`` imports the Hopper
modules inside the functions that launch them):

* ``__init__``: the registration of both operators with the runtime registry (this module);
* ``launch``: the host launchers (``attend``, ``varlen_forward``, ``cached_forward``,
  ``varlen_backward``, the tile tables);
* ``hopper_warpgroup``, ``hopper_transposed_decode``: the Hopper (sm90) Gluon kernels and their
  launchers, over ``hopper_common`` (their shared Gluon device functions);
* ``portable_forward``, ``portable_backward``, ``split_kv_combine``, ``tile_tables``: the portable
  Triton kernels, over ``device`` (their shared ``@triton.jit`` device functions);
* ``eligibility``: where each kernel variant may run, and the variant a call gets;
* ``configs``: the launch configurations and selection rules, as data;
* ``tuning``: the context-scoped switches (``attention_tuning``).

Nothing here imports triton: ``launch`` (and with it the kernels) is imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_varlen_attention
from rl_engine.backends.triton import arch_reasons, unavailable_reasons
from rl_engine.backends.triton.attention.configs import HEAD_DIMS
from rl_engine.runtime.custom_ops import direct_call_ok, op_range
from rl_engine.runtime.registry import Implementation, Request, register

__all__ = [
    "varlen_attention_fwd_triton",
    "varlen_attention_bwd_triton",
    "cached_attention_triton",
    "varlen_attention_triton",
    "SUPPORTED_HEAD_DIMS",
    "call_reasons",
]

_DTYPES = (torch.float32, torch.bfloat16)
#: Head dims the kernels are built for (``configs.HEAD_DIMS``: powers of two, ``tl.dot`` needs ``D >= 16``).
SUPPORTED_HEAD_DIMS = HEAD_DIMS


def _launch():
    from rl_engine.backends.triton.attention import launch

    return launch


#: The largest head dim of fp32 train-path calls: the backward's ``rlk_attn_bwd_dkdv`` holds a
#: 64-key block's keys and values and a 64-position block of queries and output gradients, which
#: at ``D = 256`` in fp32 need 288 KiB of shared memory (Triton's ``OutOfResources`` on the H100),
#: more than an sm90 SM's 227 KiB a program. fp32 rollout calls (no backward) take every head dim.
FP32_TRAIN_MAX_HEAD_DIM = 128


def call_reasons(request: Request) -> list[str]:
    """Per-call eligibility (pure): the device arch, the head dim, and fp32 train-path calls up to
    ``FP32_TRAIN_MAX_HEAD_DIM``."""
    reasons = arch_reasons(request.platform.family, request.platform.arch)
    d = request.features.get("head_dim")
    if d is not None and d not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim {d} not supported by the Triton attention kernels (supported: {list(SUPPORTED_HEAD_DIMS)})")
    elif (d is not None and d > FP32_TRAIN_MAX_HEAD_DIM and request.dtype == torch.float32
          and request.op == "attention.varlen_attention"):
        reasons.append(f"head_dim {d} in float32 not supported on the train path by the Triton attention kernels: its "
                       f"backward needs more shared memory than an SM has (fp32 up to head_dim "
                       f"{FP32_TRAIN_MAX_HEAD_DIM}; bfloat16 up to {SUPPORTED_HEAD_DIMS[-1]})")
    return reasons


def _check_head_dim(d: int) -> None:
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head_dim {d} is not supported by the Triton attention kernels "
                         f"(supported: {list(SUPPORTED_HEAD_DIMS)})")


# --------------------------------------------------------------------------- varlen (train path)


@torch.library.custom_op("rlk::varlen_attention_triton", mutates_args=(), device_types="cuda")
def varlen_attention_fwd_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, lse, out_fp32)``; ``out_fp32`` (the unrounded output, kept for the
    backward's ``delta = Σ dO ⊙ O``) is empty when ``q`` is already fp32."""
    return _varlen_forward(q, k, v, cu_seqlens, scale, window, for_backward=True)


def _device_offsets(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` on ``device``: host offsets are copied asynchronously from pinned memory (the
    copy is ordered on the current stream, the host does not wait)."""
    if cu_seqlens.device == device:
        return cu_seqlens
    return cu_seqlens.pin_memory().to(device, non_blocking=True)


def _varlen_forward(q, k, v, cu_seqlens, scale, window, *, for_backward: bool):
    _check_head_dim(q.shape[2])
    if for_backward and q.dtype == torch.float32 and q.shape[2] > FP32_TRAIN_MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim {q.shape[2]} in float32 has no Triton backward (fp32 up to head_dim "
                         f"{FP32_TRAIN_MAX_HEAD_DIM}: the backward needs more shared memory than an SM has)")
    # the longest sequence picks the launch specialisation only (sequences of at most 1024 tokens
    # skip the split merge): free from host offsets, one synchronisation from device offsets
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    return _launch().varlen_forward(q, k, v, _device_offsets(cu_seqlens, q.device), scale, window,
                                     max_seqlen=max_seqlen, for_backward=for_backward)


@torch.library.custom_op("rlk::varlen_attention_triton_backward", mutates_args=(), device_types="cuda")
def varlen_attention_bwd_triton(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch().varlen_backward(grad, q, k, v, out, lse, _device_offsets(cu_seqlens, q.device), scale, window)


wire_varlen_attention(varlen_attention_fwd_triton, varlen_attention_bwd_triton)


def varlen_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Causal attention over a packed batch (arguments validated by ``rl_engine.ops.attention``).
    A plain no-grad eager call (``direct_call_ok``) runs the kernels without the custom-op layer
    and without the backward's extra outputs (fp32 output, lse): same bits of ``out``."""
    if direct_call_ok((q, k, v, cu_seqlens)):
        with op_range(varlen_attention_fwd_triton):
            return _varlen_forward(q, k, v, cu_seqlens, scale, window, for_backward=False)[0]
    return varlen_attention_fwd_triton(q, k, v, cu_seqlens, scale, window)[0]


# --------------------------------------------------------------------------- cached (rollout path)


@torch.library.custom_op("rlk::cached_attention_triton", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def cached_attention_triton(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_rows: torch.Tensor,
    page_size: int,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None,
    decode_only: bool = False,
) -> torch.Tensor:
    """Write ``k_new``/``v_new`` into storage rows ``slot_mapping`` of ``k_cache``/``v_cache``
    (``[N, Hkv, D]``, a copy: ``index_copy_``), then run the forward for every query row
    (arguments prepared and validated by ``rl_engine.ops.attention.cached_attention``).
    ``decode_only``: one query token per sequence (derived on the host by the ops layer); the
    kernels then form their tile rows from ``q_pos`` instead of a tile table (same bits)."""
    _check_head_dim(q.shape[2])
    k_cache.index_copy_(0, slot_mapping, k_new)
    v_cache.index_copy_(0, slot_mapping, v_new)
    return _launch().cached_forward(q, k_cache, v_cache, page_rows, page_size, q_seq, q_pos, scale, window,
                                     decode_only=decode_only)


@cached_attention_triton.register_fake
def _(q, k_new, v_new, k_cache, v_cache, slot_mapping, page_rows, page_size, q_seq, q_pos, scale, window,
      decode_only=False):
    return q.new_empty(q.shape)


_GUARANTEES = frozenset({"row", "chunk", "prefill_decode", "layout", "run_to_run"})

for _op, _fn in (("attention.varlen_attention", varlen_attention_triton),
                 ("attention.cached_attention", cached_attention_triton)):
    # register_triton's wiring, with this module's call check (arch + head dim)
    register(
        Implementation(
            op=_op,
            impl_id="triton.blocked_online_softmax",
            version="1",
            fn=_fn,
            families=("cuda", "rocm"),
            untested_families=("rocm",),
            dtypes=_DTYPES,
            guarantees=_GUARANTEES,
            priority=5,
            static_check=unavailable_reasons,
            call_check=call_reasons,
        )
    )
