"""Attention entry points: one algorithm for training prefill and rollout decode.

* :func:`varlen_attention` — the train path: causal attention over a packed batch
  (``cu_seqlens``), differentiable with respect to ``q``, ``k`` and ``v``.
* :func:`cached_attention` — the rollout path: append the new tokens' keys/values to a KV cache
  (:class:`ContiguousKVCache` or :class:`PagedKVCache`) and attend over everything cached. One
  call covers full prefill, chunked prefill, decode and mixed batches.
* :func:`plan_cached_attention` / :func:`cached_attention_step` — the same, one step of a
  model whose layers each own a cache: the step is validated and laid out once, then each layer
  runs with it (what ``rl_engine.models`` does).
* :func:`paged_attention` — the same rollout path on an engine-owned paged cache (raw key/value
  storage, a slot mapping and block tables, as vLLM keeps them): no cache object, the same
  ``attention.cached_attention`` implementations. :func:`plan_paged_attention` validates a step's
  metadata once and :func:`paged_attention_step` runs each layer with it (no host
  synchronisation per layer; capturable in a CUDA graph).

For a query at position ``p`` both return the **same bits** whatever the path, the chunking,
the batch around it, the cache layout or the page size: the contracts
``attention.varlen_attention`` and ``attention.cached_attention`` and the algorithm in
docs/design/attention.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl_engine.ops.attention.cache import ContiguousKVCache, KVCache, PagedKVCache, _AppendPlan
from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, check_finite, require_same_device, require_tensor, scans

__all__ = [
    "varlen_attention",
    "cached_attention",
    "plan_cached_attention",
    "cached_attention_step",
    "CachedAttentionPlan",
    "paged_attention",
    "plan_paged_attention",
    "paged_attention_step",
    "PagedAttentionPlan",
    "ContiguousKVCache",
    "PagedKVCache",
    "KVCache",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _finite(name: str, t: torch.Tensor) -> None:
    """No NaN and no ±inf (where the NaN policy scans: :func:`rl_engine.utils.checks.scans`). Attention needs finite keys and
    values even where a query must not look: masked slots contribute ``0 · v``."""
    check_finite(name, t, why="attention inputs must be finite")


def _finite_output(out: torch.Tensor) -> None:
    """The output of finite inputs is finite, or the call raises (where the NaN policy scans
    the output): a score ``scale · q·k`` or the softmax-weighted sum of ``v`` beyond the float32
    range would otherwise come back as NaN or inf rows."""
    if not scans(out):
        return
    bad = ~torch.isfinite(out.detach()).reshape(out.shape[0], -1).all(dim=1)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        raise ValueError(
            f"q: the attention output of {len(rows)} row(s) (first: token {rows[0]}) is not finite although q, k and v "
            f"are: scale · q·k or the softmax-weighted sum of v overflows float32 (max {torch.finfo(torch.float32).max:.3g}); "
            "scale q, k or v down or pass a smaller scale"
        )


def _scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)


def _window(window: object) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window: expected an int or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"window: expected a positive number of keys, got {window}")
    return window


def _cu_seqlens(name: str, cu: object, total: int | None, device: torch.device, batch: int | None = None,
                where: str = "the device of q") -> torch.Tensor:
    """Validate a ``[B+1]`` offsets tensor (0, non-decreasing, last = ``total`` unless ``None``);
    returns int64 on the host. Offsets may live on ``device`` or on the host (CPU): host offsets
    are read without synchronising with a GPU."""
    if isinstance(cu, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
            raise TypeError(f"{name}: expected an int32/int64 tensor or a list of ints, got {list(cu)[:16]}")
        cu = torch.tensor(cu, dtype=torch.int64)
    require_tensor(name, cu, dtypes=_INDEX_DTYPES, ndim=1, contiguous=False, non_empty=True)
    if cu.device != device and cu.device.type != "cpu":
        raise ValueError(f"{name}: expected device {device} ({where}) or the host (cpu), got {cu.device}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name}: expected {batch + 1} entries (one more than seq_ids), got {cu.shape[0]}")
    c = cu.to(torch.int64).cpu()
    if int(c[0]) != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(c[0])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {c.tolist()[:16]}")
    if total is not None and int(c[-1]) != total:
        raise ValueError(f"{name}: expected the last offset to equal the number of tokens T={total}, got {int(c[-1])}")
    return c


def _heads(q: torch.Tensor, k: torch.Tensor, k_name: str) -> None:
    Hq, D = q.shape[1], q.shape[2]
    Hkv, Dk = k.shape[1], k.shape[2]
    if D == 0:
        raise ValueError(f"q: expected head_dim >= 1, got shape {tuple(q.shape)}")
    if Dk != D:
        raise ValueError(f"{k_name}: expected head_dim {D} (q's), got shape {tuple(k.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"{k_name}: expected a number of kv heads that divides q's {Hq} heads (GQA), got shape {tuple(k.shape)}"
        )


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str) -> int:
    """Validate the queries and the new keys/values (dtype, rank, finite, rows, heads, same
    device); returns the number of tokens ``T``."""
    require_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    _finite("q", q)
    require_tensor(k_name, k, dtypes=(q.dtype,), ndim=3)
    _finite(k_name, k)
    require_tensor(v_name, v, dtypes=(q.dtype,), ndim=3)
    _finite(v_name, v)
    T = q.shape[0]
    if k.shape[0] != T:
        raise ValueError(f"{k_name}: expected {T} rows (one per token of q), got shape {tuple(k.shape)}")
    _heads(q, k, k_name)
    if v.shape != k.shape:
        raise ValueError(f"{v_name}: expected shape {tuple(k.shape)} ({k_name}'s), got {tuple(v.shape)}")
    require_same_device(q=q, **{k_name: k, v_name: v})
    return T


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    r"""Causal attention per sequence of a packed (varlen) batch — the train path.

    Token ``t`` of sequence ``b`` (``cu_seqlens[b] <= t < cu_seqlens[b+1]``) sits at position
    ``p = t - cu_seqlens[b]``; with its sequence's keys at positions ``j`` and query head ``h``
    using kv head ``h // (Hq / Hkv)`` (GQA):

    .. math::
        \mathrm{out}_{t,h} = \sum_{j \in V(p)} \mathrm{softmax}_j\bigl(\mathrm{scale}\;
        q_{t,h} \cdot k_{j}\bigr)\, v_{j},
        \qquad V(p) = \{\max(0, p - W + 1), \dots, p\}

    (``W = ∞`` when ``window`` is ``None``).

    Shapes:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0``; cu_seqlens: ``[B+1]``
        int32/int64, ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T``, on ``q``'s
        device or on the host (host offsets: no synchronisation with a GPU; see
        docs/design/host-path.md). Returns ``[T, Hq, D]`` in ``q.dtype``.

    Args:
        scale: score scale, default ``D ** -0.5``.
        window: sliding window in keys (the query itself included), default full causal.

    Contract ``attention.varlen_attention`` (``contracts/operators/attention.varlen_attention.json``):
    fp32 or bf16 (bf16 in and out, fp32 softmax and accumulation). Each output row is a
    function of its own query, its position and its sequence's keys/values up to that
    position only: **row/batch invariant** (other sequences in the pack, their order and count
    change nothing), **raw-bit equal** to :func:`cached_attention` for the same token under any
    chunking, decode batch or cache layout (**prefill/decode** and **chunk** invariance),
    deterministic run to run. Backward: ``dq``, ``dk``, ``dv`` deterministic and, per
    sequence, independent of the rest of the pack.

    Raises:
        TypeError / ValueError: wrong type, dtype, rank, mismatched heads or head_dim, device,
            non-contiguous, NaN or inf (where the NaN policy scans them: :mod:`rl_engine.utils.checks`),
            ``cu_seqlens`` not starting at 0 / not monotone / not ending at ``T``, bad ``scale`` or
            ``window`` (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    T = _qkv(q, k, v, "k", "v")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    _cu_seqlens("cu_seqlens", cu_seqlens, T, q.device)
    s = _scale(scale, q.shape[2])
    w = _window(window)
    req = make_request(
        "attention.varlen_attention",
        q,
        features={"T": T, "heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[2], "window": w},
    )
    out = dispatch(req, q, k, v, cu_seqlens, s, w)
    _finite_output(out)
    return out


def _seq_ids(seq_ids: object, cache: KVCache) -> list[int]:
    if isinstance(seq_ids, torch.Tensor):
        if seq_ids.dtype not in _INDEX_DTYPES or seq_ids.dim() != 1:
            raise ValueError(f"seq_ids: expected a 1-D int32/int64 tensor, got {seq_ids.dtype} of shape {tuple(seq_ids.shape)}")
        ids = [int(i) for i in seq_ids.tolist()]
    elif isinstance(seq_ids, Sequence) and not isinstance(seq_ids, (str, bytes)):
        ids = list(seq_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"seq_ids: expected ints, got {type(i).__name__}")
    else:
        raise TypeError(f"seq_ids: expected a list of ints or an int tensor, got {type(seq_ids).__name__}")
    for i in ids:
        if not 0 <= i < cache.max_seqs:
            raise ValueError(f"seq_ids: expected slots in [0, {cache.max_seqs}) (cache.max_seqs), got {i}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids: expected distinct slots, got {ids[:16]}")
    return ids


def cached_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    seq_ids: Sequence[int] | torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    r"""Append new tokens to a KV cache, then attend causally over the cache — the rollout path.

    Sequence ``i`` of the batch lives in cache slot ``seq_ids[i]``; rows
    ``cu_seqlens_q[i] : cu_seqlens_q[i+1]`` of ``q``/``k_new``/``v_new`` are its next tokens, at
    positions ``cache.seq_len(seq_ids[i])`` onward. Their keys and values are written into the
    cache **in place**; then each query attends over its sequence's cached keys up to and
    including itself, with the same formula as :func:`varlen_attention`. One call covers full
    prefill, chunked prefill (any chunk sizes), decode (one token per sequence) and mixed
    batches. No autograd: the output never requires grad.

    Shapes:
        q: ``[T, Hq, D]``; k_new, v_new: ``[T, Hkv, D]`` with ``Hkv == cache.num_kv_heads`` and
        ``D == cache.head_dim``; seq_ids: ``B`` distinct slots (list or int tensor);
        cu_seqlens_q: ``[B+1]`` int32/int64 offsets ending at ``T``. Returns ``[T, Hq, D]``.

    Contract ``attention.cached_attention``: every output row is **raw-bit equal** to the row
    :func:`varlen_attention` gives the same token, for any chunking, decode batch composition,
    cache kind and page size (**prefill/decode**, **chunk**, **row**, **layout** invariance);
    deterministic run to run.

    Raises:
        TypeError / ValueError: wrong type, dtype, rank, heads/head_dim not matching each other
            or the cache, device, non-contiguous, NaN or inf (where the NaN policy scans them:
            :mod:`rl_engine.utils.checks`), ``seq_ids`` not distinct or out of
            range, ``cu_seqlens_q`` malformed, cache overflow (``cache:``: ``max_len``, block
            table or block pool exhausted; the cache is left unchanged).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    T = _qkv(q, k_new, v_new, "k_new", "v_new")
    _check_cache(q, k_new, cache)
    ids = _seq_ids(seq_ids, cache)
    cu = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, T, q.device, batch=len(ids))
    s = _scale(scale, q.shape[2])
    w = _window(window)
    with cache._lock:  # plan, kernel and commit as one append (threads: see cache.py)
        return _run_cached(q, k_new, v_new, cache, _plan_cached(cache, ids, cu), s, w)


def _check_cache(q: torch.Tensor, k_new: torch.Tensor, cache: object) -> None:
    """The cache against the queries and the new keys: kind, heads, head dim, dtype, device."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a ContiguousKVCache or PagedKVCache, got {type(cache).__name__}")
    if k_new.shape[1] != cache.num_kv_heads or k_new.shape[2] != cache.head_dim:
        raise ValueError(
            f"k_new: expected [T, {cache.num_kv_heads}, {cache.head_dim}] (cache.num_kv_heads, cache.head_dim), "
            f"got {tuple(k_new.shape)}"
        )
    if cache.dtype != q.dtype:
        raise ValueError(f"cache: expected dtype {q.dtype} (q's), got {cache.dtype}")
    if cache.device != q.device:
        raise ValueError(f"cache: expected device {q.device} (q's), got {cache.device}")


@dataclass(frozen=True, eq=False)
class CachedAttentionPlan:
    """One rollout step over the per-layer KV caches of a model, validated and laid out once
    (:func:`plan_cached_attention`) and run by every layer (:func:`cached_attention_step`).

    Attributes:
        num_tokens, num_seqs: ``T`` new tokens of ``B`` sequences.
        seq_ids: the cache slot of each batch sequence.
        device: the caches' device, where the plan's index tensors live.
        state: the caches' state digest the step applies to (each layer's cache must still
            carry it when its layer runs; the step then moves it on).
        q_seq, q_pos: ``[T]`` batch sequence and position of each new token (int64).
        decode_only: every sequence has exactly one new token (the GPU kernels then need no
            tile table).
    """

    num_tokens: int
    num_seqs: int
    seq_ids: tuple[int, ...]
    device: torch.device
    state: int
    q_seq: torch.Tensor
    q_pos: torch.Tensor
    decode_only: bool
    _append: _AppendPlan


def plan_cached_attention(
    caches: Sequence[KVCache] | KVCache,
    seq_ids: Sequence[int] | torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> CachedAttentionPlan:
    r"""Plan one rollout step for every layer's KV cache at once.

    A model with ``L`` layers keeps ``L`` caches that go through the same appends, so a step's
    bookkeeping — slot ids, ``cu_seqlens_q``, overflow, storage rows, pages, each token's
    sequence and position — is the same for all of them. This makes it once (host work and the
    host-to-device copies of the index tensors); :func:`cached_attention_step` then runs each
    layer with it. :func:`cached_attention` is this plan for one cache followed by the step.

    Args:
        caches: the layers' caches (or one cache); they must hold the same sequences — the
            same kind and geometry and the same history of appends and frees (their state
            digests are compared).
        seq_ids, cu_seqlens_q: as for :func:`cached_attention` (``B`` distinct slots, ``[B+1]``
            offsets on the caches' device).

    Raises:
        TypeError / ValueError: no cache, a cache of another kind, caches that do not hold the
            same sequences (``caches: cache i ...``), bad ``seq_ids`` or ``cu_seqlens_q``, cache
            overflow (``cache:``; nothing is written or committed).
    """
    group = [caches] if isinstance(caches, KVCache) else caches
    if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or len(group) == 0:
        raise TypeError(f"caches: expected a non-empty sequence of KV caches, got {type(caches).__name__}")
    for i, c in enumerate(group):
        if not isinstance(c, KVCache):
            raise TypeError(f"caches: expected ContiguousKVCache or PagedKVCache objects, item {i} is {type(c).__name__}")
    first = group[0]
    for i, c in enumerate(group[1:], 1):
        if c._state != first._state:
            raise ValueError(f"caches: cache {i} does not hold the same sequences as cache 0 (another geometry or "
                             f"another history of appends and frees: {c!r} against {first!r})")
    ids = _seq_ids(seq_ids, first)
    cu = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, first.device, batch=len(ids), where="the caches' device")
    with first._lock:
        return _plan_cached(first, ids, cu)


def _token_rows(cu: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(q_seq, q_pos, decode_only)`` of a step on the host: new token ``t`` of batch sequence
    ``i`` (rows ``cu[i] .. cu[i+1]-1``) sits at position ``starts[i] + t - cu[i]``;
    ``decode_only``: every sequence has exactly one new token."""
    n_new = cu[1:] - cu[:-1]
    B, T = n_new.shape[0], int(cu[-1])
    q_seq = torch.repeat_interleave(torch.arange(B, dtype=torch.int64), n_new, output_size=T)
    q_pos = starts[q_seq] + torch.arange(T, dtype=torch.int64) - cu[:-1][q_seq]
    return q_seq, q_pos, B > 0 and bool((n_new == 1).all())


def _plan_cached(first: KVCache, ids: list[int], cu: torch.Tensor) -> CachedAttentionPlan:
    """The step's bookkeeping from checked slot ids and host offsets ``cu`` (``[B+1]`` int64)."""
    dev = first.device
    T = int(cu[-1])
    n_new = (cu[1:] - cu[:-1]).tolist()
    append = first._plan(ids, n_new)  # raises on overflow before anything is written
    B = len(ids)
    q_seq, q_pos, decode_only = _token_rows(cu, torch.tensor(append.starts, dtype=torch.int64).reshape(B))
    return CachedAttentionPlan(T, B, tuple(ids), dev, first._state, q_seq.to(dev), q_pos.to(dev), decode_only, append)


def cached_attention_step(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: KVCache,
    plan: CachedAttentionPlan,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    r"""One layer of a planned rollout step: :func:`cached_attention` with the step's
    bookkeeping taken from ``plan`` (:func:`plan_cached_attention`) instead of redone.

    Appends ``k_new``/``v_new`` to ``cache`` and attends, with the bits of
    :func:`cached_attention` (the same dispatch); then the cache's state moves on, so a cache
    runs a plan once. Checks only what the plan cannot know: the tensors (dtype, rank, finite
    under the NaN policy, shapes, device) against each other, the cache and the plan.

    Shapes: as :func:`cached_attention`, with ``T = plan.num_tokens``.

    Raises:
        TypeError / ValueError: as :func:`cached_attention` for the tensors and the cache;
            ``plan`` not a :class:`CachedAttentionPlan`; ``q`` with another token count; a
            cache that does not carry the plan's state (another cache, or one that already ran
            this step: ``cache: ...``).
    """
    T = _qkv(q, k_new, v_new, "k_new", "v_new")
    _check_cache(q, k_new, cache)
    if not isinstance(plan, CachedAttentionPlan):
        raise TypeError(f"plan: expected a CachedAttentionPlan (plan_cached_attention), got {type(plan).__name__}")
    if T != plan.num_tokens:
        raise ValueError(f"q: expected {plan.num_tokens} rows (plan.num_tokens), got shape {tuple(q.shape)}")
    s, w = _scale(scale, q.shape[2]), _window(window)
    with cache._lock:  # the state check, the kernel and the commit as one append
        if cache._state != plan.state:
            raise ValueError("cache: it does not carry the state the plan was made for (another cache, one that "
                             "already ran this step, or one another thread appended to: plan each step anew)")
        return _run_cached(q, k_new, v_new, cache, plan, s, w)


def _run_cached(q, k_new, v_new, cache: KVCache, plan: CachedAttentionPlan, s: float, w: int | None) -> torch.Tensor:
    k_rows, v_rows = cache.rows()
    req = make_request(
        "attention.cached_attention",
        q,
        features={"T": plan.num_tokens, "heads": q.shape[1], "kv_heads": k_new.shape[1], "head_dim": q.shape[2],
                  "window": w, "cache": type(cache).__name__},
    )
    a = plan._append
    with torch.no_grad():
        out = dispatch(req, q, k_new, v_new, k_rows, v_rows, a.slot_mapping, a.page_rows, a.page_size, plan.q_seq,
                       plan.q_pos, s, w, plan.decode_only)
    _finite_output(out)  # before the commit: a rejected step leaves the cache's length and state as they were
    cache._commit(a)
    return out


def _index_tensor(name: str, t: object, ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    require_tensor(name, t, dtypes=_INDEX_DTYPES, ndim=ndim, contiguous=False)
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {t.device}")
    return t


@dataclass(frozen=True, eq=False)
class PagedAttentionPlan:
    """One step's batch over an engine-owned paged KV cache, validated once and shared by every
    layer of the step (:func:`plan_paged_attention`, :func:`paged_attention_step`).

    Attributes (device tensors on ``device``, int64):
        num_tokens, num_seqs: ``T`` new tokens of ``B`` sequences.
        block_size, num_blocks: the page size and the number of blocks of the caches the block
            ids were checked against (``k_cache.shape[0]``).
        slot_mapping: ``[T]`` storage row of each new token.
        page_rows: ``[B, P]`` first storage row of each page of each sequence (``block_table ·
            block_size``; entries past a sequence's last page are 0 and never read).
        q_seq, q_pos: ``[T]`` batch sequence and position of each new token.
        decode_only: every sequence has exactly one new token (``T == B``, ``q_seq = arange(B)``):
            the GPU kernels then need no tile table (one launch less per layer).
    """

    num_tokens: int
    num_seqs: int
    block_size: int
    num_blocks: int
    device: torch.device
    slot_mapping: torch.Tensor
    page_rows: torch.Tensor
    q_seq: torch.Tensor
    q_pos: torch.Tensor
    decode_only: bool = False


def plan_paged_attention(
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_blocks: int,
    device: torch.device | str | None = None,
    pages: int | None = None,
    out: PagedAttentionPlan | None = None,
) -> PagedAttentionPlan:
    r"""Validate one step's paged-cache metadata once, for every layer of the step.

    The arguments are :func:`paged_attention`'s (the same meaning and the same checks: the
    error names the argument); ``num_blocks`` is the number of blocks of the layers' caches
    (``k_cache.shape[0]``), which bounds the block ids. The checks read the metadata on the host
    (one device-to-host copy of each index tensor); :func:`paged_attention_step` then runs a
    layer with no host synchronisation of its own, so a decode step of ``L`` layers validates
    once instead of ``L`` times, and the per-layer calls can be captured in a CUDA graph.

    **No host synchronisation, CUDA graphs.** Metadata given in host memory (CPU tensors, as an
    engine builds them before copying them to the GPU) is validated there, and the plan's device
    tensors are made on ``device`` by asynchronous copies from pinned memory: planning then never
    waits for the GPU. For a captured step, make the plan once with ``pages`` (the page-table
    width the graph is captured for, at least the widest sequence's page count) and capture
    :func:`paged_attention_step` with it; before each replay, plan the new step with
    ``out=plan``: its tensors are overwritten **in place** (same token and sequence counts, same
    caches), so the graph reads the new step's metadata. A step's bits do not depend on the
    page-table width (the kernels read a sequence's own pages only), so the replay equals the
    eager step bit for bit.

    Shapes:
        slot_mapping: ``[T]``; block_table: ``[B', max_blocks]`` with ``B' >= B``;
        cu_seqlens_q: ``[B+1]`` ending at ``T``; seq_lens: ``[B]`` (int32/int64, one device).

    Args:
        device: where the plan's tensors live (default: the metadata's device); metadata on the
            host with a GPU ``device`` is the synchronisation-free form.
        pages: pad the page table to this many columns (default: the widest sequence's pages).
        out: a plan to update in place (its token count, sequence count, block size, block
            count, device, width and decode flag must fit this step).

    Raises:
        TypeError / ValueError: as :func:`paged_attention` for these arguments; ``num_blocks``
            not a positive int; ``pages`` narrower than a sequence needs; ``out`` that does not
            fit this step (the message names what differs).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks: expected a positive int (k_cache.shape[0]), got {num_blocks!r}")
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping: expected a torch.Tensor, got {type(slot_mapping).__name__}")
    if out is not None and not isinstance(out, PagedAttentionPlan):
        raise TypeError(f"out: expected a PagedAttentionPlan to update, got {type(out).__name__}")
    dev = slot_mapping.device
    target = torch.empty(0, device=device).device if device is not None else dev
    slot_mapping = _index_tensor("slot_mapping", slot_mapping, 1, dev)
    T = slot_mapping.shape[0]
    block_table = _index_tensor("block_table", block_table, 2, dev)
    seq_lens = _index_tensor("seq_lens", seq_lens, 1, dev)
    B = seq_lens.shape[0]
    if block_table.shape[0] < B:
        raise ValueError(f"block_table: expected at least {B} rows (one per sequence of seq_lens), got {block_table.shape[0]}")
    cu = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, T, dev, batch=B)
    lens = seq_lens.to(torch.int64).cpu()
    n_new = cu[1:] - cu[:-1]
    if bool((lens < n_new).any()):
        i = int((lens < n_new).nonzero()[0, 0])
        raise ValueError(f"seq_lens: sequence {i} has {int(lens[i])} tokens but {int(n_new[i])} new ones "
                         f"(seq_lens counts the new tokens too)")
    n_pages = -(-lens // block_size)
    width = max(1, int(n_pages.max())) if B else 1
    if width > block_table.shape[1]:
        raise ValueError(f"block_table: {width} blocks of {block_size} are needed for seq_lens up to {int(lens.max())}, "
                         f"the table has {block_table.shape[1]} columns")
    if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int) or pages < width):
        raise ValueError(f"pages: expected an int >= {width} (the widest sequence's pages), got {pages!r}")
    bt = block_table[:B, :width].to(torch.int64).cpu()
    used = torch.arange(width)[None, :] < n_pages[:, None]
    if B and bool(((bt < 0) | (bt >= num_blocks))[used].any()):
        raise ValueError(f"block_table: expected block ids in [0, {num_blocks}) for every used block")
    _check_block_ownership(bt, used, slot_mapping, block_size)
    q_seq, q_pos, decode_only = _token_rows(cu, lens - n_new)
    page_rows = torch.where(used, bt, 0) * block_size
    slots = slot_mapping.to(torch.int64)
    expect = page_rows[q_seq, torch.div(q_pos, block_size, rounding_mode="floor")] + q_pos % block_size
    if T and not torch.equal(slots.cpu(), expect):
        bad = int((slots.cpu() != expect).nonzero()[0, 0])
        raise ValueError(f"slot_mapping: token {bad} (sequence {int(q_seq[bad])}, position {int(q_pos[bad])}) maps to row "
                         f"{int(slots[bad])}, its block table says row {int(expect[bad])}")
    if pages is not None and pages > width:
        page_rows = torch.nn.functional.pad(page_rows, (0, pages - width))
    if out is not None:
        _update_plan(out, T, B, block_size, num_blocks, target, decode_only, slots, page_rows, q_seq, q_pos)
        return out
    return PagedAttentionPlan(T, B, block_size, num_blocks, target, _to(slots.contiguous(), target),
                              _to(page_rows, target), _to(q_seq, target), _to(q_pos, target), decode_only=decode_only)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU by an asynchronous copy from pinned memory
    (the copy is ordered on the current stream: no host wait)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _update_plan(out: PagedAttentionPlan, T: int, B: int, block_size: int, num_blocks: int, device: torch.device,
                 decode_only: bool, slots: torch.Tensor, page_rows: torch.Tensor, q_seq: torch.Tensor,
                 q_pos: torch.Tensor) -> None:
    """Copy a freshly planned step into ``out``'s tensors in place (checked first: nothing is
    written when the step does not fit)."""
    want = {"num_tokens": T, "num_seqs": B, "block_size": block_size, "num_blocks": num_blocks, "device": device,
            "decode_only": decode_only}
    for name, v in want.items():
        if getattr(out, name) != v:
            raise ValueError(f"out: planned for {name}={getattr(out, name)!r}, this step has {name}={v!r}")
    if page_rows.shape[1] > out.page_rows.shape[1]:
        raise ValueError(f"out: its page table has {out.page_rows.shape[1]} columns, this step needs {page_rows.shape[1]} "
                         "(plan the captured step with a larger pages=)")
    if page_rows.shape[1] < out.page_rows.shape[1]:
        page_rows = torch.nn.functional.pad(page_rows, (0, out.page_rows.shape[1] - page_rows.shape[1]))
    for dst, src in ((out.slot_mapping, slots), (out.page_rows, page_rows), (out.q_seq, q_seq), (out.q_pos, q_pos)):
        dst.copy_(src.pin_memory() if src.device.type == "cpu" and dst.is_cuda else src, non_blocking=True)


def _check_block_ownership(bt: torch.Tensor, used: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """The used blocks of a step's block table (host ``[B, W]`` int64, ``used`` marks the
    blocks that hold positions) describe one storage row per (sequence, position):

    * a block listed twice holds the same positions in every listing (the same block index:
      a shared prefix, as prefix caching hands out) — never two positions of one sequence, nor
      other positions of another sequence;
    * a block this step writes (it holds a row of ``slot_mapping``) belongs to one sequence
      only: another sequence reading it would see keys that are not its own.
    """
    B, W = bt.shape
    if not B or not bool(used.any()):
        return
    ids = bt[used]
    seqs = torch.arange(B)[:, None].expand(B, W)[used]
    cols = torch.arange(W)[None, :].expand(B, W)[used]
    order = torch.argsort(ids * W + cols, stable=True)
    ids, seqs, cols = ids[order], seqs[order], cols[order]
    same = ids[1:] == ids[:-1]
    moved = same & (cols[1:] != cols[:-1])
    if bool(moved.any()):
        j = int(moved.nonzero()[0, 0])
        raise ValueError(
            f"block_table: block {int(ids[j])} holds block index {int(cols[j])} of sequence {int(seqs[j])} and block index "
            f"{int(cols[j + 1])} of sequence {int(seqs[j + 1])}; a block holds one range of positions (shared blocks "
            "must sit at the same block index, as a common prefix)"
        )
    if not bool(same.any()):
        return
    shared = torch.unique(ids[1:][same])
    written = torch.unique(torch.div(slot_mapping.to(torch.int64).cpu(), block_size, rounding_mode="floor"))
    clash = shared[torch.isin(shared, written)]
    if clash.numel():
        b = int(clash[0])
        owners = sorted(set(seqs[ids == b].tolist()))
        raise ValueError(
            f"block_table: block {b} is written by this step (slot_mapping) but is in the tables of sequences {owners}; "
            "a block that receives new keys must belong to one sequence"
        )


def _paged_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                  Hkv: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the two caches (dtype, rank, device, shape, contiguity); ``[N, Hkv, D]`` row views."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        require_tensor(name, c, dtypes=(q.dtype,), ndim=4)
        if c.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {c.device}")
        if tuple(c.shape[1:]) != (block_size, Hkv, D):
            raise ValueError(f"{name}: expected [num_blocks, block_size={block_size}, Hkv={Hkv}, D={D}], "
                             f"got {tuple(c.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (k_cache's), got {tuple(v_cache.shape)}")
    rows = k_cache.shape[0] * block_size
    return k_cache.view(rows, Hkv, D), v_cache.view(rows, Hkv, D)


def _run_paged(q, k_new, v_new, k_rows, v_rows, plan: PagedAttentionPlan, s: float, w: int | None) -> torch.Tensor:
    req = make_request(
        "attention.cached_attention",
        q,
        features={"T": q.shape[0], "heads": q.shape[1], "kv_heads": k_new.shape[1], "head_dim": q.shape[2],
                  "window": w, "cache": "paged(engine)"},
    )
    with torch.no_grad():
        out = dispatch(req, q, k_new, v_new, k_rows, v_rows, plan.slot_mapping, plan.page_rows, plan.block_size,
                       plan.q_seq, plan.q_pos, s, w, plan.decode_only)
    _finite_output(out)
    return out


def paged_attention_step(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    r"""One layer of a step planned by :func:`plan_paged_attention`: write the new keys/values
    into ``k_cache``/``v_cache`` at ``plan.slot_mapping`` **in place**, then attend — exactly
    :func:`paged_attention` with the plan's metadata (the same dispatch, hence the same bits).

    Only what the plan cannot know is checked here, on the host (shapes, dtypes, devices; the
    caches against ``plan.block_size`` / ``plan.num_blocks``; ``q`` has ``plan.num_tokens``
    rows). The finite-value check of ``q``/``k_new``/``v_new`` follows the NaN policy
    (:func:`rl_engine.utils.checks.nan_policy`) and is the only possible host synchronisation:
    the default policy scans no GPU tensor, so a step makes none and can be captured in a CUDA
    graph (as under ``"propagate"``); capturing under ``nan_policy("raise")`` raises a clear
    error instead of a failed capture.

    Shapes:
        q: ``[T, Hq, D]``; k_new, v_new: ``[T, Hkv, D]``; k_cache, v_cache:
        ``[plan.num_blocks, plan.block_size, Hkv, D]``, contiguous. Returns ``[T, Hq, D]``.

    Raises:
        TypeError / ValueError: a bad tensor (the message names it), a plan for other caches or
            another token count.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    if not isinstance(plan, PagedAttentionPlan):
        raise TypeError(f"plan: expected a PagedAttentionPlan (plan_paged_attention), got {type(plan).__name__}")
    T = _qkv(q, k_new, v_new, "k_new", "v_new")
    if T != plan.num_tokens:
        raise ValueError(f"q: expected {plan.num_tokens} rows (the plan's tokens), got {T}")
    if q.device != plan.device:
        raise ValueError(f"plan: planned for device {plan.device}, q is on {q.device}")
    k_rows, v_rows = _paged_caches(q, k_cache, v_cache, plan.block_size, k_new.shape[1], k_new.shape[2])
    if k_cache.shape[0] != plan.num_blocks:
        raise ValueError(f"k_cache: expected {plan.num_blocks} blocks (the plan's num_blocks), got {k_cache.shape[0]}")
    return _run_paged(q, k_new, v_new, k_rows, v_rows, plan, _scale(scale, q.shape[2]), _window(window))


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    r"""Write new keys/values into an engine-owned paged KV cache, then attend causally over it.

    The functional form of :func:`cached_attention` for an engine that owns the cache and its
    bookkeeping (vLLM): storage row ``r = block · block_size + offset`` of ``k_cache`` /
    ``v_cache`` (viewed as ``[num_blocks · block_size, Hkv, D]`` rows) holds one token.
    Sequence ``i`` of the batch has ``seq_lens[i]`` tokens *after* this call, of which the last
    ``n_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` are new (rows ``cu_seqlens_q[i] :
    cu_seqlens_q[i+1]`` of ``q``/``k_new``/``v_new``, at positions ``seq_lens[i] - n_i ..
    seq_lens[i] - 1``); position ``p`` lives in row ``block_table[i, p // block_size] ·
    block_size + p % block_size``. The new keys/values are written to rows ``slot_mapping``
    **in place**, then each query attends over its sequence's keys ``0..p`` with the formula of
    :func:`varlen_attention`:

    .. math::
        \mathrm{out}_{t,h} = \sum_{j \in V(p)} \mathrm{softmax}_j\bigl(\mathrm{scale}\;
        q_{t,h} \cdot k_{j}\bigr)\, v_{j}

    It dispatches to the ``attention.cached_attention`` implementations (the same arithmetic
    as :func:`cached_attention` and :func:`varlen_attention`), so every output row is
    **raw-bit equal** to the row :func:`varlen_attention` gives the same token, whatever the
    block size, block placement, chunking or decode batch. Only rows ``0 .. seq_lens[i] - 1``
    of a sequence are read (stale rows elsewhere in the pool are never touched).

    Shapes:
        q: ``[T, Hq, D]``; k_new, v_new: ``[T, Hkv, D]``; k_cache, v_cache:
        ``[num_blocks, block_size, Hkv, D]``, contiguous (they may be overlapping views of one
        engine buffer, e.g. vLLM's, as long as the rows a call writes and reads are its own —
        see rl_engine/integrations/vllm/attention_backend.py); slot_mapping: ``[T]``
        int32/int64 rows in ``[0, num_blocks · block_size)``; block_table: ``[B, max_blocks]``
        int32/int64 (entries past a sequence's last block are ignored); cu_seqlens_q: ``[B+1]``;
        seq_lens: ``[B]``. Returns ``[T, Hq, D]`` in ``q.dtype``.

    Contract ``attention.cached_attention`` (prefill/decode, chunk, row and layout invariance,
    deterministic); no autograd.

    Raises:
        TypeError / ValueError: a tensor of the wrong type, dtype, rank, shape or device, NaN or
            inf in ``q``/``k_new``/``v_new`` (where the NaN policy scans them:
            :mod:`rl_engine.utils.checks`); caches whose shapes disagree or that are not
            contiguous; ``cu_seqlens_q`` malformed; ``seq_lens[i] < n_i``; a block table too
            narrow for ``seq_lens`` or holding a block id out of range; ``slot_mapping`` out of
            range or not the rows of the new positions (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    T = _qkv(q, k_new, v_new, "k_new", "v_new")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    k_rows, v_rows = _paged_caches(q, k_cache, v_cache, block_size, k_new.shape[1], k_new.shape[2])
    slot_mapping = _index_tensor("slot_mapping", slot_mapping, 1, q.device)
    if slot_mapping.shape[0] != T:
        raise ValueError(f"slot_mapping: expected {T} entries (one per token of q), got {slot_mapping.shape[0]}")
    plan = plan_paged_attention(slot_mapping, block_table, block_size, cu_seqlens_q, seq_lens,
                                num_blocks=k_cache.shape[0])
    return _run_paged(q, k_new, v_new, k_rows, v_rows, plan, _scale(scale, q.shape[2]), _window(window))
