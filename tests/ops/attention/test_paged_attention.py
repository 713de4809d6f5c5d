"""attention.paged_attention: the rollout path on an engine-owned paged cache (vLLM's form).

Raw-bit equality with varlen_attention (train path) and cached_attention for the same tokens,
under random block placement, mixed chunk/decode schedules, both dtypes and a sliding window;
the overlapping key/value views the vLLM backend uses; accuracy vs float64; dispatch and
provenance; bad input. Negative controls: a wrong block table or a shifted position changes
the bits, so the equality checks can fail."""

from __future__ import annotations

import random

import pytest
import torch

from rl_engine import contracts
from rl_engine.ops.attention import (
    PagedAttentionPlan,
    PagedKVCache,
    cached_attention,
    paged_attention,
    paged_attention_step,
    plan_paged_attention,
    varlen_attention,
)
from rl_engine.utils.checks import nan_policy
from rl_engine.reference.attention import varlen_attention_f64
from rl_engine.runtime import provenance
from rl_engine.utils.bits import same_bits
from tests.helpers.op_layer import gpu_kernel_names
from tests.helpers.strategies import DTYPES

OP = "attention.cached_attention"
HKV, G, D = 2, 2, 32


def qkv(n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HKV * G, D, generator=gen).to(dtype), torch.randn(n, HKV, D, generator=gen).to(dtype),
            torch.randn(n, HKV, D, generator=gen).to(dtype))


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


class Engine:
    """A minimal paged-cache engine: random block placement, vLLM-style block table and slots.

    ``split=True`` stores keys and values like the vLLM backend: one contiguous buffer whose
    block ``b`` holds its keys in rows ``2b·bs ..`` and its values ``bs`` rows further, passed
    as two overlapping views with doubled block ids.
    """

    def __init__(self, lens, bs, dtype, seed=0, split=False, device="cpu"):
        self.bs, self.split, self.lens, self.dev = bs, split, lens, device
        need = [-(-n // bs) for n in lens]
        nb = sum(need) + 3
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables, o = [], 0
        for n in need:
            self.tables.append(perm[o:o + n])
            o += n
        W = max(need) + 1  # one unused column: entries past a sequence's blocks are ignored
        self.bt = torch.full((len(lens), W), 7, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        if split:
            self.buf = torch.zeros(2 * nb * bs, HKV, D, dtype=dtype, device=device)
            self.k = self.buf[:-bs].view(2 * nb - 1, bs, HKV, D)
            self.v = self.buf[bs:].view(2 * nb - 1, bs, HKV, D)
        else:
            self.k = torch.zeros(nb, bs, HKV, D, dtype=dtype, device=device)
            self.v = torch.zeros(nb, bs, HKV, D, dtype=dtype, device=device)
        self.done = [0] * len(lens)

    def slot(self, i, p):
        b = self.tables[i][p // self.bs]
        return (2 * b if self.split else b) * self.bs + p % self.bs

    def step(self, q, k, v, start, ids, ns, window=None, planned=False):
        """Run one batch: sequence ``ids[j]`` appends ``ns[j]`` tokens (rows of q/k/v from ``start``);
        ``planned``: through ``plan_paged_attention`` + ``paged_attention_step``."""
        qs, ks, vs, slots = [], [], [], []
        for i, n in zip(ids, ns):
            a = start[i] + self.done[i]
            qs.append(q[a:a + n]), ks.append(k[a:a + n]), vs.append(v[a:a + n])
            slots += [self.slot(i, p) for p in range(self.done[i], self.done[i] + n)]
        bt = self.bt[ids].to(torch.int64) * (2 if self.split else 1)
        dev = self.dev
        meta = (torch.tensor(slots, device=dev), bt.to(dev), self.bs, cu(ns).to(dev),
                torch.tensor([self.done[i] + n for i, n in zip(ids, ns)], device=dev))
        if planned:
            plan = plan_paged_attention(*meta, num_blocks=self.k.shape[0])
            out = paged_attention_step(torch.cat(qs), torch.cat(ks), torch.cat(vs), self.k, self.v, plan,
                                       window=window)
        else:
            out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), self.k, self.v, *meta, window=window)
        rows = {}
        c = 0
        for i, n in zip(ids, ns):
            for r in range(n):
                rows[(i, self.done[i] + r)] = out[c + r]
            c += n
            self.done[i] += n
        return rows


def run_schedule(lens, dtype, bs, seed, split=False, window=None, device="cpu", planned=False):
    """Serve ``lens`` with random chunk sizes (prefill chunks, decode steps, mixed batches)."""
    q, k, v = (t.to(device) for t in qkv(sum(lens), dtype, seed))
    starts = cu(lens)[:-1].tolist()
    eng = Engine(lens, bs, dtype, seed, split, device)
    rng = random.Random(seed)
    got = {}
    while any(d < n for d, n in zip(eng.done, lens)):
        ids = [i for i in range(len(lens)) if eng.done[i] < lens[i]]
        rng.shuffle(ids)
        ids = ids[: rng.randint(1, len(ids))]
        ns = [min(rng.choice([1, 1, 5, 17, 40]), lens[i] - eng.done[i]) for i in ids]
        got.update(eng.step(q, k, v, starts, ids, ns, window, planned))
    out = torch.stack([got[(i, p)] for i in range(len(lens)) for p in range(lens[i])])
    return out, (q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 16, 48])
def test_bits_equal_varlen_any_schedule_and_placement(dtype, bs):
    lens = [70, 5, 33, 1]
    dt = getattr(torch, dtype)
    out, (q, k, v) = run_schedule(lens, dt, bs, seed=bs)
    ref = varlen_attention(q, k, v, cu(lens))
    assert same_bits(out, ref), same_bits(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_key_value_views_of_one_buffer(dtype):
    """The layout of the vLLM backend: overlapping key/value views, doubled block ids."""
    lens = [45, 12, 64]
    dt = getattr(torch, dtype)
    out, (q, k, v) = run_schedule(lens, dt, 16, seed=3, split=True)
    assert same_bits(out, varlen_attention(q, k, v, cu(lens)))


def test_sliding_window_bits_equal_varlen():
    lens = [90, 20]
    out, (q, k, v) = run_schedule(lens, torch.float32, 16, seed=5, window=24)
    assert same_bits(out, varlen_attention(q, k, v, cu(lens), window=24))


def test_bits_equal_cached_attention_paged_cache():
    lens = [40, 9]
    q, k, v = qkv(sum(lens), seed=7)
    cache = PagedKVCache(10, 16, HKV, D, max_seqs=2)
    ref = cached_attention(q, k, v, cache, [0, 1], cu(lens))
    eng = Engine(lens, 16, torch.float32, seed=7)
    rows = eng.step(q, k, v, [0, lens[0]], [0, 1], lens)
    out = torch.stack([rows[(i, p)] for i in range(2) for p in range(lens[i])])
    assert same_bits(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_vs_float64(dtype):
    lens = [77, 30]
    dt = getattr(torch, dtype)
    out, (q, k, v) = run_schedule(lens, dt, 16, seed=11)
    ref = varlen_attention_f64(q, k, v, cu(lens))
    tol = contracts.tolerance(OP, dt)
    assert out.dtype == dt and tol.check(out, ref), tol.max_violation(out, ref)


def test_negative_controls_wrong_table_or_position_change_bits():
    lens = [70]
    q, k, v = qkv(70, seed=2)
    ref = varlen_attention(q, k, v, cu(lens))
    eng = Engine(lens, 16, torch.float32, seed=2)
    eng.step(q, k, v, [0], [0], [69])  # prefill 69 tokens, then decode the last one ...
    t = eng.tables[0]
    eng.bt[0, 0], eng.bt[0, 1] = t[1], t[0]  # ... through a table with two blocks swapped
    eng.tables[0] = [t[1], t[0], *t[2:]]
    bad = eng.step(q, k, v, [0], [0], [1])[(0, 69)]
    assert not same_bits(bad, ref[69])
    # a query at the wrong position (seq_lens one too large) differs too
    eng2 = Engine(lens, 16, torch.float32, seed=2)
    eng2.step(q, k, v, [0], [0], [60])
    out = paged_attention(q[60:61], k[60:61], v[60:61], eng2.k, eng2.v, torch.tensor([eng2.slot(0, 60)]),
                          eng2.bt[:1], 16, cu([1]), torch.tensor([61]))
    assert same_bits(out[0], ref[60])
    eng3 = Engine(lens, 16, torch.float32, seed=2)
    eng3.step(q, k, v, [0], [0], [60])
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_attention(q[60:61], k[60:61], v[60:61], eng3.k, eng3.v, torch.tensor([eng3.slot(0, 60)]),
                        eng3.bt[:1], 16, cu([1]), torch.tensor([62]))


def test_dispatch_and_provenance():
    lens = [20]
    q, k, v = qkv(20)
    eng = Engine(lens, 16, torch.float32)
    with provenance.record() as recs:
        eng.step(q, k, v, [0], [0], [20])
    assert [r.op for r in recs] == [OP] and recs[0].impl_id == "cpu.blocked_online_softmax" and not recs[0].fallback
    assert not paged_attention(q, k, v, torch.zeros(2, 16, HKV, D), torch.zeros(2, 16, HKV, D),
                               torch.arange(20), torch.tensor([[0, 1]]), 16, cu(lens), torch.tensor([20])).requires_grad


def _args(**over):
    q, k, v = qkv(4)
    a = dict(q=q, k_new=k, v_new=v, k_cache=torch.zeros(4, 8, HKV, D), v_cache=torch.zeros(4, 8, HKV, D),
             slot_mapping=torch.tensor([8, 9, 10, 11]), block_table=torch.tensor([[1, 2]], dtype=torch.int32),
             block_size=8, cu_seqlens_q=cu([4]), seq_lens=torch.tensor([4]))
    a.update(over)
    return a


def _call(a):
    return paged_attention(a["q"], a["k_new"], a["v_new"], a["k_cache"], a["v_cache"], a["slot_mapping"],
                           a["block_table"], a["block_size"], a["cu_seqlens_q"], a["seq_lens"])


def test_valid_base_call():
    a = _args()
    q, k, v = a["q"], a["k_new"], a["v_new"]
    assert same_bits(_call(a), varlen_attention(q, k, v, cu([4])))
    assert same_bits(a["k_cache"][1, :4], k)  # written in place, at the block table's rows


@pytest.mark.parametrize("over, match", [
    (dict(k_cache=torch.zeros(4, 8, HKV, D, dtype=torch.bfloat16)), "k_cache"),
    (dict(v_cache=torch.zeros(4, 8, 1, D)), "v_cache"),
    (dict(k_cache=torch.zeros(8, 4, HKV, D).transpose(0, 1)), "k_cache"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=4), "k_cache"),
    (dict(slot_mapping=torch.tensor([8, 9, 10])), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([8.0, 9, 10, 11])), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0, 1, 2, 3])), "slot_mapping"),
    (dict(block_table=torch.tensor([1, 2])), "block_table"),
    (dict(block_table=torch.tensor([[9, 2]])), "block_table"),
    (dict(seq_lens=torch.tensor([3])), "seq_lens"),
    (dict(seq_lens=torch.tensor([17])), "block_table"),
    (dict(seq_lens=torch.tensor([4, 4])), "block_table"),
    (dict(seq_lens=torch.tensor([4, 4]), block_table=torch.tensor([[1, 2], [3, 0]])), "cu_seqlens_q"),
    (dict(cu_seqlens_q=cu([3])), "cu_seqlens_q"),
    (dict(k_new=torch.zeros(4, 3, D)), "k_new"),
    (dict(q=torch.full((4, HKV * G, D), float("nan"))), "q"),
])
def test_bad_input_names_the_argument(over, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _call(_args(**over))


# --------------------------------------------------------------------------- plan once, run every layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True], ids=["separate", "vllm-split-views"])
def test_planned_steps_equal_one_call_each(dtype, split):
    """``plan_paged_attention`` + ``paged_attention_step`` over a random schedule gives the bits
    of one ``paged_attention`` call per step (and of varlen_attention)."""
    lens = [70, 5, 33, 1]
    dt = getattr(torch, dtype)
    out, (q, k, v) = run_schedule(lens, dt, 16, seed=9, split=split, planned=True)
    ref, _ = run_schedule(lens, dt, 16, seed=9, split=split)
    assert same_bits(out, ref) and same_bits(out, varlen_attention(q, k, v, cu(lens)))


def _plan_args(**over):
    a = _args(**over)
    return dict(slot_mapping=a["slot_mapping"], block_table=a["block_table"], block_size=a["block_size"],
                cu_seqlens_q=a["cu_seqlens_q"], seq_lens=a["seq_lens"], num_blocks=a.get("num_blocks", 4))


def test_one_plan_serves_every_layer():
    """One plan, two layers (their own caches and tokens): each layer's output and cache equal
    those of its own ``paged_attention`` call; the plan holds the validated metadata."""
    plan = plan_paged_attention(**_plan_args())
    assert isinstance(plan, PagedAttentionPlan) and (plan.num_tokens, plan.num_seqs, plan.num_blocks) == (4, 1, 4)
    assert plan.q_pos.tolist() == [0, 1, 2, 3] and plan.page_rows.tolist() == [[8]]
    for seed in (1, 2):  # two layers
        a = _args()
        q, k, v = qkv(4, seed=seed)
        ref_k, ref_v = a["k_cache"].clone(), a["v_cache"].clone()
        ref = paged_attention(q, k, v, ref_k, ref_v, a["slot_mapping"], a["block_table"], 8, a["cu_seqlens_q"],
                              a["seq_lens"])
        got = paged_attention_step(q, k, v, a["k_cache"], a["v_cache"], plan)
        assert same_bits(got, ref) and same_bits(a["k_cache"], ref_k) and same_bits(a["v_cache"], ref_v)
    # negative control: a plan of a shifted sequence (one more cached token) changes the bits
    shifted = plan_paged_attention(**{**_plan_args(), "slot_mapping": torch.tensor([9, 10, 11, 12]),
                                      "seq_lens": torch.tensor([5])})
    a = _args()
    q5, k5, v5 = qkv(5, seed=1)
    paged_attention_step(q5[:1], k5[:1], v5[:1], a["k_cache"], a["v_cache"],
                         plan_paged_attention(**{**_plan_args(), "slot_mapping": torch.tensor([8]),
                                                 "cu_seqlens_q": cu([1]), "seq_lens": torch.tensor([1])}))
    moved = paged_attention_step(q5[1:], k5[1:], v5[1:], a["k_cache"], a["v_cache"], shifted)
    assert not same_bits(moved, paged_attention_step(q5[1:], k5[1:], v5[1:], torch.zeros(4, 8, HKV, D),
                                                    torch.zeros(4, 8, HKV, D), plan))


def test_plan_knows_a_decode_step():
    """``plan.decode_only`` (the GPU kernels' no-tile-table schedule) is derived from the step's
    lengths: True only when every sequence has exactly one new token; the bits are the same
    either way (checked on the GPU), and the CPU op rejects the flag on a step that is not one."""
    from rl_engine.backends.cpu.attention import cached_attention_cpu

    def plan_of(ns, lens):
        eng = Engine(lens, 16, torch.float32)
        slots = torch.tensor([eng.slot(i, p) for i, (n, L) in enumerate(zip(ns, lens)) for p in range(L - n, L)])
        return plan_paged_attention(slots, eng.bt.to(torch.int64), 16, cu(ns), torch.tensor(lens),
                                    num_blocks=eng.k.shape[0])

    assert plan_of([1, 1, 1], [5, 1, 40]).decode_only
    assert not plan_of([1, 2, 1], [5, 2, 40]).decode_only
    assert not plan_of([1, 0, 1], [5, 3, 40]).decode_only  # a sequence without a new token
    assert not plan_of([4], [4]).decode_only
    q, k, v = qkv(3)
    kc = torch.zeros(64, HKV, D)
    with pytest.raises(ValueError, match="decode_only"):
        cached_attention_cpu(q, k, v, kc, kc.clone(), torch.arange(3), torch.zeros((2, 1), dtype=torch.int64), 1 << 62,
                             torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 0.1, None, True)


@pytest.mark.parametrize("over, match", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=1), "block_table"),  # the used block 1 is out of range for 1 block
    (dict(block_size=0), "block_size"),
    (dict(slot_mapping=torch.tensor([0, 1, 2, 3])), "slot_mapping"),
    (dict(slot_mapping=[8, 9, 10, 11]), "slot_mapping"),
    (dict(block_table=torch.tensor([1, 2])), "block_table"),
    (dict(seq_lens=torch.tensor([3])), "seq_lens"),
    (dict(cu_seqlens_q=cu([3])), "cu_seqlens_q"),
])
def test_plan_bad_input_names_the_argument(over, match):
    a = _plan_args()
    a.update(over)
    with pytest.raises((TypeError, ValueError), match=match):
        plan_paged_attention(**a)


@pytest.mark.parametrize("case, match", [
    ("not_a_plan", "plan"),
    ("rows", "q"),
    ("blocks", "k_cache"),
    ("block_size", "k_cache"),
    ("nan", "q"),
])
def test_step_checks_what_the_plan_cannot_know(case, match):
    plan = plan_paged_attention(**_plan_args())
    a = _args()
    q, k, v, kc, vc = a["q"], a["k_new"], a["v_new"], a["k_cache"], a["v_cache"]
    if case == "not_a_plan":
        plan = _plan_args()
    elif case == "rows":
        q, k, v = q[:3], k[:3], v[:3]
    elif case == "blocks":
        kc, vc = torch.zeros(5, 8, HKV, D), torch.zeros(5, 8, HKV, D)
    elif case == "block_size":
        kc, vc = torch.zeros(8, 4, HKV, D), torch.zeros(8, 4, HKV, D)
    else:
        q = torch.full_like(q, float("nan"))
    with pytest.raises((TypeError, ValueError), match=match):
        paged_attention_step(q, k, v, kc, vc, plan)
    if case == "nan":  # the finite check follows the NaN policy
        with nan_policy("propagate"):
            assert torch.isnan(paged_attention_step(q, k, v, kc, vc, plan)).all()


# --------------------------------------------------------------------------- GPU (the device run)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True], ids=["separate", "vllm-split-views"])
def test_gpu_paged_attention_bits_equal_varlen(dtype, split):
    """On CUDA, paged_attention dispatches to the Triton ``attention.cached_attention`` and, for
    vLLM's split key/value views of one buffer too, every row equals varlen_attention's."""
    lens = [200, 7, 129, 64]
    dt = getattr(torch, dtype)
    with provenance.record() as recs:
        out, (q, k, v) = run_schedule(lens, dt, 16, seed=21, split=split, device="cuda")
    assert recs and {r.impl_id for r in recs} == {"triton.blocked_online_softmax"} and not any(r.fallback for r in recs)
    ref = varlen_attention(q, k, v, cu(lens).cuda())
    assert same_bits(out, ref), same_bits(out, ref)
    acc = varlen_attention_f64(q.cpu(), k.cpu(), v.cpu(), cu(lens))
    tol = contracts.tolerance(OP, dt)
    assert tol.check(out.cpu(), acc), tol.max_violation(out.cpu(), acc)


@pytest.mark.gpu
def test_gpu_paged_attention_profiler_names():
    from tests.backends.triton._rowwise_common import check_profiler_names

    lens = [40, 3]

    def call():
        run_schedule(lens, torch.bfloat16, 16, seed=4, split=True, device="cuda")

    modules = tuple(f"rl_engine.backends.triton.attention.{m}"
                    for m in ("portable_forward", "portable_backward", "split_kv_combine", "tile_tables"))
    check_profiler_names(modules, call, {"rlk_attn"}, "paged_attention")


@pytest.mark.gpu
def test_gpu_planned_decode_step_runs_without_a_tile_table():
    """A planned decode step (one new token per sequence: ``plan.decode_only``) launches no
    ``rlk_attn_tiles`` kernel (the profiler sees none; negative control: the prefill step before
    it, planned the same way, does launch it), makes no host synchronisation, replays from a
    CUDA graph, and gives varlen_attention's rows."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common.harness import capture_cuda_graph

    lens = [40, 3, 17, 1]
    full = [n + 1 for n in lens]
    dt = torch.bfloat16
    q, k, v = (t.cuda() for t in qkv(sum(full), dt, seed=8))
    eng = Engine(full, 16, dt, seed=8, split=True, device="cuda")
    bt = (eng.bt.to(torch.int64) * 2).cuda()
    starts = cu(full)[:-1].tolist()
    ref = varlen_attention(q, k, v, cu(full).cuda())

    def kernels_of(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        return out, set(gpu_kernel_names(prof))

    pre = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).cuda()
    slots = torch.tensor([eng.slot(i, p) for i, n in enumerate(lens) for p in range(n)], device="cuda")
    plan = plan_paged_attention(slots, bt, 16, cu(lens).cuda(), torch.tensor(lens, device="cuda"),
                                num_blocks=eng.k.shape[0])
    assert not plan.decode_only
    with nan_policy("propagate"):
        out, names = kernels_of(lambda: paged_attention_step(q[pre], k[pre], v[pre], eng.k, eng.v, plan))
    assert "rlk_attn_tiles" in names and same_bits(out, ref[pre])
    dec = torch.tensor([s + n for s, n in zip(starts, lens)], device="cuda")
    slots = torch.tensor([eng.slot(i, n) for i, n in enumerate(lens)], device="cuda")
    plan = plan_paged_attention(slots, bt, 16, cu([1] * len(lens)).cuda(), torch.tensor(full, device="cuda"),
                                num_blocks=eng.k.shape[0])
    assert plan.decode_only
    qd, kd, vd = q[dec], k[dec], v[dec]
    with nan_policy("propagate"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = paged_attention_step(qd, kd, vd, eng.k, eng.v, plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out, names = kernels_of(lambda: paged_attention_step(qd, kd, vd, eng.k, eng.v, plan))
        assert "rlk_attn_tiles" not in names and any(n.startswith("rlk_attn_fwd") for n in names), names
        assert same_bits(out, ref[dec]) and same_bits(eager, ref[dec]), same_bits(out, ref[dec])
        graph, captured = capture_cuda_graph(lambda: paged_attention_step(qd, kd, vd, eng.k, eng.v, plan))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(captured, ref[dec])


@pytest.mark.gpu
def test_gpu_paged_attention_step_syncs_nothing_and_is_capturable():
    """On CUDA a planned layer (``paged_attention_step`` under ``nan_policy("propagate")``) makes
    no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``; negative control: the
    one-call ``paged_attention``, which validates its metadata on the host, is caught by the same
    mode) and replays from a CUDA graph with the eager bits; capturing under the checking NaN
    policy raises an error naming ``q`` instead of a failed capture."""
    from benchmarks.common.harness import capture_cuda_graph

    lens = [40, 3, 17]
    dt = torch.bfloat16
    q, k, v = (t.cuda() for t in qkv(sum(lens), dt, seed=5))
    eng = Engine(lens, 16, dt, seed=5, split=True, device="cuda")
    slots = torch.tensor([eng.slot(i, p) for i, n in enumerate(lens) for p in range(n)], device="cuda")
    bt = (eng.bt.to(torch.int64) * 2).cuda()
    meta = (slots, bt, 16, cu(lens).cuda(), torch.tensor(lens, device="cuda"))
    plan = plan_paged_attention(*meta, num_blocks=eng.k.shape[0])
    ref = varlen_attention(q, k, v, cu(lens).cuda())
    with nan_policy("propagate"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = paged_attention_step(q, k, v, eng.k, eng.v, plan)
            with pytest.raises(RuntimeError, match="synchroniz"):
                paged_attention(q, k, v, eng.k, eng.v, *meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert same_bits(out, ref), same_bits(out, ref)
        graph, captured = capture_cuda_graph(lambda: paged_attention_step(q, k, v, eng.k, eng.v, plan))
        eng.k.zero_(), eng.v.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(captured, ref)
    # the default policy does not scan GPU tensors; the checking policy's host read is refused
    with nan_policy("raise"), pytest.raises(RuntimeError, match="q: the finite-value check"):
        capture_cuda_graph(lambda: paged_attention_step(q, k, v, eng.k, eng.v, plan))
