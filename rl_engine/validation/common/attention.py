"""Attention invariance checkers (raw bits) and the non-invariant controls they must catch.

* :func:`check_prefill_decode_invariance` — the train path's output rows against the rollout
  path run under *schedules*: full prefill, chunked prefill with any chunk sizes, decode steps in
  batches of other sequences (continuous batching), with any cache. A schedule is a list of
  steps; a step is a list of ``(sequence, tokens)`` pairs — in batch order — whose next
  ``tokens`` tokens go through one rollout call.
* :func:`check_packing_invariance` — per-sequence outputs (and gradients) of the train path
  are the same whatever other sequences are packed beside them and in which order.
* :func:`check_run_to_run` — repeated calls give the same bits, forward and backward.

Controls: :func:`sdpa_train` / :func:`sdpa_rollout` (PyTorch SDPA, what an engine typically runs),
:func:`dense_varlen_attention` (one masked matmul over the whole pack). They are numerically
fine and not invariant; tests assert the checkers catch them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.report import CheckReport

__all__ = [
    "Schedule",
    "AttentionReport",
    "full_prefill_schedule",
    "chunked_schedule",
    "decode_schedule",
    "random_schedule",
    "check_prefill_decode_invariance",
    "check_packing_invariance",
    "check_run_to_run",
    "rlk_train",
    "rlk_rollout",
    "sdpa_train",
    "sdpa_rollout",
    "dense_varlen_attention",
]

Step = list[tuple[int, int]]
Schedule = list[Step]
TrainFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RolloutFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Schedule], torch.Tensor]


class AttentionReport(CheckReport):
    """Outcome of one attention checker run (``cases`` = comparisons made)."""

    @property
    def cases(self) -> int:
        return self.trials

    @cases.setter
    def cases(self, value: int) -> None:
        self.trials = value


# --------------------------------------------------------------------------- schedules


def full_prefill_schedule(lens: Sequence[int]) -> Schedule:
    """One call with every sequence's whole prompt."""
    return [[(i, n) for i, n in enumerate(lens) if n > 0]]


def chunked_schedule(chunks: Sequence[Sequence[int]]) -> Schedule:
    """Step ``t`` carries chunk ``t`` of every sequence that still has one (``chunks[i]`` sums to
    sequence ``i``'s length)."""
    steps = max((len(c) for c in chunks), default=0)
    return [[(i, c[t]) for i, c in enumerate(chunks) if t < len(c) and c[t] > 0] for t in range(steps)]


def decode_schedule(lens: Sequence[int], prompt_lens: Sequence[int]) -> Schedule:
    """Prefill every prompt in one call, then one token per sequence per step until done."""
    for i, (n, p) in enumerate(zip(lens, prompt_lens)):
        if not 0 <= p <= n:
            raise ValueError(f"prompt_lens: expected 0 <= prompt_lens[{i}] <= lens[{i}] = {n}, got {p}")
    sched: Schedule = [[(i, p) for i, p in enumerate(prompt_lens) if p > 0]]
    left = [n - p for n, p in zip(lens, prompt_lens)]
    while any(left):
        sched.append([(i, 1) for i, r in enumerate(left) if r > 0])
        left = [max(0, r - 1) for r in left]
    return [s for s in sched if s]


def random_schedule(lens: Sequence[int], rng: random.Random, max_chunk: int = 64, max_steps: int = 12) -> Schedule:
    """Continuous batching at random: each step a random subset of unfinished sequences, in
    random order, advances by a random chunk (1 = a decode step). At most ``max_steps`` steps:
    the last one finishes every sequence."""
    left = list(lens)
    sched: Schedule = []
    while any(left):
        live = [i for i, r in enumerate(left) if r > 0]
        if len(sched) == max_steps - 1:
            step = [(i, left[i]) for i in live]
        else:
            pick = [i for i in live if rng.random() < 0.7] or [rng.choice(live)]
            step = [(i, min(left[i], rng.choice([1, 1, rng.randint(1, max_chunk)]))) for i in pick]
        rng.shuffle(step)
        for i, n in step:
            left[i] -= n
        sched.append(step)
    return sched


# --------------------------------------------------------------------------- checkers


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    c = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(c[:-1], c[1:]))


def check_prefill_decode_invariance(
    train_fn: TrainFn,
    runs: Sequence[tuple[str, RolloutFn, Schedule]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> AttentionReport:
    """Every ``(name, rollout_fn, schedule)`` run must reproduce the train path's rows bit for bit.

    ``train_fn(q, k, v, cu_seqlens)`` and ``rollout_fn(q, k, v, cu_seqlens, schedule)`` both
    return ``[T, Hq, D]`` in packed order.
    """
    ref = train_fn(q, k, v, cu_seqlens)
    report = AttentionReport()
    for label, rollout_fn, sched in runs:
        got = rollout_fn(q, k, v, cu_seqlens, sched)
        for i, (s, e) in enumerate(_bounds(cu_seqlens)):
            if e == s:
                continue
            report.cases += 1
            d = same_bits(got[s:e], ref[s:e])
            if not d.equal:
                a, b = (t[s:e].contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32) for t in (got, ref))
                bad = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
                report.failures.append(f"{label}, sequence {i}, positions {bad[:6]}{'...' if len(bad) > 6 else ''}: {d}")
    return report


def _pack(parts: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    return torch.cat([parts[i] for i in order]) if order else parts[0][:0]


def check_packing_invariance(
    train_fn: TrainFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    packings: Sequence[Sequence[int]],
    *,
    grads: bool = False,
    seed: int = 0,
) -> AttentionReport:
    """Re-pack subsets of the sequences in other orders; each sequence's output rows (and with
    ``grads``, its ``dq``, ``dk``, ``dv`` under a fixed per-token upstream gradient) must equal
    those of the full pack."""
    bounds = _bounds(cu_seqlens)
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(q.shape, generator=g).to(q.dtype)

    def run(order):
        parts = [[t[s:e] for s, e in bounds] for t in (q, k, v, up)]
        qq, kk, vv, uu = (_pack(p, order) for p in parts)
        lens = [bounds[i][1] - bounds[i][0] for i in order]
        cu = torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()), dtype=cu_seqlens.dtype)
        ins = [t.detach().clone().requires_grad_(grads) for t in (qq, kk, vv)]
        out = train_fn(*ins, cu)
        res = [out.detach()]
        if grads:
            out.backward(uu)
            res += [t.grad for t in ins]
        starts = [0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist())
        return {i: [r[starts[j] : starts[j + 1]] for r in res] for j, i in enumerate(order)}

    full = run(list(range(len(bounds))))
    report = AttentionReport()
    what = ("output", "dq", "dk", "dv")
    for order in packings:
        got = run(list(order))
        for i in order:
            report.cases += 1
            for w, a, b in zip(what, got[i], full[i]):
                d = same_bits(a, b)
                if not d.equal:
                    report.failures.append(f"packing {list(order)[:8]}, sequence {i}, {w}: {d}")
                    break
    return report


def check_run_to_run(fn: Callable[..., torch.Tensor], args: Sequence[torch.Tensor], *, runs: int = 3,
                     grads: bool = False, seed: int = 0) -> AttentionReport:
    """Call ``fn(*args)`` ``runs`` times (with ``grads``: backward of a fixed upstream gradient
    into the floating arguments) and require identical bits every time."""
    results = []
    up = None
    for _ in range(runs):
        ins = [a.detach().clone().requires_grad_(grads and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
               for a in args]
        out = fn(*ins)
        res = [out.detach()]
        if grads:
            if up is None:
                up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
            out.backward(up)
            res += [a.grad for a in ins if isinstance(a, torch.Tensor) and a.is_floating_point()]
        results.append(res)
    report = AttentionReport()
    for r in range(1, runs):
        for j, (a, b) in enumerate(zip(results[r], results[0])):
            report.cases += 1
            d = same_bits(a, b)
            if not d.equal:
                report.failures.append(f"run {r} vs run 0, {'output' if j == 0 else f'grad {j - 1}'}: {d}")
    return report


# --------------------------------------------------------------------------- paths under test


def rlk_train(*, scale: float | None = None, window: int | None = None) -> TrainFn:
    """The train path of ``rl_engine.ops.attention`` as a checker function."""
    from rl_engine.ops.attention import varlen_attention

    return lambda q, k, v, cu: varlen_attention(q, k, v, cu, scale=scale, window=window)


def rlk_rollout(
    cache_factory: Callable[[int, int, torch.dtype, int, int], object] | None = None,
    *,
    scale: float | None = None,
    window: int | None = None,
    slots: Sequence[int] | None = None,
) -> RolloutFn:
    """The rollout path of ``rl_engine.ops.attention`` as a checker function.

    Args:
        cache_factory: ``(num_kv_heads, head_dim, dtype, max_len, num_seqs) -> cache``; default a
            :class:`ContiguousKVCache` with ``num_seqs`` slots.
        slots: cache slot of each sequence (default ``0, 1, ...``).
    """
    from rl_engine.ops.attention import ContiguousKVCache, cached_attention

    def default_factory(hkv, d, dtype, max_len, num_seqs):
        return ContiguousKVCache(num_seqs, max_len, hkv, d, dtype=dtype)

    factory = cache_factory or default_factory

    def run(q, k, v, cu_seqlens, schedule):
        bounds = _bounds(cu_seqlens)
        ids = list(slots) if slots is not None else list(range(len(bounds)))
        max_len = max([1] + [e - s for s, e in bounds])
        cache = factory(k.shape[1], k.shape[2], q.dtype, max_len, max(ids) + 1 if ids else 1)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        done = [0] * len(bounds)
        for step in schedule:
            rows = []
            for i, n in step:
                s = bounds[i][0] + done[i]
                rows.append(torch.arange(s, s + n))
                done[i] += n
            idx = torch.cat(rows)
            cu = torch.tensor([0] + list(torch.tensor([n for _, n in step]).cumsum(0).tolist()), dtype=torch.int64)
            out[idx] = cached_attention(q[idx], k[idx], v[idx], cache, [ids[i] for i, _ in step], cu,
                                        scale=scale, window=window)
        return out

    return run


def _sdpa(q, k, v, offset, scale):
    """Queries at positions ``offset..`` over keys ``0..L-1`` with a causal mask (one SDPA call)."""
    n, L = q.shape[0], k.shape[0]
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    if offset == 0 and n == L:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    elif n == 1:
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
    else:
        mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(offset, offset + n, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def sdpa_train(*, scale: float | None = None) -> TrainFn:
    """Negative control: one causal SDPA call per packed sequence."""

    def run(q, k, v, cu_seqlens):
        outs = [_sdpa(q[s:e], k[s:e], v[s:e], 0, scale) for s, e in _bounds(cu_seqlens) if e > s]
        return torch.cat(outs) if outs else q.new_empty(q.shape)

    return run


def sdpa_rollout(*, scale: float | None = None) -> RolloutFn:
    """Negative control: per step and sequence, SDPA of the new queries over all keys so far."""

    def run(q, k, v, cu_seqlens, schedule):
        bounds = _bounds(cu_seqlens)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        done = [0] * len(bounds)
        for step in schedule:
            for i, n in step:
                s0 = bounds[i][0]
                a, b = s0 + done[i], s0 + done[i] + n
                out[a:b] = _sdpa(q[a:b], k[s0:b], v[s0:b], done[i], scale)
                done[i] += n
        return out

    return run


def dense_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Negative control: one fp32 ``[T, T]`` masked matmul over the whole pack (the matmul's
    algorithm depends on ``T``, so a sequence's bits depend on what else is packed)."""
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    cu = [int(x) for x in cu_seqlens.tolist()]
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])]),
                                  output_size=T)
    pos = torch.arange(T)
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(G, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(G, dim=1).transpose(0, 1)
    s = (qf @ kf.transpose(1, 2)) * D**-0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return (p @ vf).transpose(0, 1).to(q.dtype)
