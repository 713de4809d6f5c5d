"""KV caches for the rollout path: one object per layer, addressed by sequence slot.

Both caches store keys and values as rows ``[N, Hkv, D]`` and tell the kernel where position
``pos`` of a sequence lives through *page rows*: ``row = page_rows[pos // page_size] +
pos % page_size``. A :class:`ContiguousKVCache` is the special case of one page of ``max_len``
rows per slot; a :class:`PagedKVCache` hands out ``block_size``-row pages from a shared pool
through per-sequence block tables. The attention arithmetic never sees the layout, which is why
both give the same bits (docs/design/attention.md).

An append is planned first (overflow checked, pages chosen) and committed only after the kernel
ran, so a rejected call leaves the cache unchanged.

Threads: every cache holds a lock; an append (:meth:`KVCache.extend`,
:func:`~rl_engine.ops.attention.cached_attention`, one layer of
:func:`~rl_engine.ops.attention.cached_attention_step`), a ``free`` and a ``restore`` run under
it, plan to commit, so appends from several threads — to different slots of one cache, or to
the same slot — are serialised and never hand one page to two sequences. A multi-layer step
(:func:`~rl_engine.ops.attention.plan_cached_attention`) is one transaction of the caller's: two
threads stepping the same group of caches get an error from the second (its plan no longer
matches the caches' state), not mixed rows; serialise steps on one cache group.

Every cache keeps a *state digest* (``_state``): a hash of its geometry and of every append and
free since it was made. The per-layer caches of one model go through the same appends and
frees, so they carry the same digest, which is how
:func:`rl_engine.ops.attention.plan_cached_attention` plans one step for all of them at once and
:func:`rl_engine.ops.attention.cached_attention_step` refuses a cache that has moved on.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rl_engine.utils.checks import FLOAT_DTYPES

__all__ = ["ContiguousKVCache", "PagedKVCache", "KVCache"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


@dataclass
class _AppendPlan:
    """Where one call's new tokens go (built by ``_plan``, applied by ``_commit``)."""

    seq_ids: list[int]
    n_new: list[int]
    starts: list[int]
    slot_mapping: torch.Tensor  # [T] storage row of each new token
    page_rows: torch.Tensor  # [B, P] first storage row of each page of each batch sequence
    page_size: int
    new_blocks: list[list[int]] = field(default_factory=list)  # paged only


class KVCache(abc.ABC):
    """Common part of the caches: storage, per-slot lengths, validation of slot ids."""

    def __init__(self, max_seqs: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.max_seqs = _positive_int("max_seqs", max_seqs)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype: expected one of {list(FLOAT_DTYPES)}, got {dtype}")
        self.dtype = dtype
        # the concrete device ("cuda" becomes "cuda:<current>"), so comparisons with tensors hold
        self.device = torch.empty(0, device=device).device
        self._lens = [0] * self.max_seqs
        self._lock = threading.RLock()  # held from plan to commit of every append, and by free/restore
        self.k: torch.Tensor
        self.v: torch.Tensor
        self._state: int  # the state digest; each concrete cache sets it from its geometry

    def _slot(self, seq_id: object, name: str = "seq_id") -> int:
        if isinstance(seq_id, torch.Tensor) and seq_id.numel() == 1 and not seq_id.is_floating_point():
            seq_id = int(seq_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"{name}: expected an int slot id, got {type(seq_id).__name__}")
        if not 0 <= seq_id < self.max_seqs:
            raise ValueError(f"{name}: expected a slot in [0, {self.max_seqs}), got {seq_id}")
        return seq_id

    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for the sequence in slot ``seq_id`` (0 for an unused slot)."""
        return self._lens[self._slot(seq_id)]

    def free(self, seq_id: int) -> None:
        """Forget the sequence in slot ``seq_id``; the slot can start a new sequence."""
        s = self._slot(seq_id)
        with self._lock:
            self._lens[s] = 0
            self._state = hash((self._state, "free", s))

    def snapshot(self) -> object:
        """The cache's bookkeeping (lengths, state digest; pages for a paged cache), for
        :meth:`restore`. Storage rows are not copied: rows past a slot's length are never read,
        so restoring the bookkeeping undoes an append."""
        with self._lock:
            return (list(self._lens), self._state)

    def restore(self, snap: object) -> None:
        """Return to a :meth:`snapshot` of this cache (e.g. after a multi-layer step that failed
        part-way; see :meth:`rl_engine.models.qwen3.Qwen3ForCausalLM.hidden_cached`)."""
        lens, state = snap  # type: ignore[misc]
        with self._lock:
            self._lens = list(lens)
            self._state = state

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value storage as ``[N, Hkv, D]`` views (what the kernel reads and writes)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.k.view(shape), self.v.view(shape)

    def extend(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write keys/values of the sequence in slot ``seq_id`` at its next positions, **without**
        computing attention (write-only: e.g. to rebuild a cache from another engine's keys).

        Shapes:
            k, v: ``[n, Hkv, D]`` with ``Hkv == num_kv_heads``, ``D == head_dim``, in the
            cache's dtype and device; written at positions ``seq_len(seq_id) .. + n - 1``.

        Raises:
            TypeError / ValueError: bad slot, wrong type, dtype, shape or device,
                non-contiguous, NaN or inf in ``k``/``v`` (under the NaN policy: attention
                needs finite keys and values), or overflow (``cache:``); the cache is left
                unchanged.
        """
        from rl_engine.utils.checks import check_finite, require_same_device, require_tensor

        s = self._slot(seq_id)
        require_tensor("k", k, dtypes=(self.dtype,), ndim=3)
        require_tensor("v", v, dtypes=(self.dtype,), ndim=3)
        check_finite("k", k, why="cached keys must be finite")
        check_finite("v", v, why="cached values must be finite")
        if tuple(k.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"k: expected [n, {self.num_kv_heads}, {self.head_dim}] (num_kv_heads, head_dim), "
                             f"got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v: expected shape {tuple(k.shape)} (k's), got {tuple(v.shape)}")
        require_same_device(k=k, v=v)
        if k.device != self.device:
            raise ValueError(f"k: expected device {self.device} (the cache's), got {k.device}")
        with self._lock:
            plan = self._plan([s], [k.shape[0]])
            k_rows, v_rows = self.rows()
            with torch.no_grad():
                k_rows[plan.slot_mapping] = k
                v_rows[plan.slot_mapping] = v
            self._commit(plan)

    @abc.abstractmethod
    def _plan(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> _AppendPlan:
        """Check that the appends fit and choose their storage rows (no mutation)."""

    def _commit(self, plan: _AppendPlan) -> None:
        for s, start, n in zip(plan.seq_ids, plan.starts, plan.n_new):
            self._lens[s] = start + n
        self._state = hash((self._state, "append", tuple(plan.seq_ids), tuple(plan.starts), tuple(plan.n_new)))


class ContiguousKVCache(KVCache):
    """``[max_seqs, max_len, Hkv, D]`` keys and values; slot ``s`` owns row block ``s``.

    Args:
        max_seqs: number of sequence slots.
        max_len: tokens a slot can hold.
        num_kv_heads, head_dim: ``Hkv`` and ``D``.
        dtype: ``torch.float32`` or ``torch.bfloat16`` (must match the queries).
        device: where the storage lives.

    Raises:
        TypeError / ValueError: a size is not a positive int, or the dtype is unsupported.
    """

    def __init__(self, max_seqs: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(max_seqs, num_kv_heads, head_dim, dtype, device)
        self.max_len = _positive_int("max_len", max_len)
        shape = (self.max_seqs, self.max_len, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._state = hash(repr(self))

    def __repr__(self) -> str:
        return (f"ContiguousKVCache(max_seqs={self.max_seqs}, max_len={self.max_len}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})")

    def _plan(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> _AppendPlan:
        starts = [self._lens[s] for s in seq_ids]
        for s, start, n in zip(seq_ids, starts, n_new):
            if start + n > self.max_len:
                raise ValueError(
                    f"cache: slot {s} holds {start} tokens; appending {n} would exceed max_len={self.max_len}"
                )
        dev = self.device
        slots = [torch.arange(s * self.max_len + st, s * self.max_len + st + n, dtype=torch.int64)
                 for s, st, n in zip(seq_ids, starts, n_new)]
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        page_rows = torch.tensor([[s * self.max_len] for s in seq_ids], dtype=torch.int64).reshape(len(seq_ids), 1)
        return _AppendPlan(list(seq_ids), list(n_new), starts, slot_mapping.to(dev), page_rows.to(dev), self.max_len)


class PagedKVCache(KVCache):
    """A pool of ``num_blocks`` pages of ``block_size`` tokens, handed to sequences on demand.

    Each slot keeps a block table (its pages in position order); ``free`` returns them to the
    pool. Page ``b`` holds storage rows ``b·block_size .. b·block_size + block_size - 1``.

    Args:
        num_blocks, block_size: pool size and tokens per page.
        num_kv_heads, head_dim: ``Hkv`` and ``D``.
        dtype, device: as for :class:`ContiguousKVCache`.
        max_seqs: number of sequence slots.
        max_blocks_per_seq: longest block table (default: ``num_blocks``).

    Raises:
        TypeError / ValueError: a size is not a positive int, or the dtype is unsupported.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_seqs: int = 256, max_blocks_per_seq: int | None = None) -> None:
        super().__init__(max_seqs, num_kv_heads, head_dim, dtype, device)
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        self.max_blocks_per_seq = _positive_int(
            "max_blocks_per_seq", self.num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
        )
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._tables: list[list[int]] = [[] for _ in range(self.max_seqs)]
        self._free: list[int] = list(range(self.num_blocks))  # handed out from the front
        self._state = hash(repr(self))

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, max_seqs={self.max_seqs}, "
                f"max_blocks_per_seq={self.max_blocks_per_seq})")

    def snapshot(self) -> object:
        with self._lock:
            return (super().snapshot(), [list(t) for t in self._tables], list(self._free))

    def restore(self, snap: object) -> None:
        base, tables, free = snap  # type: ignore[misc]
        with self._lock:
            super().restore(base)
            self._tables = [list(t) for t in tables]
            self._free = list(free)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        """Pages of the sequence in slot ``seq_id``, in position order."""
        return list(self._tables[self._slot(seq_id)])

    def free(self, seq_id: int) -> None:
        """Forget the sequence in slot ``seq_id`` and return its pages to the pool."""
        s = self._slot(seq_id)
        with self._lock:
            self._free.extend(self._tables[s])
            self._tables[s] = []
            self._lens[s] = 0
            self._state = hash((self._state, "free", s))

    def _plan(self, seq_ids: Sequence[int], n_new: Sequence[int]) -> _AppendPlan:
        bs = self.block_size
        starts = [self._lens[s] for s in seq_ids]
        needed = []
        for s, start, n in zip(seq_ids, starts, n_new):
            pages = -(-(start + n) // bs)
            if pages > self.max_blocks_per_seq:
                raise ValueError(
                    f"cache: slot {s} holds {start} tokens; appending {n} needs {pages} blocks of {bs}, "
                    f"more than max_blocks_per_seq={self.max_blocks_per_seq}"
                )
            needed.append(max(0, pages - len(self._tables[s])))
        if sum(needed) > len(self._free):
            raise ValueError(f"cache: out of blocks: this call needs {sum(needed)} new blocks, {len(self._free)} are free")
        new_blocks, k = [], 0
        for c in needed:
            new_blocks.append(self._free[k : k + c])
            k += c
        tables = [self._tables[s] + nb for s, nb in zip(seq_ids, new_blocks)]
        width = max([1] + [len(t) for t in tables])
        page_rows = torch.zeros((len(seq_ids), width), dtype=torch.int64)
        slots = []
        for i, (t, start, n) in enumerate(zip(tables, starts, n_new)):
            if t:
                page_rows[i, : len(t)] = torch.tensor(t, dtype=torch.int64) * bs
            pos = torch.arange(start, start + n, dtype=torch.int64)
            slots.append(page_rows[i][torch.div(pos, bs, rounding_mode="floor")] + pos % bs)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        dev = self.device
        return _AppendPlan(list(seq_ids), list(n_new), starts, slot_mapping.to(dev), page_rows.to(dev), bs, new_blocks)

    def _commit(self, plan: _AppendPlan) -> None:
        taken = sum(len(nb) for nb in plan.new_blocks)
        del self._free[:taken]
        for s, nb in zip(plan.seq_ids, plan.new_blocks):
            self._tables[s].extend(nb)
        super()._commit(plan)
