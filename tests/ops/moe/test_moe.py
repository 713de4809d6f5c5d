"""moe.route / moe.expert_gate_up / moe.expert_down_combine: accuracy vs float64 (forward and every
gradient), the tie rule, row invariance, independence from expert loads and routing composition,
chunk (tensor-parallel shard) invariance, thread-count independence and run-to-run determinism on
raw bits — each with a negative control that the same check catches — the canonical permutation,
bad input, custom-op checks and dispatch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import moe
from rl_engine.reference.moe import expert_down_combine_f64, expert_gate_up_f64, route_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import reference_for
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.helpers.determinism import run_to_run_failures, thread_count_failures
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads
from tests.ops.moe.helpers import (block, distinct_logits, ids_with_loads, native_experts, native_route, randn,
                                   thread_split_experts)


def _dt(name):
    return getattr(torch, name)


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_accuracy_forward_and_grad(dtype, renormalize):
    dt = _dt(dtype)
    z = distinct_logits(37, 16, dt, seed=1).requires_grad_()
    w, ids = moe.route(z, 4, renormalize)
    z64 = z.detach().double().requires_grad_()
    w64, ids64 = route_f64(z64, 4, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (37, 4)
    assert torch.equal(ids, ids64)
    fwd = contracts.tolerance("moe.route", dt, "forward")
    assert fwd.check(w, w64), fwd.max_violation(w, w64)
    up = randn((37, 4), torch.float32, 2)
    w.backward(up)
    w64.backward(up.double())
    bwd = contracts.tolerance("moe.route", dt, "backward")
    assert z.grad.dtype == dt
    assert bwd.check(z.grad, z64.grad), bwd.max_violation(z.grad, z64.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_accuracy_forward_and_every_grad(dtype):
    dt = _dt(dtype)
    T, H, E, I, K = 29, 48, 6, 20, 3
    x, _, wgu, wd = block(T, H, E, I, dt, seed=3)
    ids = ids_with_loads(T, E, K, seed=4)
    weights = torch.softmax(randn((T, K), torch.float32, 5), -1)
    leaves = [t.clone().requires_grad_() for t in (x, wgu, wd, weights)]
    act = moe.expert_gate_up(leaves[0], leaves[1], ids)
    out = moe.expert_down_combine(act, leaves[2], leaves[3], ids)
    refs = [t.detach().double().requires_grad_() for t in (x, wgu, wd, weights)]
    act64 = expert_gate_up_f64(refs[0], refs[1], ids)
    out64 = expert_down_combine_f64(act64, refs[2], refs[3], ids)
    for op, got, want in (("moe.expert_gate_up", act, act64), ("moe.expert_down_combine", out, out64)):
        tol = contracts.tolerance(op, dt, "forward")
        assert got.dtype == dt and tol.check(got, want), (op, tol.max_violation(got, want))
    up = randn(out.shape, dt, 6)
    out.backward(up)
    out64.backward(up.double())
    bwd = contracts.tolerance("moe.expert_down_combine", dt, "backward")
    for name, got, want in zip(("x", "w_gate_up", "w_down", "weights"), leaves, refs):
        g, r = got.grad, want.grad
        assert g.dtype == got.dtype, name
        # gradients of different tensors differ in scale by orders of magnitude: compare each
        # against its reference normalised by the reference's largest magnitude
        scale = float(r.abs().max())
        assert bwd.check(g.double() / scale, r / scale), (name, bwd.max_violation(g.double() / scale, r / scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_fallback_takes_the_dispatch_arguments(dtype):
    dt = _dt(dtype)
    z = distinct_logits(5, 8, dt)
    w, ids = reference_for("moe.route")(z, 2, True)
    w2, ids2 = moe.route(z, 2, True)
    assert torch.equal(ids, ids2) and contracts.tolerance("moe.route", dt).check(w2, w.double())
    x, _, wgu, wd = block(5, 16, 8, 8, dt)
    act = reference_for("moe.expert_gate_up")(x, wgu, ids)
    out = reference_for("moe.expert_down_combine")(act, wd, w, ids)
    assert act.dtype == out.dtype == dt and out.shape == (5, 16)


# --------------------------------------------------------------------------- tie rule


def test_tie_rule_equal_logits_go_to_the_lower_expert_id():
    z = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    for dt in (torch.float32, torch.bfloat16):
        _, ids = moe.route(z.to(dt), 2, True)
        assert ids.tolist() == [[1, 2], [0, 1]]
        _, ids = moe.route(z.to(dt), 4, False)
        assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]


def _rank_by_rounded_probability(z, top_k):
    """A router that ranks the fp32 probabilities (stable, lower id on ties), as frameworks that
    top-k the softmax output do."""
    p = torch.softmax(z.float(), -1)
    return torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :top_k]


def test_tie_rule_ranks_logits_not_rounded_probabilities_with_negative_control():
    """Logits 2^-30 apart have equal fp32 probabilities: ranking the logits picks the larger one;
    ranking the rounded probabilities (the negative control) calls it a tie and picks the lower id."""
    z = torch.tensor([[-(2.0**-30), 0.0, -4.0, -5.0]])
    _, ids = moe.route(z, 1, True)
    assert ids.tolist() == [[1]]
    assert _rank_by_rounded_probability(z, 1).tolist() == [[0]]


# --------------------------------------------------------------------------- row invariance


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25)
@given(data=st.data(), T=st.integers(1, 24), K=st.sampled_from([1, 2, 4]), renormalize=st.booleans())
def test_route_row_invariance_forward_and_grad(dtype, data, T, K, renormalize):
    z = randn((T, 12), _dt(dtype), seed=T * 7 + K, scale=2.0)
    with threads(1):
        rep = check_row_invariance(lambda z_: moe.route(z_, K, renormalize), [z], data.draw(row_trials(T)), grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20)
@given(data=st.data(), T=st.integers(1, 20), K=st.sampled_from([1, 2, 3]))
def test_experts_row_invariance_forward_and_grads(dtype, data, T, K):
    dt = _dt(dtype)
    x, _, wgu, wd = block(T, 24, 5, 12, dt, seed=T + 11 * K)
    ids = ids_with_loads(T, 5, K, seed=T)
    weights = torch.softmax(randn((T, K), torch.float32, T + 1), -1)
    trials = data.draw(row_trials(T))
    with threads(1):
        gu = check_row_invariance(lambda a, i, w: moe.expert_gate_up(a, w, i), [x, ids], trials, (wgu,), grads=True)
        act = moe.expert_gate_up(x, wgu, ids)
        dc = check_row_invariance(lambda a, w, i, d: moe.expert_down_combine(a, d, w, i), [act, weights, ids], trials,
                                  (wd,), grads=True)
    assert gu.ok, str(gu)
    assert dc.ok, str(dc)


def _load_dependent_combine(act, weights, ids, w_down):
    """Deliberately NOT row invariant (the bf16 negative control): when an expert receives more
    than 4 slots its outputs are rounded to the activation dtype before the combine — a kernel
    whose tiling follows the expert's load."""
    y = torch.einsum("tki,tkhi->tkh", act.float(), w_down.float()[ids])
    busy = torch.bincount(ids.reshape(-1), minlength=w_down.shape[0])[ids] > 4
    y = torch.where(busy[..., None], y.to(act.dtype).float(), y)
    acc = weights[:, 0, None] * y[:, 0]
    for j in range(1, ids.shape[1]):
        acc = acc + weights[:, j, None] * y[:, j]
    return acc.to(act.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_bits_do_not_depend_on_expert_load_or_routing_composition(dtype):
    """Token 0 keeps its experts while the other tokens' routing changes the load of every expert
    (its experts receive 1 .. 200 slots): its output bits never move."""
    dt = _dt(dtype)
    T, H, E, I, K = 201, 64, 8, 32, 2
    x, _, wgu, wd = block(T, H, E, I, dt, seed=7)
    weights = torch.softmax(randn((T, K), torch.float32, 8), -1)
    mine = torch.tensor([[3, 5]])
    alone = moe.experts(x[:1], wgu, wd, weights[:1], mine)
    for seed in range(4):
        others = ids_with_loads(T - 1, E, K, seed=seed)
        if seed == 0:  # every other token on token 0's experts
            others = mine.expand(T - 1, K).clone()
        ids = torch.cat([mine, others])
        for n in (2, 17, T):
            out = moe.experts(x[:n], wgu, wd, weights[:n], ids[:n])
            assert same_bits(out[:1], alone), (seed, n)


def test_expert_load_negative_controls_are_caught():
    """The same comparison fails for HF's eager experts in fp32 (MKL picks a GEMM algorithm from
    the row count) and for a load-dependent combine in bf16."""
    T, H, E, I = 64, 2048, 2, 1024
    x, _, wgu, wd = block(T, H, E, I, torch.float32, seed=9)
    ids = torch.zeros(T, 1, dtype=torch.int64)
    ids[T // 2:] = 1
    w = torch.ones(T, 1)
    assert not same_bits(native_experts(x[:1], wgu, wd, w[:1], ids[:1]), native_experts(x, wgu, wd, w, ids)[:1])
    assert same_bits(moe.experts(x[:1], wgu, wd, w[:1], ids[:1]), moe.experts(x, wgu, wd, w, ids)[:1])
    xb, _, wgub, wdb = block(40, 64, 4, 32, torch.bfloat16, seed=10)
    idsb = ids_with_loads(40, 4, 2, seed=11)
    wb = torch.softmax(randn((40, 2), torch.float32, 12), -1)
    act = moe.expert_gate_up(xb, wgub, idsb)
    trials = [[0], [1, 2], list(range(40))[::-1]]
    assert not check_row_invariance(_load_dependent_combine, [act, wb, idsb], trials, (wdb,)).ok
    assert check_row_invariance(lambda a, w_, i, d: moe.expert_down_combine(a, d, w_, i), [act, wb, idsb], trials,
                                (wdb,)).ok


# --------------------------------------------------------------------------- chunk invariance


@pytest.mark.parametrize("dtype", DTYPES)
def test_route_token_chunks(dtype):
    z = randn((50, 16), _dt(dtype), 13, 2.0)
    w, ids = moe.route(z, 4, True)
    parts = [moe.route(z[a:b].contiguous(), 4, True) for a, b in ((0, 7), (7, 8), (8, 50))]
    assert same_bits(torch.cat([p[0] for p in parts]), w) and torch.equal(torch.cat([p[1] for p in parts]), ids)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_give_the_bits_of_the_full_result(dtype, tp):
    """Gate/up sharded over the intermediate features (the same columns of both halves) and down
    sharded over the hidden features: each shard has the bits of its slice of the full result."""
    dt = _dt(dtype)
    T, H, E, I, K = 23, 64, 6, 32, 2
    x, _, wgu, wd = block(T, H, E, I, dt, seed=14)
    ids = ids_with_loads(T, E, K, seed=15)
    weights = torch.softmax(randn((T, K), torch.float32, 16), -1)
    act = moe.expert_gate_up(x, wgu, ids)
    out = moe.expert_down_combine(act, wd, weights, ids)
    n, h = I // tp, H // tp
    for r in range(tp):
        shard = torch.cat([wgu[:, r * n:(r + 1) * n], wgu[:, I + r * n:I + (r + 1) * n]], 1).contiguous()
        assert same_bits(moe.expert_gate_up(x, shard, ids), act[..., r * n:(r + 1) * n])
        part = moe.expert_down_combine(act, wd[:, r * h:(r + 1) * h].contiguous(), weights, ids)
        assert same_bits(part, out[:, r * h:(r + 1) * h])


def test_row_parallel_down_negative_control():
    """Sharding the down projection over the intermediate features and adding the partial sums
    (vLLM's row-parallel all-reduce) changes the bits: the shard rule above is what keeps them."""
    T, H, E, I, K = 23, 64, 6, 32, 2
    x, _, wgu, wd = block(T, H, E, I, torch.float32, seed=17)
    ids = ids_with_loads(T, E, K, seed=18)
    weights = torch.softmax(randn((T, K), torch.float32, 19), -1)
    act = moe.expert_gate_up(x, wgu, ids)
    full = moe.expert_down_combine(act, wd, weights, ids)
    half = I // 2
    partial = sum(moe.expert_down_combine(act[..., s].contiguous(), wd[..., s].contiguous(), weights, ids)
                  for s in (slice(0, half), slice(half, I)))
    assert not same_bits(partial, full)


# --------------------------------------------------------------------------- threads, run to run


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_thread_count(dtype):
    dt = _dt(dtype)
    T, H, E, I, K = 96, 512, 8, 256, 2
    x, wr, wgu, wd = block(T, H, E, I, dt, seed=20)
    logits = randn((T, 64), dt, 21, 2.0)
    assert thread_count_failures(lambda z: moe.route(z, 8, True)[0], [logits]) == []
    ids = ids_with_loads(T, E, K, seed=22)
    weights = torch.softmax(randn((T, K), torch.float32, 23), -1)
    assert thread_count_failures(lambda a, b, c, w: moe.experts(a, b, c, w, ids), [x, wgu, wd, weights]) == []


def test_thread_count_negative_control():
    """Experts whose down projection splits its reduction by the thread count (what a threaded
    BLAS may do: Intel MKL for HF's eager experts at this shape; not every host's BLAS, so HF's
    block itself is no control) change bits between 1 and 2 threads, and the check says so."""
    T, H, E, I = 64, 2048, 2, 1024
    x, _, wgu, wd = block(T, H, E, I, torch.float32, seed=9)
    ids = torch.zeros(T, 1, dtype=torch.int64)
    ids[T // 2:] = 1
    w = torch.ones(T, 1)
    assert thread_count_failures(lambda a: thread_split_experts(a, wgu, wd, w, ids), [x], counts=(1, 2)) != []


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_including_weight_and_router_grads(dtype):
    dt = _dt(dtype)
    T, H, E, I, K = 70, 48, 8, 24, 3
    x, wr, wgu, wd = block(T, H, E, I, dt, seed=24)

    def block_fn(x_, wr_, wgu_, wd_):
        from rl_engine.ops.gemm import linear

        w, ids = moe.route(linear(x_, wr_), K, True)
        return moe.experts(x_, wgu_, wd_, w, ids)

    assert run_to_run_failures(block_fn, [x, wr, wgu, wd]) == []


def test_run_to_run_negative_control_is_caught():
    """A combine whose rank order follows a fresh random permutation on each call differs run to run."""
    T, H, E, I, K = 40, 32, 6, 16, 4
    x, _, wgu, wd = block(T, H, E, I, torch.float32, seed=25)
    ids = ids_with_loads(T, E, K, seed=26)
    weights = torch.softmax(randn((T, K), torch.float32, 27), -1)
    calls = iter(range(100))

    def shuffled(a, b, c, w):
        p = torch.randperm(K, generator=torch.Generator().manual_seed(next(calls)))
        return moe.experts(a, b, c, w[:, p].contiguous(), ids[:, p].contiguous())

    assert run_to_run_failures(shuffled, [x, wgu, wd, weights]) != []


# --------------------------------------------------------------------------- permutation


def test_expert_permutation_is_by_expert_then_token_position():
    ids = torch.tensor([[2, 0], [0, 2], [1, 0]])
    perm = moe.expert_permutation(ids, 4)
    assert perm.order.tolist() == [1, 2, 5, 4, 0, 3]  # expert 0: slots 1, 2, 5; 1: 4; 2: 0, 3
    assert perm.tokens.tolist() == [0, 1, 2, 2, 0, 1]
    assert perm.counts.tolist() == [3, 1, 2, 0] and perm.offsets.tolist() == [0, 3, 4, 6, 6]
    assert perm.groups() == [(0, 0, 3), (1, 3, 4), (2, 4, 6)]


@pytest.mark.parametrize("num_experts", [8, 256, 257, 40_000])
def test_expert_permutation_key_width_does_not_change_the_order(num_experts):
    """The sort key is the narrowest integer type holding every id (uint8 up to 256 experts,
    then int16, then int32); a stable sort orders by expert, then slot, at any width."""
    g = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (600, 8), generator=g)
    ids[::7, 0] = num_experts - 1  # the largest id, where a too-narrow key would wrap
    perm = moe.expert_permutation(ids, num_experts)
    assert torch.equal(perm.order, torch.sort(ids.reshape(-1), stable=True).indices)


# --------------------------------------------------------------------------- errors, custom ops, dispatch


def test_bad_input_messages_name_the_argument():
    x, _, wgu, wd = block(4, 16, 4, 8, torch.float32)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    w = torch.full((4, 2), 0.5)
    act = moe.expert_gate_up(x, wgu, ids)
    with pytest.raises(ValueError, match="^top_k: expected an int in \\[1, 4\\]"):
        moe.route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="^top_k"):
        moe.route(torch.zeros(3, 4), True)
    with pytest.raises(TypeError, match="^renormalize: expected a bool"):
        moe.route(torch.zeros(3, 4), 2, 1)
    with pytest.raises(ValueError, match="^router_logits: expected dtype"):
        moe.route(torch.zeros(3, 4, dtype=torch.float16), 2)
    with pytest.raises(ValueError, match="^router_logits: contains inf"):
        moe.route(torch.tensor([[0.0, float("inf")]]), 1)
    with pytest.raises(ValueError, match="^router_logits: contains NaN"):
        moe.route(torch.tensor([[0.0, float("nan")]]), 1)
    with pytest.raises(ValueError, match="^w_gate_up: expected shape \\[E, 2I, 16\\]"):
        moe.expert_gate_up(x, wgu[:, :, :8].contiguous(), ids)
    with pytest.raises(ValueError, match="^w_gate_up: expected dtype"):
        moe.expert_gate_up(x, wgu.bfloat16(), ids)
    with pytest.raises(ValueError, match="^ids: expected expert ids in \\[0, 4\\)"):
        moe.expert_gate_up(x, wgu, ids + 1)
    with pytest.raises(ValueError, match="^ids: expected dtype"):
        moe.expert_gate_up(x, wgu, ids.int())
    with pytest.raises(ValueError, match="^ids: expected 4 rows"):
        moe.expert_gate_up(x, wgu, ids[:3])
    with pytest.raises(ValueError, match="^x: contains NaN"):
        moe.expert_gate_up(torch.full_like(x, float("nan")), wgu, ids)
    with pytest.raises(ValueError, match="^weights: expected dtype"):
        moe.expert_down_combine(act, wd, w.double(), ids)
    with pytest.raises(ValueError, match="^weights: expected shape \\[4, 2\\]"):
        moe.expert_down_combine(act, wd, w[:, :1].contiguous(), ids)
    with pytest.raises(ValueError, match="^w_down: expected shape \\[E, H, 8\\]"):
        moe.expert_down_combine(act, wd[..., :4].contiguous(), w, ids)
    with pytest.raises(ValueError, match="^act: expected a contiguous"):
        moe.expert_down_combine(act.transpose(0, 1), wd, w, ids)
    with pytest.raises(ValueError, match="device"):
        moe.expert_gate_up(x, wgu, ids.to("meta"))


def test_empty_batch_gives_empty_outputs():
    x, _, wgu, wd = block(0, 16, 4, 8, torch.float32)
    w, ids = moe.route(torch.zeros(0, 4), 2)
    assert w.shape == ids.shape == (0, 2)
    assert moe.experts(x, wgu, wd, w, ids).shape == (0, 16)


def test_custom_ops_pass_opcheck():
    import rl_engine.backends.cpu.moe  # noqa: F401  (registers torch.ops.rlk.moe_*)

    x, _, wgu, wd = block(5, 16, 4, 8, torch.bfloat16)
    z = distinct_logits(5, 4, torch.float32)
    ids = ids_with_loads(5, 4, 2, seed=3)
    w = torch.softmax(randn((5, 2), torch.float32, 4), -1)
    act = moe.expert_gate_up(x, wgu, ids)
    torch.library.opcheck(torch.ops.rlk.moe_route_cpu.default, (z.requires_grad_(), 2, True))
    torch.library.opcheck(torch.ops.rlk.moe_expert_gate_up_cpu.default, (x.requires_grad_(), wgu.requires_grad_(), ids))
    torch.library.opcheck(torch.ops.rlk.moe_expert_down_combine_cpu.default,
                          (act.detach().requires_grad_(), wd.requires_grad_(), w.requires_grad_(), ids))


def test_dispatch_records_the_cpu_implementation():
    x, wr, wgu, wd = block(6, 16, 4, 8, torch.float32)
    with provenance.record() as calls:
        w, ids = moe.route(x @ wr.T, 2)
        moe.experts(x, wgu, wd, w, ids)
    assert [(c.op, c.impl_id, c.fallback) for c in calls] == [
        ("moe.route", "cpu.exact_sum", False), ("moe.expert_gate_up", "cpu.exact_sum", False),
        ("moe.expert_down_combine", "cpu.exact_sum", False)]
    assert all({"threads", "isa", "row"} <= set(c.requested) for c in calls)


def test_native_route_is_hf_topk_of_probabilities():
    """The native control used by the model tests: on distinct logits it agrees with moe.route."""
    z = distinct_logits(9, 8, torch.float32)
    w, ids = native_route(z, 3, True)
    w2, ids2 = moe.route(z, 3, True)
    assert torch.equal(ids, ids2)
    assert contracts.tolerance("moe.route", torch.float32).check(w2, w.double())
