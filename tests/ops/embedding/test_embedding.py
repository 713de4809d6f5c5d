"""embedding.embedding: exact forward, accuracy of the weight gradient vs float64, row and chunk
invariance, the fixed order of the backward sum (run to run, and independent of other ids)
with negative controls, bad input, custom-op checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.backends.cpu.embedding import fixed_order_scatter_sum
from rl_engine.ops import embedding as E
from rl_engine.reference.embedding import embedding_f64
from rl_engine.runtime.registry import reference_for
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from rl_engine.utils.checks import nan_policy
from tests.helpers.determinism import run_to_run_failures, thread_count_failures
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "embedding.embedding"


def _data(n_ids, V, H, dtype, seed=0, id_dtype=torch.int64, zipf=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g).to(getattr(torch, dtype))
    if zipf:  # a few ids repeat many times, as frequent tokens and padding do
        ids = (torch.rand(n_ids, generator=g) ** 4 * V).long().clamp_(max=V - 1)
    else:
        ids = torch.randint(0, V, (n_ids,), generator=g)
    return ids.to(id_dtype), w


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), n=st.integers(1, 60), V=st.integers(1, 50), H=st.sampled_from([1, 8, 33]), i32=st.booleans())
def test_row_invariance_forward(dtype, data, n, V, H, i32):
    ids, w = _data(n, V, H, dtype, seed=n * 5 + V, id_dtype=torch.int32 if i32 else torch.int64)
    with threads(1):  # tiny calls; thread-count independence is tested below
        rep = check_row_invariance(E.embedding, [ids], data.draw(row_trials(n)), (w,), grads=True)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_a_bit_copy_and_chunks_agree(dtype):
    ids, w = _data(500, 97, 40, dtype, seed=1)
    out = E.embedding(ids.view(20, 25), w)
    assert out.shape == (20, 25, 40)
    assert same_bits(out.reshape(500, 40), w[ids])
    for s, e in ((0, 1), (3, 250), (250, 500)):
        assert same_bits(E.embedding(ids[s:e].contiguous(), w), out.reshape(500, 40)[s:e])


# ----------------------------------------------------------------------------- backward


def _dweight(ids, w, grad):
    w = w.detach().clone().requires_grad_()
    E.embedding(ids, w).backward(grad)
    return w.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,V,H,zipf", [(1, 5, 8, False), (700, 50, 64, True), (3000, 1000, 16, False)])
def test_weight_grad_accuracy(dtype, n, V, H, zipf):
    dt = getattr(torch, dtype)
    ids, w = _data(n, V, H, dtype, seed=2, zipf=zipf)
    ids = ids.view(1, n)
    grad = torch.randn(1, n, H, generator=torch.Generator().manual_seed(3)).to(dt)
    w_req = w.clone().requires_grad_()
    y = E.embedding(ids, w_req)
    y.backward(grad)
    w64 = w.double().requires_grad_()
    embedding_f64(ids, w64).backward(grad.double())
    assert same_bits(y, w[ids])
    bwd = contracts.tolerance(OP, dt, "backward")
    assert w_req.grad.dtype == dt
    assert bwd.check(w_req.grad, w64.grad), bwd.max_violation(w_req.grad, w64.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_fallback_takes_the_dispatch_arguments(dtype):
    ids, w = _data(12, 7, 5, dtype, seed=9)
    assert same_bits(reference_for(OP)(ids.view(3, 4), w), E.embedding(ids.view(3, 4), w))


def test_fixed_order_is_the_documented_pairwise_tree():
    ids = torch.tensor([3, 1, 3, 3, 0, 3, 3])
    src = torch.randn(7, 5, generator=torch.Generator().manual_seed(4))
    out = fixed_order_scatter_sum(ids, src, 5)
    g = src[[0, 2, 3, 5, 6]]  # id 3's tokens in token order: ((g0 + g1) + (g2 + g3)) + g4
    assert same_bits(out[3], ((g[0] + g[1]) + (g[2] + g[3])) + g[4])
    assert same_bits(out[1], src[1]) and same_bits(out[0], src[4])
    assert same_bits(out[2], torch.zeros(5)) and same_bits(out[4], torch.zeros(5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_including_weight_grad(dtype):
    ids, w = _data(4000, 300, 64, dtype, seed=5, zipf=True)
    assert run_to_run_failures(lambda wt: E.embedding(ids, wt), [w], runs=4) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_thread_count(dtype):
    ids, w = _data(4000, 300, 64, dtype, seed=8, zipf=True)
    assert thread_count_failures(lambda wt: E.embedding(ids, wt), [w]) == []


def _random_order_embedding(counter=[0]):  # noqa: B006 - the call counter is the point
    """Deliberately NOT deterministic: the backward accumulates in weight.dtype in an order
    that changes every call, as atomics whose order follows thread timing would."""

    class _F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w, ids):
            ctx.save_for_backward(ids)
            ctx.shape = w.shape
            return w[ids]

        @staticmethod
        def backward(ctx, grad):
            (ids,) = ctx.saved_tensors
            counter[0] += 1
            perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(counter[0]))
            ids_p, g_p = ids.reshape(-1)[perm], grad.reshape(-1, ctx.shape[1])[perm]
            # sequential accumulation in grad.dtype, token by token in the permuted order
            # (rank r of each id is added in step r; index_add_ may widen bf16 internally)
            _, order = torch.sort(ids_p, stable=True)
            sorted_ids = ids_p[order]
            start = torch.searchsorted(sorted_ids, sorted_ids)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(ids_p.numel()) - start
            dw = grad.new_zeros(ctx.shape)
            for r in range(int(rank.max()) + 1):
                sel = rank == r
                dw[ids_p[sel]] = dw[ids_p[sel]] + g_p[sel]
            return dw, None

    return lambda w, ids: _F.apply(w, ids)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_random_order_backward_is_caught(dtype):
    ids, w = _data(1000, 300, 64, dtype, seed=5, zipf=True)
    bad = _random_order_embedding()
    assert run_to_run_failures(lambda wt: bad(wt, ids), [w], runs=2) != []


def _locality_failures(fn, ids, w, grad, probe_ids):
    """dweight[v] from the whole batch vs from only the tokens with id v (in the same order)."""
    full = fn(ids, w, grad)
    failures = []
    for v in probe_ids:
        mask = ids == v
        alone = fn(ids[mask], w, grad[mask])
        d = same_bits(alone[v], full[v])
        if not d.equal:
            failures.append(f"id {v}: {d}")
    return failures


def _batch_order_dweight(ids, w, grad):
    """Deliberately NOT local: deterministic, but the summation order of an id's tokens follows
    a permutation drawn from the batch size, so it depends on the other tokens."""
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(ids.numel()))
    return torch.zeros(w.shape).index_add_(0, ids[perm], grad.float()[perm])


def test_weight_grad_row_depends_only_on_its_own_tokens():
    ids, w = _data(3000, 40, 32, "float32", seed=6, zipf=True)
    grad = torch.randn(3000, 32, generator=torch.Generator().manual_seed(7))
    probe = torch.unique(ids)[:8].tolist()
    assert _locality_failures(_dweight, ids, w, grad, probe) == []
    assert _locality_failures(_batch_order_dweight, ids, w, grad, probe) != []  # negative control


# ----------------------------------------------------------------------------- input


def test_bad_input_messages_name_the_argument():
    ids, w = _data(6, 10, 4, "float32")
    with pytest.raises(ValueError, match=r"^ids: expected token ids in \[0, 10\).*got 10"):
        E.embedding(torch.tensor([0, 10]), w)
    with pytest.raises(ValueError, match=r"^ids: expected token ids in \[0, 10\).*got -1"):
        E.embedding(torch.tensor([-1, 3]), w)
    with pytest.raises(ValueError, match="^ids: expected dtype"):
        E.embedding(ids.float(), w)
    with pytest.raises(ValueError, match="^ids: expected a contiguous"):
        E.embedding(ids.view(2, 3).t(), w)
    with pytest.raises(TypeError, match="^ids: expected a torch.Tensor"):
        E.embedding([1, 2], w)
    with pytest.raises(ValueError, match="^weight: expected dtype"):
        E.embedding(ids, w.half())
    with pytest.raises(ValueError, match="^weight: expected 2 dimensions"):
        E.embedding(ids, w[0])
    with pytest.raises(ValueError, match="^weight: expected a non-empty"):
        E.embedding(torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    E.embedding(ids, torch.full((10, 4), float("nan")))  # parameters are not scanned by default
    with nan_policy("raise_all"), pytest.raises(ValueError, match="^weight: contains NaN"):
        E.embedding(ids, torch.full((10, 4), float("nan")))
    with pytest.raises(ValueError, match="^weight: expected a contiguous"):
        E.embedding(ids, torch.randn(4, 10).t())
    with pytest.raises(ValueError, match="device"):
        E.embedding(torch.zeros(3, dtype=torch.int64, device="meta"), torch.empty(10, 4, device="meta"))


def test_empty_ids_give_empty_output_and_zero_grad():
    w = torch.randn(10, 4, requires_grad=True)
    y = E.embedding(torch.empty(2, 0, dtype=torch.int64), w)
    assert y.shape == (2, 0, 4)
    y.sum().backward()
    assert same_bits(w.grad, torch.zeros(10, 4))


def test_custom_ops_pass_opcheck():
    import rl_engine.backends.cpu.embedding  # noqa: F401  (registers torch.ops.rlk.*)

    ids = torch.tensor([[1, 2, 2], [2, 0, 1]])
    w = torch.randn(4, 3).bfloat16()
    torch.library.opcheck(torch.ops.rlk.embedding_cpu.default, (ids, w.requires_grad_()))
    torch.library.opcheck(torch.ops.rlk.embedding_cpu_backward.default, (torch.randn(2, 3, 3).bfloat16(), ids, 4))
