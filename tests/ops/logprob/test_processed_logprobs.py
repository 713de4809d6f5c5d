"""Processed log-probs (top-k / top-p replay) and the fp32 LM head on CPU: the canonical filter
and its kept-set record, the ``processed`` contract variant of the four log-prob operators
(fused == unfused on raw bits across chunkings, forward and both gradients), the ``fp32_logits``
variant of the fused LM head and ``gemm.linear``'s ``fp32_out``, each with a negative control
caught by the same checker, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts, runtime
from rl_engine.ops import gemm, logprob
from rl_engine.ops.logprob import KEEP_ALL_BOUNDARY, KeptSet, canonical_prefix, kept_set, scale_logits
from rl_engine.reference.logprob import linear_token_logprobs_f64
from rl_engine.runtime.registry import Implementation, NoEligibleImplementation, make_request, register, select
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "logprob.linear_token_logprobs"
CHUNKINGS = [(None, None), (7, 1024), (64, 2048), (100, 3072)]
NAMES = ("logprobs", "entropy", "grad hidden", "grad weight")


def _data(n, h, v, dtype, seed=0, top_k=200, top_p=0.9, temperature=0.8, logits_dtype=None):
    """Hidden states, LM head, the canonical kept sets of their logits and targets drawn inside them."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden = torch.randn(n, h, generator=g).to(dt)
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dt)
    logits = gemm.linear(hidden, weight, out_dtype=logits_dtype)
    k = torch.randint(0, top_k + 1, (n,), generator=g) if top_k else 0
    kept = kept_set(logits, temperature, k, top_p)
    keep = kept.mask(scale_logits(logits, temperature))
    targets = torch.multinomial(keep.float(), 1, generator=g).squeeze(1)
    return hidden, weight, targets, kept


def _grads(fn, hidden, weight, targets, use=("lp", "ent")):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets)
    g = torch.Generator().manual_seed(1)
    up = {"lp": lp * torch.randn(lp.shape, generator=g), "ent": ent * torch.randn(ent.shape, generator=g)}
    sum(up[k].sum() for k in use).backward()
    return [lp.detach(), ent.detach(), h.grad, w.grad]


def _unfused(kept, temperature, logits_dtype=None):
    def fn(h, w, t):
        logits = gemm.linear(h, w, out_dtype=logits_dtype)
        return logprob.token_logprobs(logits, t, temperature, kept=kept), logprob.entropy(logits, temperature, kept=kept)
    return fn


def _failures(candidate, hidden, weight, targets, kept, temperature, chunkings, logits_dtype=None, use=("lp", "ent")):
    """Raw-bit differences of ``candidate`` (fused signature) from the unfused processed path."""
    want = _grads(_unfused(kept, temperature, logits_dtype), hidden, weight, targets, use)
    out = []
    for tc, vc in chunkings:
        got = _grads(lambda h, w, t: candidate(h, w, t, temperature, True, token_chunk=tc, vocab_chunk=vc, kept=kept,
                                               logits_dtype=logits_dtype), hidden, weight, targets, use)
        out += [f"token_chunk={tc}, vocab_chunk={vc}, {n}: {same_bits(a, b)}" for n, a, b in zip(NAMES, got, want)
                if not same_bits(a, b).equal]
    return out


def chunk_relative_mask(hidden, weight, targets, temperature=1.0, return_entropy=True, *, token_chunk=None,
                        vocab_chunk=None, kept=None, logits_dtype=None):
    """Negative control: applies each record with column ids relative to the vocabulary chunk
    (``0 ..`` instead of ``c0 ..``), so the kept set depends on ``vocab_chunk``."""
    vc = vocab_chunk or 4096
    logits = gemm.linear(hidden, weight, out_dtype=logits_dtype)
    parts = []
    for c0 in range(0, logits.shape[1], vc):
        z = scale_logits(logits[:, c0 : c0 + vc], temperature)
        parts.append(z.masked_fill(~kept.mask(z, 0), float("-inf")))
    z = torch.cat(parts, 1)
    lse = torch.logsumexp(z, -1)
    logp = z - lse.unsqueeze(1)
    p = logp.exp()
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1), -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


# --------------------------------------------------------------------------- the canonical filter


def test_filter_keeps_the_canonical_prefix_and_the_record_reproduces_it():
    z = torch.tensor([[1.0, 3.0, 3.0, 2.0, -1.0, 3.0]])
    pre = canonical_prefix(z, top_k=2)
    assert pre.order[0].tolist() == [1, 2, 5, 3, 0, 4]  # z descending, ties by ascending id
    assert int(pre.count[0]) == 2
    assert float(pre.kept.threshold[0]) == 3.0 and int(pre.kept.boundary[0]) == 2
    assert pre.kept.mask(z)[0].tolist() == [False, True, True, False, False, False]  # exactly k, tie broken by id
    # top-p over the top-k mass: shortest prefix whose running sum reaches p of it
    w = torch.exp(torch.tensor([3.0, 3.0, 3.0, 2.0, 1.0, -1.0], dtype=torch.float64) - 3.0)
    c = torch.cumsum(w[:4], 0)
    n = int((c < 0.7 * c[-1]).sum()) + 1
    pre = canonical_prefix(z, top_k=4, top_p=0.7)
    assert int(pre.count[0]) == n == 3
    assert pre.kept.mask(z)[0].tolist() == [False, True, True, False, False, True]


def test_nothing_dropped_gives_the_keep_all_record():
    z = torch.randn(3, 50)
    for k, p in ((0, 1.0), (50, 1.0), (999, 1.0)):
        rec = canonical_prefix(z, k, p).kept
        assert bool(rec.keeps_everything().all())
        assert same_bits(rec.threshold, KeptSet.everything((3,)).threshold)
        assert (rec.boundary == KEEP_ALL_BOUNDARY).all()
    assert bool(canonical_prefix(z, 0, 1.0).kept.mask(z).all())


def test_filter_is_per_row():
    """A row's record depends on the row, its k and its p only, not on the other rows."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(9, 700, generator=g) * 2
    k = torch.tensor([0, 5, 40, 1, 700, 3, 0, 20, 9])
    p = torch.tensor([0.5, 1.0, 0.9, 0.3, 0.95, 1.0, 0.8, 0.99, 0.6])
    batch = canonical_prefix(z, k, p).kept
    for i in range(9):
        one = canonical_prefix(z[i : i + 1].clone(), int(k[i]), float(p[i])).kept
        assert same_bits(one.threshold, batch.threshold[i : i + 1]) and torch.equal(one.boundary, batch.boundary[i : i + 1])


def test_filter_rejects_bad_input():
    with pytest.raises(ValueError, match="^top_p: expected values in"):
        canonical_prefix(torch.randn(2, 5), 0, 0.0)
    with pytest.raises(ValueError, match="^top_p: expected values in"):
        canonical_prefix(torch.randn(2, 5), 0, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="^top_k: expected a number or 2 values"):
        canonical_prefix(torch.randn(2, 5), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="^z: expected float32"):
        canonical_prefix(torch.randn(2, 5).double())
    with pytest.raises(ValueError, match="^z: the scaled logits hold NaN"):
        canonical_prefix(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"^z: rows \[1\] have no finite entry"):
        canonical_prefix(torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]]))


# --------------------------------------------------------------------------- the processed variant


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_unfused_processed_across_chunkings(dtype, temperature):
    hidden, weight, targets, kept = _data(70, 48, 3100, dtype, seed=1, temperature=temperature)
    assert not bool(kept.keeps_everything().any())
    failures = _failures(logprob.linear_token_logprobs, hidden, weight, targets, kept, temperature, CHUNKINGS)
    assert failures == [], failures[:5]


@pytest.mark.parametrize("use", [("lp",), ("ent",)])
def test_fused_equals_unfused_processed_one_output(use):
    hidden, weight, targets, kept = _data(40, 32, 2100, "bfloat16", seed=2, temperature=1.0)
    failures = _failures(logprob.linear_token_logprobs, hidden, weight, targets, kept, 1.0, [(16, 1024)], use=use)
    assert failures == [], failures[:5]


def test_negative_control_chunk_relative_mask_is_caught():
    hidden, weight, targets, kept = _data(60, 32, 3100, "float32", seed=3, top_k=3000, top_p=0.95)
    assert _failures(chunk_relative_mask, hidden, weight, targets, kept, 0.8, [(None, 1024), (None, 2048)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_keep_all_record_gives_the_full_bits_and_a_filter_changes_them(dtype):
    """Keep-all records = no record, bit for bit (forward and both gradients); real records
    change every filtered token's log-prob (the bias a full-vocabulary trainer would have)."""
    hidden, weight, targets, kept = _data(50, 32, 2100, dtype, seed=4)
    full = lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 0.8, True)  # noqa: E731
    every = KeptSet.everything((50,))
    keep_all = lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 0.8, True, kept=every)  # noqa: E731
    for a, b in zip(_grads(full, hidden, weight, targets), _grads(keep_all, hidden, weight, targets)):
        assert same_bits(a, b)
    proc = logprob.linear_token_logprobs(hidden, weight, targets, 0.8, kept=kept)
    plain = logprob.linear_token_logprobs(hidden, weight, targets, 0.8)
    assert bool((proc > plain).all()), "renormalising over a strict subset raises every kept token's log-prob"


def test_processed_equals_full_on_masked_logits_and_matches_float64():
    hidden, weight, targets, kept = _data(30, 32, 1500, "float32", seed=5)
    logits = gemm.linear(hidden, weight)
    keep = kept.mask(scale_logits(logits, 0.8))
    masked = logits.masked_fill(~keep, float("-inf"))
    for op in ("token_logprobs", "entropy"):
        args = (logits, targets, 0.8) if op == "token_logprobs" else (logits, 0.8)
        margs = (masked, targets, 0.8) if op == "token_logprobs" else (masked, 0.8)
        assert same_bits(getattr(logprob, op)(*args, kept=kept), getattr(logprob, op)(*margs))
    ls = logprob.log_softmax(logits, 0.8, kept=kept)
    assert bool(torch.isneginf(ls[~keep]).all()) and bool(torch.isfinite(ls[keep]).all())
    assert same_bits(ls, logprob.log_softmax(masked, 0.8))
    lp64, ent64 = linear_token_logprobs_f64(hidden, weight, targets, 0.8, True, kept.threshold, kept.boundary)
    lp, ent = logprob.linear_token_logprobs(hidden, weight, targets, 0.8, True, kept=kept)
    tol = contracts.tolerance(OP, torch.float32, "forward")
    assert tol.check(lp, lp64) and tol.check(ent, ent64)


def test_gradient_is_plus_zero_outside_the_kept_set():
    hidden, weight, targets, kept = _data(20, 16, 1100, "float32", seed=6)
    logits = gemm.linear(hidden, weight).requires_grad_()
    keep = kept.mask(scale_logits(logits.detach(), 0.8))
    lp, ent = logprob.token_logprobs(logits, targets, 0.8, kept=kept), logprob.entropy(logits, 0.8, kept=kept)
    (lp.sum() - 0.5 * ent.sum()).backward()
    dropped = logits.grad[~keep]
    assert bool((dropped == 0).all()) and not bool(torch.signbit(dropped).any())
    assert bool((logits.grad[keep] != 0).any())
    x = logits.detach().clone().requires_grad_()
    out = logprob.log_softmax(x, 0.8, kept=kept)
    up = torch.where(keep, torch.randn(x.shape), torch.full(x.shape, 5.0))  # upstream at -inf outputs is ignored
    out.backward(up)
    assert bool((x.grad[~keep] == 0).all())
    x64 = logits.detach().double().masked_fill(~keep, float("-inf")).div(0.8).requires_grad_()
    torch.log_softmax(x64, -1).backward(torch.where(keep, up, 0.0).double())
    tol = contracts.tolerance("logprob.log_softmax", torch.float32, "backward")
    assert tol.check(x.grad[keep], (x64.grad / 0.8)[keep])


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), n=st.integers(1, 20), v=st.integers(2, 2600), token_chunk=st.sampled_from([None, 1, 5]))
def test_row_invariance_processed_forward_and_grad(dtype, data, n, v, token_chunk):
    with threads(1):
        hidden, weight, targets, kept = _data(n, 16, v, dtype, seed=n * 13 + v, top_k=min(v, 50))

        def fn(hid, tgt, thr, bnd, w):
            return logprob.linear_token_logprobs(hid, w, tgt, 0.8, True, token_chunk=token_chunk, kept=KeptSet(thr, bnd))

        rep = check_row_invariance(fn, [hidden, targets, kept.threshold, kept.boundary], data.draw(row_trials(n)),
                                   (weight,), grads=True)
        assert rep.ok, str(rep)


def test_bad_kept_records_name_the_argument():
    hidden, weight, targets, kept = _data(6, 8, 60, "float32", seed=7, top_k=5, temperature=1.0)
    logits = gemm.linear(hidden, weight)
    f = logprob.token_logprobs
    with pytest.raises(TypeError, match="^kept: expected a rl_engine.ops.logprob.KeptSet"):
        f(logits, targets, kept=(kept.threshold, kept.boundary))
    with pytest.raises(ValueError, match="^kept.threshold: expected dtype"):
        f(logits, targets, kept=KeptSet(kept.threshold.double(), kept.boundary))
    with pytest.raises(ValueError, match="^kept.boundary: expected dtype"):
        f(logits, targets, kept=KeptSet(kept.threshold, kept.boundary.float()))
    with pytest.raises(ValueError, match=r"^kept.threshold: expected shape \(6,\)"):
        f(logits, targets, kept=kept[:5])
    with pytest.raises(ValueError, match="^kept.threshold: expected scaled logits below"):
        f(logits, targets, kept=KeptSet(torch.full((6,), float("nan")), kept.boundary))
    outside = targets.clone()
    keep = kept.mask(logits)
    outside[2] = int(torch.nonzero(~keep[2])[0])
    # a target outside its kept set (logits that drifted from the record's) counts as kept: the
    # log-prob over the kept set plus the target, finite, the same bits fused and unfused
    keep_t = keep.clone()
    keep_t[2, outside[2]] = True
    lp = f(logits, outside, kept=kept)
    assert same_bits(lp, f(logits.masked_fill(~keep_t, float("-inf")), outside))
    assert bool(torch.isfinite(lp).all())
    assert same_bits(logprob.linear_token_logprobs(hidden, weight, outside, kept=kept), lp)
    above = KeptSet(torch.full((6,), 1e30), kept.boundary)
    with pytest.raises(ValueError, match=r"^kept: rows \[0, 1, 2, 3, 4, 5\] keep no finite logit"):
        logprob.entropy(logits, kept=above)
    with pytest.raises(ValueError, match=r"^kept.threshold: expected shape \(6,\)"):
        logprob.log_softmax(logits, kept=kept.reshape(2, 3))


def test_dispatch_records_the_variant_and_strict_rejects_an_implementation_without_it():
    hidden, weight, targets, kept = _data(4, 8, 50, "float32", seed=8, top_k=5, temperature=1.0)
    with runtime.provenance.record() as recs:
        logprob.linear_token_logprobs(hidden, weight, targets, kept=kept)
    assert [(r.op, r.impl_id) for r in recs] == [(OP, "cpu.canonical_lse")]
    req = make_request("logprob.token_logprobs", hidden, variants=frozenset({"processed"}))
    impl, _ = select(req)
    assert impl is not None and "processed" in impl.variants
    with pytest.raises(ValueError, match="^variants: .* declares \\['sideways'\\]"):
        register(Implementation(op="logprob.token_logprobs", impl_id="test.bad_variant", version="1", fn=lambda *a: None,
                                families=("cpu",), dtypes=(torch.float32,), guarantees=frozenset(),
                                variants=frozenset({"sideways"})))


def test_an_implementation_without_the_variant_is_not_eligible(monkeypatch):
    from rl_engine.runtime import registry

    req = make_request("logprob.token_logprobs", torch.zeros(1), variants=frozenset({"processed"}))
    plain = [i for i in registry.implementations("logprob.token_logprobs") if i.impl_id == "cpu.canonical_lse"][0]
    stripped = Implementation(**{**plain.__dict__, "variants": frozenset()})
    assert stripped.reject_reasons(req) == ["does not implement contract variants ['processed']"]
    monkeypatch.setitem(registry._REGISTRY, "logprob.token_logprobs", [stripped])
    logits = torch.randn(2, 10)
    with pytest.raises(NoEligibleImplementation, match="does not implement contract variants"):
        logprob.token_logprobs(logits, torch.tensor([0, 1]), kept=KeptSet.everything((2,)))


# --------------------------------------------------------------------------- fp32 LM head


@pytest.mark.parametrize("processed", [False, True])
def test_fp32_logits_fused_equals_unfused_on_fp32_logits(processed):
    hidden, weight, targets, kept = _data(70, 48, 3100, "bfloat16", seed=9, logits_dtype=torch.float32, temperature=0.9)
    kept = kept if processed else None
    failures = _failures(logprob.linear_token_logprobs, hidden, weight, targets, kept, 0.9, CHUNKINGS,
                         logits_dtype=torch.float32)
    assert failures == [], failures[:5]
    got = _grads(lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 0.9, True, kept=kept, logits_dtype=torch.float32),
                 hidden, weight, targets)
    assert got[0].dtype == torch.float32 and got[2].dtype == got[3].dtype == torch.bfloat16


def test_negative_control_fp32_logits_differ_from_bf16_logits():
    """The checker that passes the fp32 variant catches the default mode (bf16-rounded logits)
    used in its place."""
    hidden, weight, targets, _ = _data(60, 48, 3100, "bfloat16", seed=10)

    def default_mode(h, w, t, temperature, return_entropy, *, token_chunk=None, vocab_chunk=None, kept=None,
                     logits_dtype=None):
        return logprob.linear_token_logprobs(h, w, t, temperature, True, token_chunk=token_chunk, vocab_chunk=vocab_chunk)

    assert _failures(default_mode, hidden, weight, targets, None, 0.9, [(None, None)], logits_dtype=torch.float32)


def test_fp32_out_linear_is_row_and_column_chunk_invariant_and_its_backward_is_the_bf16_one():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(50, 64, generator=g).bfloat16()
    w = torch.randn(3000, 64, generator=g).bfloat16()
    y = gemm.linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert same_bits(gemm.linear(x[7:9], w[1024:2048], out_dtype=torch.float32), y[7:9, 1024:2048])
    assert same_bits(y.bfloat16(), gemm.linear(x, w))  # one rounding of the same exact sum
    up = torch.randn(50, 3000, generator=g)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    gemm.linear(xa, wa, out_dtype=torch.float32).backward(up)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    gemm.linear(xb, wb).backward(up.bfloat16())
    assert same_bits(xa.grad, xb.grad) and same_bits(wa.grad, wb.grad)
    assert same_bits(gemm.linear(x.float(), w.float(), out_dtype=torch.float32), gemm.linear(x.float(), w.float()))


def test_fp32_modes_reject_other_dtypes():
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    with pytest.raises(ValueError, match="^out_dtype: expected None, the input dtype"):
        gemm.linear(x, w, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="^logits_dtype: expected None, the input dtype"):
        logprob.linear_token_logprobs(x, w, torch.tensor([0, 1]), logits_dtype=torch.float64)
    with runtime.provenance.record() as recs:
        gemm.linear(x, w, out_dtype=torch.float32)
    assert [r.impl_id for r in recs] == ["cpu.exact_sum"]
