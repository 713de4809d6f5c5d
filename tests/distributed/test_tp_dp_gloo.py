"""The TP and DP building blocks on gloo groups of 2 and 4 ranks, against the single-process operators.

One world of 4 ranks is started once (module fixture) and runs every check of
:mod:`tests.distributed.workers` on itself and on its two halves; the references are the single-process ``rl_engine.ops`` calls
(autograd) computed here. Raw bits throughout; each invariance has its negative control: the
``native`` row-parallel scheme (rounded partials all-reduced by gloo), the float all-reduce of
zero-masked embedding shards (loses ``-0.0``), autograd's sequential gradient accumulation plus
gloo's all-reduce for DP.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from rl_engine.distributed.algorithms.tree import tree_sum
from rl_engine.distributed.algorithms.vocab import vocab_partition
from rl_engine.distributed.tensor_parallel import K_TREE_BLOCKS, ROW_SCHEMES
from rl_engine.utils.bits import same_bits
from tests.distributed import workers as W

SIZES = (2, 4)


@pytest.fixture(scope="module")
def worlds(gloo_world):
    """``{size: [rank results]}``: the world of 4 ranks ran the checks on itself and on its halves."""
    return {2: [r[2] for r in gloo_world[:2]], 4: [r[4] for r in gloo_world]}


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


@lru_cache(maxsize=None)
def _linear_reference(dtype):
    from rl_engine.ops.gemm import linear

    x, w, b, dy = W.linear_inputs(dtype)
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    y = linear(xl, wl, bl)
    y.backward(dy)
    return y.detach(), xl.grad, wl.grad, bl.grad


@lru_cache(maxsize=None)
def _k_tree_reference(dtype):
    from rl_engine.ops.gemm import linear

    x, w, _, _ = W.linear_inputs(dtype)
    kb = W.K // K_TREE_BLOCKS
    parts = [linear(x[:, j * kb:(j + 1) * kb].float().contiguous(), w[:, j * kb:(j + 1) * kb].float().contiguous())
             for j in range(K_TREE_BLOCKS)]
    return tree_sum(parts).to(dtype)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_column_parallel_equals_single_process(worlds, p, dtype):
    y, dx, dw, db = _linear_reference(dtype)
    n = W.N // p
    for r, res in enumerate(worlds[p]):
        ys, dxs, dws, dbs = res["linear"][("column", dtype)]
        assert same_bits(ys, y[:, r * n:(r + 1) * n])
        assert same_bits(dxs, dx)  # the exact reduction over the sharded N: every rank, TP=1 bits
        assert same_bits(dws, dw[r * n:(r + 1) * n]) and same_bits(dbs, db[r * n:(r + 1) * n])


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
@pytest.mark.parametrize("scheme", ["full_k", "exact_k"])
def test_row_parallel_equals_single_process(worlds, p, dtype, scheme):
    y, dx, dw, db = _linear_reference(dtype)
    n, k = W.N // p, W.K // p
    for r, res in enumerate(worlds[p]):
        ys, dxs, dws, dbs = res["linear"][(scheme, dtype)]
        assert same_bits(ys, y), f"rank {r}"
        assert same_bits(dxs, dx[:, r * k:(r + 1) * k])
        if scheme == "full_k":
            assert same_bits(dws, dw[r * n:(r + 1) * n]) and same_bits(dbs, db[r * n:(r + 1) * n])
        else:
            assert same_bits(dws, dw[:, r * k:(r + 1) * k]) and same_bits(dbs, db)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_row_parallel_k_tree_is_tp_invariant(worlds, p, dtype):
    ref = _k_tree_reference(dtype)
    b = W.linear_inputs(dtype)[2]
    for res in worlds[p]:
        assert same_bits(res["linear"][("k_tree", dtype)][0], ref + b)


def test_k_tree_has_its_own_bits_not_gemm_linear():
    # the fixed-tree scheme is TP-invariant but is not the unsharded gemm.linear (fp32 here)
    from rl_engine.ops.gemm import linear

    x, w, _, _ = W.linear_inputs(torch.float32)
    assert not same_bits(_k_tree_reference(torch.float32), linear(x, w))


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_negative_control_native_row_parallel_differs(worlds, p, dtype):
    y = _linear_reference(dtype)[0]
    assert not same_bits(worlds[p][0]["linear"][("native", dtype)][0], y)


@lru_cache(maxsize=None)
def _vocab_reference(dtype):
    from rl_engine.ops.embedding import embedding
    from rl_engine.ops.logprob import linear_token_logprobs

    h, w, ids, g_lp, g_ent, dy_emb = W.vocab_inputs(dtype)
    hl, wl = _leaf(h), _leaf(w)
    lp, ent = linear_token_logprobs(hl, wl, ids, W.TEMPERATURE, True)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    we = _leaf(w)
    e = embedding(ids, we)
    e.backward(dy_emb)
    return lp.detach(), ent.detach(), hl.grad, wl.grad, e.detach(), we.grad


@lru_cache(maxsize=None)
def _vocab_kept_reference(dtype):
    from rl_engine.ops.logprob import linear_token_logprobs

    h, w, ids, g_lp, g_ent, _ = W.vocab_inputs(dtype)
    hl, wl = _leaf(h), _leaf(w)
    lp, ent = linear_token_logprobs(hl, wl, ids, W.TEMPERATURE, True, kept=W.vocab_kept(h, w))
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    return lp.detach(), ent.detach(), hl.grad, wl.grad


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_vocab_parallel_logprobs_equal_single_process(worlds, p, dtype):
    lp, ent, dh, dw, _, _ = _vocab_reference(dtype)
    parts = vocab_partition(W.V, p)
    for r, res in enumerate(worlds[p]):
        lps, ents, dhs, dws = res["vocab"][("logprobs", dtype)]
        lo, hi = parts[r]
        assert same_bits(lps, lp) and same_bits(ents, ent)
        assert same_bits(dhs, dh), f"rank {r}: dhidden"
        assert same_bits(dws, dw[lo:hi]), f"rank {r}: dweight"


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_vocab_parallel_kept_set_logprobs_equal_single_process(worlds, p, dtype):
    """Top-k / top-p replay: each shard masks its own columns; forward and gradients keep the bits."""
    lp, ent, dh, dw = _vocab_kept_reference(dtype)
    full = _vocab_reference(dtype)[0]
    assert not same_bits(lp, full), "the kept sets must change some log-probs (else this test proves nothing)"
    assert same_bits(lp[2], full[2]), "row 2 keeps everything"
    parts = vocab_partition(W.V, p)
    for r, res in enumerate(worlds[p]):
        lps, ents, dhs, dws = res["vocab"][("logprobs_kept", dtype)]
        lo, hi = parts[r]
        assert same_bits(lps, lp) and same_bits(ents, ent), f"rank {r}: forward"
        assert same_bits(dhs, dh), f"rank {r}: dhidden"
        assert same_bits(dws, dw[lo:hi]), f"rank {r}: dweight"


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_vocab_parallel_embedding_equals_single_process(worlds, p, dtype):
    *_, e, dwe = _vocab_reference(dtype)
    parts = vocab_partition(W.V, p)
    for r, res in enumerate(worlds[p]):
        es, dws = res["vocab"][("embedding", dtype)]
        lo, hi = parts[r]
        assert same_bits(es, e)  # -0.0 of the table kept
        assert same_bits(dws, dwe[lo:hi])


@pytest.mark.parametrize("p", SIZES)
def test_negative_control_float_all_reduce_loses_negative_zero(worlds, p):
    e = _vocab_reference(torch.float32)[4]
    assert torch.signbit(e).any() and not same_bits(worlds[p][0]["vocab"][("embedding_native", torch.float32)], e)


@lru_cache(maxsize=None)
def _dp_reference():
    from rl_engine.distributed.data_parallel import TreeGradReducer

    params = [_leaf(t) for t in W.mlp_params()]
    red = TreeGradReducer(params, num_microbatches=W.MICROBATCHES)
    seq = [None] * len(params)
    for j in red.microbatches():
        W.mlp_loss(params, j).backward()
        seq = [q.grad.clone() for q in params]  # autograd's running sum ((g0 + g1) + g2) + g3
        red.accumulate()
        for q, s in zip(params, seq):
            q.grad = s.clone()
    for q in params:
        q.grad = None
    red2 = TreeGradReducer(params, num_microbatches=W.MICROBATCHES)
    for j in red2.microbatches():
        W.mlp_loss(params, j).backward()
        red2.accumulate()
    red2.finish()
    return [q.grad for q in params], seq


@pytest.mark.parametrize("p", SIZES)
def test_dp_tree_reduction_equals_one_process(worlds, p):
    tree, _ = _dp_reference()
    for res in worlds[p]:
        assert all(same_bits(a, b) for a, b in zip(res["dp"]["tree"], tree))


@pytest.mark.parametrize("p", SIZES)
def test_negative_control_native_dp_all_reduce_differs(worlds, p):
    _, sequential = _dp_reference()  # DP = 1 with autograd's accumulation
    assert not all(same_bits(a, b) for a, b in zip(worlds[p][0]["dp"]["native"], sequential))


@pytest.mark.parametrize("p", SIZES)
def test_transports(worlds, p):
    res = worlds[p]
    leaves = [x["transport"]["inputs"] for x in res]
    for x in res:
        assert same_bits(x["transport"]["tree_all_reduce"], tree_sum(leaves))
        assert same_bits(x["transport"]["one_owner"], res[-1]["transport"]["one_owner"])
        expect = torch.tensor([-0.0, 1.5, -2.0, 0.0, 3.0, -0.0], dtype=torch.bfloat16)
        assert same_bits(x["transport"]["one_owner"], expect)
        assert same_bits(x["transport"]["sizes"], torch.cat([torch.full((2, q + 1), float(q)) for q in range(p)], 1))


def test_row_schemes_are_listed():
    assert ROW_SCHEMES == ("full_k", "exact_k", "k_tree", "native")
