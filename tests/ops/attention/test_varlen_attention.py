"""attention.varlen_attention (train path): accuracy of output and gradients vs float64, packing
(row) invariance forward and backward, run-to-run determinism, streaming memory at S = 4096,
negative controls for each checker, dispatch, custom-op registration and bad input."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.backends.cpu.attention import blas_tile_check, fold_sum
from rl_engine.ops.attention import varlen_attention
from rl_engine.reference.attention import varlen_attention_f64
from rl_engine.runtime import provenance, use_policy
from rl_engine.runtime.registry import implementations
from rl_engine.utils.checks import nan_policy
from rl_engine.validation.common.attention import (
    check_packing_invariance,
    check_run_to_run,
    dense_varlen_attention,
    rlk_train,
)
from tests.helpers.strategies import DTYPES

OP = "attention.varlen_attention"


def make_qkv(lens, hkv, g, d, dtype, seed=0, q_scale=1.5):
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    T = sum(lens)
    q = (torch.randn(T, hkv * g, d, generator=gen) * q_scale).to(dt)
    k = torch.randn(T, hkv, d, generator=gen).to(dt)
    v = torch.randn(T, hkv, d, generator=gen).to(dt)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lens,hkv,g,d,window,scale",
    [
        ([1, 63, 64, 65, 200], 1, 1, 32, None, None),
        ([300], 2, 4, 64, None, None),
        ([130, 77], 2, 2, 128, 50, 0.3),
        ([1100], 1, 2, 32, None, None),  # crosses a KV split
        ([257, 3], 1, 4, 64, 1, None),  # window 1: each query sees only itself
    ],
    ids=["ragged", "gqa4", "window50-d128", "split", "window1"],
)
def test_accuracy_forward_and_grads(dtype, lens, hkv, g, d, window, scale):
    q, k, v, cu = make_qkv(lens, hkv, g, d, dtype, seed=sum(lens))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = varlen_attention(q, k, v, cu, scale=scale, window=window)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(up)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = varlen_attention_f64(q64, k64, v64, cu, scale, window)
    ref.backward(up.double())
    fwd = contracts.tolerance(OP, q.dtype, "forward")
    bwd = contracts.tolerance(OP, q.dtype, "backward")
    assert out.dtype == q.dtype and out.shape == q.shape
    assert fwd.check(out, ref), fwd.max_violation(out, ref)
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == q.dtype, name
        assert bwd.check(got, want), (name, bwd.max_violation(got, want))


def test_window_at_least_the_sequence_equals_full_causal():
    q, k, v, cu = make_qkv([90, 40], 1, 2, 32, "float32", seed=4)
    assert torch.equal(varlen_attention(q, k, v, cu, window=90), varlen_attention(q, k, v, cu))


def test_first_token_attends_only_to_itself():
    q, k, v, cu = make_qkv([5, 7], 1, 1, 32, "float32", seed=6)
    out = varlen_attention(q, k, v, cu)
    assert torch.equal(out[0], v[0]) and torch.equal(out[5], v[5])  # softmax of one key is exactly 1


# --------------------------------------------------------------------------- packing (row) invariance


@st.composite
def packing_case(draw):
    n = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    if sum(lens) == 0:
        lens[0] = 1
    orders = [
        [draw(st.integers(0, n - 1))],
        draw(st.permutations(range(n))),
        draw(st.permutations(range(n)))[: draw(st.integers(1, n))],
    ]
    return dict(lens=lens, orders=orders, hkv=draw(st.sampled_from([1, 2])), g=draw(st.sampled_from([1, 2, 4])),
                d=draw(st.sampled_from([32, 64, 128])), window=draw(st.one_of(st.none(), st.integers(1, 130))),
                seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60)
@given(case=packing_case())
def test_packing_invariance_forward_and_grads(dtype, case):
    """A sequence's output and dq/dk/dv do not depend on what is packed beside it, or where."""
    q, k, v, cu = make_qkv(case["lens"], case["hkv"], case["g"], case["d"], dtype, seed=case["seed"])
    rep = check_packing_invariance(rlk_train(window=case["window"]), q, k, v, cu, case["orders"], grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_dense_attention_is_caught(dtype):
    """One masked [T, T] matmul + softmax over the whole pack: a sequence's bits change with the
    pack. The same checker (and data) passes rl-kernel attention."""
    lens = [300, 123, 64, 1]
    q, k, v, cu = make_qkv(lens, 2, 2, 64, dtype, seed=8)
    orders = [[1], [3, 0], [2, 1, 0, 3]]
    bad = check_packing_invariance(lambda *a: dense_varlen_attention(*a), q, k, v, cu, orders)
    assert not bad.ok, "dense whole-pack attention was not caught"
    good = check_packing_invariance(rlk_train(), q, k, v, cu, orders, grads=True)
    assert good.ok, str(good)


# --------------------------------------------------------------------------- run-to-run determinism


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_grads(dtype):
    q, k, v, cu = make_qkv([150, 1, 260], 2, 2, 64, dtype, seed=9)
    rep = check_run_to_run(lambda q_, k_, v_: varlen_attention(q_, k_, v_, cu, window=100), [q, k, v], runs=3, grads=True)
    assert rep.ok, str(rep)
    assert rep.cases == 8


def test_negative_control_unordered_accumulation_is_caught():
    """A gradient accumulated in a random order (what atomics do) fails the same checker."""
    q, k, v, cu = make_qkv([200], 1, 1, 32, "float32", seed=10)
    gen = torch.Generator().manual_seed(0)

    class ShuffledSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            parts = list(g.unbind(0))
            acc = torch.zeros_like(parts[0])
            for i in torch.randperm(len(parts), generator=gen).tolist():
                acc = acc + parts[i] * 1e-3
            return g + acc  # every row gets a sum whose order changes from run to run

    def nondeterministic(q_, k_, v_):
        return varlen_attention(ShuffledSum.apply(q_), k_, v_, cu)

    assert not check_run_to_run(nondeterministic, [q, k, v], runs=3, grads=True).ok


# --------------------------------------------------------------------------- memory


def _memory(fn) -> tuple[int, int]:
    """(peak bytes allocated above the start, largest single allocation) over ``fn()``, from the
    profiler's allocator events (every CPU allocation and free, with the running total)."""
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            events = json.load(fh)["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    assert mem, "the profiler recorded no allocations"
    return max(a["Total Allocated"] for a in mem), max(a["Bytes"] for a in mem)


def test_streaming_memory_at_4096_forward_and_backward():
    """No S×S score matrix: at S = 4096 the whole forward+backward peaks below half of ONE head's
    fp32 score matrix and allocates no block larger than 1/16 of it; the dense control, measured
    the same way, exceeds both (so the measurement sees such matrices)."""
    S = 4096
    score_matrix = S * S * 4
    q, k, v, cu = make_qkv([S], 1, 2, 64, "float32", seed=12)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        out = varlen_attention(qq, kk, vv, cu)
        out.backward(torch.ones_like(out))

    peak, largest = _memory(fwd_bwd)
    assert peak < score_matrix / 2, f"peak {peak / 2**20:.1f} MiB"
    assert largest <= score_matrix / 16, f"largest allocation {largest / 2**20:.1f} MiB"
    dense_peak, dense_largest = _memory(lambda: dense_varlen_attention(q, k, v, cu))
    assert dense_peak > score_matrix and dense_largest >= score_matrix


# --------------------------------------------------------------------------- backend building blocks


def test_blas_tile_assumption_holds_here():
    """The fixed-shape fp32 BLAS tiles give a row the same bits in any batch and at any row
    position (the assumption the CPU backend rests on)."""
    assert blas_tile_check() == []


def test_fold_sum_is_a_fixed_tree():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    got = fold_sum(x, 1)
    # width 5: h = 4, x[4] onto x[0]; then pairwise halving
    a = x.clone()
    a[:, 0] = a[:, 0] + a[:, 4]
    a = a[:, :2] + a[:, 2:4]
    want = a[:, 0] + a[:, 1]
    assert torch.equal(got, want)
    assert torch.equal(fold_sum(x[1:2], 1), got[1:2])  # a row's sum ignores the other rows
    assert fold_sum(x[:, :0], 1).shape == (3, 7)


# --------------------------------------------------------------------------- dispatch and registration


def test_dispatch_strict_and_provenance():
    q, k, v, cu = make_qkv([10], 1, 1, 32, "float32")
    impls = {i.impl_id: i for i in implementations(OP)}
    assert "cpu.blocked_online_softmax" in impls  # (+ the Triton one, CUDA/ROCm only)
    assert contracts.load_contract(OP).guarantees <= impls["cpu.blocked_online_softmax"].guarantees
    with provenance.record() as recs:
        varlen_attention(q, k, v, cu)
    assert recs[-1].op == OP and recs[-1].impl_id == "cpu.blocked_online_softmax" and not recs[-1].fallback


def test_diagnostic_fallback_runs_the_reference():
    q, k, v, cu = make_qkv([20, 9], 1, 2, 32, "float32", seed=3)
    from rl_engine.runtime import registry

    req = registry.make_request(OP, q, requires=frozenset({"tp_size"}))  # nothing guarantees tp_size
    with pytest.raises(registry.NoEligibleImplementation, match="tp_size"):
        registry.dispatch(req, q, k, v, cu, 32**-0.5, None)
    with use_policy("diagnostic"):
        out = registry.dispatch(req, q, k, v, cu, 32**-0.5, None)
    ref = varlen_attention_f64(q, k, v, cu)
    assert contracts.tolerance(OP, torch.float32).check(out, ref)


def test_profiler_shows_the_rlk_ops():
    q, k, v, cu = make_qkv([70], 1, 1, 32, "float32", seed=2)
    q.requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        varlen_attention(q, k, v, cu).sum().backward()
    names = {e.name for e in prof.events()}
    assert "rlk::varlen_attention_cpu" in names and "rlk::varlen_attention_cpu_backward" in names


def test_custom_op_registration_opcheck():
    from rl_engine.backends.cpu.attention import varlen_attention_fwd_cpu

    q, k, v, cu = make_qkv([5, 70], 1, 2, 32, "float32", seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(varlen_attention_fwd_cpu, (q, k, v, cu, 0.2, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_empty_batch_and_empty_sequences():
    q, k, v, _ = make_qkv([3], 1, 1, 32, "float32")
    e = q[:0]
    assert varlen_attention(e, k[:0], v[:0], torch.tensor([0], dtype=torch.int32)).shape == (0, 1, 32)
    out = varlen_attention(q, k, v, torch.tensor([0, 0, 3, 3]))
    assert torch.equal(out, varlen_attention(q, k, v, torch.tensor([0, 3])))


# --------------------------------------------------------------------------- bad input


def test_bad_input_messages_name_the_argument():
    q, k, v, cu = make_qkv([4, 4], 2, 2, 32, "float32")
    with pytest.raises(ValueError, match="^k: expected a number of kv heads"):
        varlen_attention(q, torch.randn(8, 3, 32), torch.randn(8, 3, 32), cu)
    with pytest.raises(ValueError, match="^k: expected head_dim 32"):
        varlen_attention(q, torch.randn(8, 2, 16), torch.randn(8, 2, 16), cu)
    with pytest.raises(ValueError, match="^k: expected 8 rows"):
        varlen_attention(q, k[:7], v[:7], cu)
    with pytest.raises(ValueError, match="^v: expected shape"):
        varlen_attention(q, k, v[:, :1].contiguous(), cu)
    with pytest.raises(ValueError, match="^k: expected dtype"):
        varlen_attention(q, k.double(), v, cu)
    with pytest.raises(ValueError, match="^q: expected dtype"):
        varlen_attention(q.half(), k, v, cu)
    with pytest.raises(ValueError, match="^q: expected 3 dimensions"):
        varlen_attention(q[0], k, v, cu)
    with pytest.raises(ValueError, match="^q: expected a contiguous"):
        varlen_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu)
    with pytest.raises(ValueError, match="^cu_seqlens: expected non-decreasing"):
        varlen_attention(q, k, v, torch.tensor([0, 5, 3, 8]))
    with pytest.raises(ValueError, match="^cu_seqlens: expected the last offset"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 7]))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected cu_seqlens\[0\] == 0"):
        varlen_attention(q, k, v, torch.tensor([1, 4, 8]))
    with pytest.raises(ValueError, match="^cu_seqlens: expected dtype"):
        varlen_attention(q, k, v, cu.float())
    with pytest.raises(TypeError, match="^cu_seqlens: expected a torch.Tensor"):
        varlen_attention(q, k, v, [0, 4, 8])
    with pytest.raises(ValueError, match="^q: contains NaN"):
        varlen_attention(torch.full_like(q, float("nan")), k, v, cu)
    with pytest.raises(ValueError, match="^v: contains inf"):
        varlen_attention(q, k, torch.full_like(v, float("inf")), cu)
    with pytest.raises(ValueError, match="^window: expected a positive"):
        varlen_attention(q, k, v, cu, window=0)
    with pytest.raises(TypeError, match="^window: expected an int"):
        varlen_attention(q, k, v, cu, window=2.5)
    with pytest.raises(ValueError, match="^scale: expected a finite"):
        varlen_attention(q, k, v, cu, scale=float("inf"))
    with pytest.raises(ValueError, match="device"):
        varlen_attention(q, k.to("meta"), v, cu)
    with nan_policy("propagate"):  # opting out of the scan lets NaN through (no error)
        varlen_attention(torch.full_like(q, float("nan")), k, v, cu)
