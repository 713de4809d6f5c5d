"""The attention computations of the HF install, in rl_engine's layout ``[B, L, H, D]``.

Three paths, all ending in rl_engine's attention operators, so every row has the bits the
contracts ``attention.varlen_attention`` / ``attention.cached_attention`` give it:

* :func:`packed_attention` — no cache, or a prefill that fills none (``Lq == Lk``): the non-pad
  tokens of all rows packed into one varlen batch → :func:`~rl_engine.ops.attention.varlen_attention`
  (autograd). The training forward runs here.
* :func:`cache_attention` — rl_engine's KV cache (:class:`~rl_engine.integrations.hf.cache.RlkCache`):
  the new keys/values are written **in place** into the layer's storage at each row's next
  logical positions, then the new queries attend over the row's cached keys — the engine-owned
  cache form of ``attention.cached_attention`` (:func:`~rl_engine.ops.attention.paged_attention`,
  :func:`~rl_engine.ops.attention.paged_attention_step`). A decode step reads nothing back to
  the host.
* :func:`rebuilt_cache_attention` — the fallback for a transformers cache object passed by the
  caller (``DynamicCache``): a temporary :class:`~rl_engine.ops.attention.ContiguousKVCache` is
  rebuilt from the cache's keys at every call (a copy of the whole past per layer and step).

Pad tokens (``valid == False``) are never written into rl_engine's cache and never attended to;
their output rows are zero.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["packed_attention", "cache_attention", "decode_plan", "rebuilt_cache_attention", "new_token_validity",
           "sequence_ids", "segment_positions", "PerForward"]


class PerForward:
    """The last value made from some tensors, kept while those same tensor objects are alive and
    unchanged (their version counters).

    Every layer of one forward receives the same attention mask and position ids, so what is
    derived from them — the token validity, and the packing of the valid tokens, which sizes its
    output by the data and so reads the mask back to the host — is made by the first layer and
    reused by the others: one read per forward instead of one per layer. Other tensor objects, or
    the same ones changed in place, get a value made for them. Nothing is kept while
    ``torch.compile`` traces, nor for inference tensors (they keep no version counter)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Any = None

    def get(self, tensors: tuple[torch.Tensor | None, ...], extra: Hashable, make: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling() or any(t is not None and t.is_inference() for t in tensors):
            return make()
        key = self._key
        if key is not None and key[1] == extra and len(key[0]) == len(tensors) and all(
                (t is None and k is None) or (t is not None and k is not None and k[0]() is t and k[1] == t._version)
                for t, k in zip(tensors, key[0])):
            return self._value
        value = make()
        self._key = (tuple(None if t is None else (weakref.ref(t), t._version) for t in tensors), extra)
        self._value = value
        return value


#: the validity and sequence ids of a training forward's tokens (``install.rlk_attention``), per forward
PACKING_INPUTS = PerForward()
#: the packing of those tokens (:func:`packed_attention`), per forward
_PACKING = PerForward()


def new_token_validity(attention_mask: torch.Tensor | None, batch: int, q_len: int, past: int | torch.Tensor,
                       device) -> torch.Tensor:
    """``[B, Lq]`` bool: which of the call's ``Lq`` new tokens are real (non-pad) tokens.

    ``attention_mask`` is the mask HF built for the call (``None``: no padding; a bool
    ``[B, 1, Lq, Lk]``, True = may attend; or an additive float mask, 0 = may attend) whose key
    column ``j`` is physical position ``j`` of the padded sequence. New token ``i`` sits at
    physical position ``past + i``; a causal mask always lets a token see itself unless it is a
    pad, so the diagonal entry ``mask[b, 0, i, past + i]`` is the token's validity. ``past`` may
    be a 0-d tensor (a static cache's length), so the lookup stays on the device.
    """
    if attention_mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or attention_mask.shape[2] != q_len:
        raise ValueError(f"attention_mask: expected [B={batch}, 1, Lq={q_len}, Lk] from the registered mask function, "
                         f"got {tuple(attention_mask.shape)}")
    rows = torch.arange(q_len, device=attention_mask.device)
    diag = attention_mask[:, 0, rows, rows + past]
    return diag if diag.dtype == torch.bool else diag == 0


def sequence_ids(position_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """``[B, L]`` int64: which packed sequence each slot belongs to, or ``None`` (one per row).

    transformers' rule for packed rows (``DataCollatorWithFlattening``, padding-free training):
    a new sequence starts wherever ``position_ids`` does not grow by exactly one, so
    ``[[0, 1, 2, 0, 1, 0]]`` holds three sequences. A padded row numbered logically (pads 0) or
    physically (``arange``) is one sequence of valid tokens; its pads, which may start
    sequences of their own, are excluded by the validity mask.

    Raises:
        ValueError: ``position_ids`` is not ``[B or 1, L]``.
    """
    if position_ids is None:
        return None
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(f"position_ids: expected [{batch} or 1, {length}], got {tuple(position_ids.shape)}")
    pid = position_ids.expand(batch, length)
    step = torch.diff(pid, prepend=pid[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def segment_positions(valid: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """``[B, L]`` int64 RoPE positions: the number of valid slots before each slot in its
    sequence (``segments``: :func:`sequence_ids`; ``None``: the row). Pad slots get the
    position of the valid slot before them (0 if none); they are never attended to."""
    count = valid.long().cumsum(-1)
    if segments is None:
        return (count - 1).clamp_min(0)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    base = torch.where(start, count - valid.long(), 0).cummax(-1).values  # valid slots before the sequence
    return (count - base - 1).clamp_min(0)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     segments: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    r"""Causal attention of each sequence's valid tokens among themselves, at logical positions.

    .. math:: \mathrm{out}_{b,i} = \sum_{j \le i,\, j \in V_{b,s(i)}} \mathrm{softmax}_j(\mathrm{scale}\;
        q_{b,i} \cdot k_{b,j})\, v_{b,j}

    over the valid slots ``V_{b,s}`` of sequence ``s`` of row ``b`` (pads skipped; a row is one
    sequence unless ``segments`` splits it, see :func:`sequence_ids`). All sequences go to one
    :func:`~rl_engine.ops.attention.varlen_attention` call, so a token's bits do not depend on
    the batch, the padding or the packing around it.

    Shapes:
        q: ``[B, L, Hq, D]``; k, v: ``[B, L, Hkv, D]``; valid: ``[B, L]`` bool; segments:
        ``[B, L]`` int64 or ``None``. Returns ``[B, L, Hq, D]`` (zeros at pad slots),
        differentiable in ``q``, ``k``, ``v``.
    """
    from rl_engine.ops.attention import varlen_attention

    B, L, Hq, D = q.shape
    bq, lq, cu = _PACKING.get((valid, segments), (B, L), lambda: _pack(valid, segments, L))
    out = varlen_attention(q[bq, lq].contiguous(), k[bq, lq].contiguous(), v[bq, lq].contiguous(), cu, scale=scale)
    return q.new_zeros(B, L, Hq, D).index_put((bq, lq), out)


def _pack(valid: torch.Tensor, segments: torch.Tensor | None, L: int):
    """``(rows, slots, cu_seqlens)`` of the valid tokens of ``[B, L]`` ``valid``: their row and
    slot indices in row-major order and the offsets of their sequences, on the host (the count of
    valid tokens sizes the packing, so it is read back here once; host offsets spare
    ``varlen_attention`` its own read of them)."""
    bq, lq = valid.nonzero(as_tuple=True)
    if segments is None:
        counts = valid.sum(-1)
    else:
        counts = torch.unique_consecutive(bq * L + segments[bq, lq], return_counts=True)[1]
    cu = torch.zeros(counts.shape[0] + 1, dtype=torch.int64)
    cu[1:] = counts.cumsum(0).cpu()
    return bq, lq, cu


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                    lens: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    r"""Append the valid new tokens of each row to rl_engine's KV storage in place, then attend.

    Row ``b`` holds ``lens[b]`` tokens at logical positions ``0..lens[b]-1`` in storage rows
    ``b·R .. b·R + lens[b] - 1`` (``R = k_store.shape[1]`` rows per sequence: one page of
    ``R`` rows, the layout of :class:`~rl_engine.ops.attention.ContiguousKVCache`). Its valid new
    tokens take positions ``lens[b], lens[b]+1, ...``; each attends over positions ``0..p`` of its
    row with the formula of :func:`packed_attention`, so its output is **raw-bit equal** to the
    row :func:`packed_attention` gives the same token in a full forward (contract
    ``attention.cached_attention``). ``lens`` then counts the new tokens.

    * ``Lq == 1`` (decode): one engine-owned paged step (:func:`~rl_engine.ops.attention.paged_attention_step`)
      whose metadata is built on the device from ``lens`` — storage row ``b·R + lens[b]``, page
      row ``b·R``, position ``lens[b]`` — with no host read (capturable in a CUDA graph). A pad
      token is written at ``lens[b]`` without advancing ``lens[b]`` (the next token overwrites
      it); the last storage row of each sequence is spare for it, so the usable capacity is
      ``R - 1``.
    * ``Lq > 1`` (prefill, chunked prefill): the valid tokens are packed on the host and the
      step is validated by :func:`~rl_engine.ops.attention.paged_attention`.

    Shapes:
        q: ``[B, Lq, Hq, D]``; k, v: ``[B, Lq, Hkv, D]``; k_store, v_store: ``[B, R, Hkv, D]``
        contiguous, ``q``'s dtype and device; lens: ``[B]`` int64; valid: ``[B, Lq]`` bool.
        Returns ``[B, Lq, Hq, D]`` (zeros at pad slots). No autograd.

    Raises:
        ValueError: ``cache:`` a row would hold more than ``R - 1`` tokens (checked on the host
            where :func:`rl_engine.utils.checks.reads_back` allows it — host tensors, or a GPU
            under ``nan_policy("raise")``; otherwise a device-side assertion).
    """
    from rl_engine.ops.attention import paged_attention, paged_attention_step
    from rl_engine.utils.checks import reads_back

    B, Lq, Hq, D = q.shape
    R = k_store.shape[1]
    dev = q.device
    if Lq == 1:
        step = valid[:, 0].to(torch.int64)
        _check_capacity(lens, lens + step, R - 1, read=reads_back(lens))
        plan = decode_plan(lens, R)
        out = paged_attention_step(q[:, 0], k[:, 0], v[:, 0], k_store, v_store, plan, scale=scale)
        lens.add_(step)
        return torch.where(valid[:, 0, None, None], out, 0.0)[:, None]
    n = valid.sum(-1)
    seq_lens = lens + n
    _check_capacity(lens, seq_lens, R - 1, read=True)  # this path reads the metadata on the host anyway
    bq, lq = valid.nonzero(as_tuple=True)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    cu[1:] = n.cumsum(0)
    local = torch.arange(bq.shape[0], dtype=torch.int64, device=dev) - cu[bq]
    slot = bq * R + lens[bq] + local
    block_table = torch.arange(B, dtype=torch.int64, device=dev)[:, None]
    out = paged_attention(q[bq, lq].contiguous(), k[bq, lq].contiguous(), v[bq, lq].contiguous(), k_store, v_store,
                          slot, block_table, R, cu, seq_lens, scale=scale)
    lens.copy_(seq_lens)
    return q.new_zeros(B, Lq, Hq, D).index_put((bq, lq), out)


def decode_plan(lens: torch.Tensor, rows_per_seq: int):
    """The :class:`~rl_engine.ops.attention.PagedAttentionPlan` of a decode step (one new token per
    sequence) over ``[B, R, Hkv, D]`` storage, built on the device from ``lens`` ``[B]``: token
    ``b`` is sequence ``b`` at position ``lens[b]``, written to storage row ``b·R + lens[b]``;
    sequence ``b`` owns one page of ``R`` rows starting at row ``b·R``. It is the plan
    :func:`~rl_engine.ops.attention.plan_paged_attention` validates for the block table
    ``[[0], [1], ...]``, ``block_size = R`` and ``seq_lens = lens + 1`` (a test compares them),
    made without reading ``lens`` on the host."""
    from rl_engine.ops.attention import PagedAttentionPlan

    B = lens.shape[0]
    idx = torch.arange(B, dtype=torch.int64, device=lens.device)
    first = idx * rows_per_seq
    return PagedAttentionPlan(B, B, rows_per_seq, B, lens.device, first + lens, first[:, None], idx, lens,
                              decode_only=True)


def _check_capacity(lens: torch.Tensor, new_lens: torch.Tensor, capacity: int, *, read: bool) -> None:
    """``new_lens <= capacity`` for every row: a ``ValueError`` when ``read`` (the values may be
    read back to the host), otherwise a device-side assertion (no host synchronisation)."""
    if read:
        over = new_lens > capacity
        if bool(over.any()):
            b = int(over.nonzero()[0, 0])
            raise ValueError(f"cache: row {b} holds {int(lens[b])} tokens; appending {int(new_lens[b] - lens[b])} "
                             f"exceeds its capacity of {capacity} tokens (max_cache_len)")
    else:
        torch._assert_async((new_lens <= capacity).all(), "cache: a row exceeds the cache capacity (max_cache_len)")


def rebuilt_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_k: torch.Tensor,
                            scale: float | None) -> torch.Tensor:
    r"""Attention over a transformers cache's keys (the fallback for a foreign cache object).

    ``k``/``v`` hold, per row, the physical slots ``0..Lk-1`` of the padded sequence (past, then
    the ``Lq`` new tokens), as HF's ``DynamicCache`` returns them; ``valid_k`` marks the
    non-pad slots. A temporary :class:`~rl_engine.ops.attention.ContiguousKVCache` is filled with
    each row's earlier valid keys (:meth:`~rl_engine.ops.attention.KVCache.extend`), then
    :func:`~rl_engine.ops.attention.cached_attention` appends the new tokens and attends — the
    same bits as :func:`cache_attention`, at the cost of copying the whole past every call.

    Shapes:
        q: ``[B, Lq, Hq, D]``; k, v: ``[B, Lk, Hkv, D]``; valid_k: ``[B, Lk]`` bool. Returns
        ``[B, Lq, Hq, D]`` (zeros at pad slots). No autograd.
    """
    from rl_engine.ops.attention import ContiguousKVCache, cached_attention

    B, Lq, Hq, D = q.shape
    Hkv, Lk = k.shape[2], k.shape[1]
    valid_q = valid_k[:, Lk - Lq:]
    n_q = valid_q.sum(-1)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=q.device)
    cu[1:] = n_q.cumsum(0)
    bq, lq = valid_q.nonzero(as_tuple=True)
    n_k = valid_k.sum(-1)
    n_past = (n_k - n_q).tolist()
    cache = ContiguousKVCache(B, max(1, int(n_k.max())), Hkv, D, dtype=q.dtype, device=q.device)
    k_past, v_past, vp = k[:, : Lk - Lq], v[:, : Lk - Lq], valid_k[:, : Lk - Lq]
    for b in range(B):
        if n_past[b]:
            cache.extend(b, k_past[b][vp[b]].contiguous(), v_past[b][vp[b]].contiguous())
    k_new, v_new = k[:, Lk - Lq:], v[:, Lk - Lq:]
    out = cached_attention(q[bq, lq].contiguous(), k_new[bq, lq].contiguous(), v_new[bq, lq].contiguous(), cache,
                           list(range(B)), cu, scale=scale)
    return q.new_zeros(B, Lq, Hq, D).index_put((bq, lq), out)
