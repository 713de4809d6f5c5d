"""loss.kl (k1/k2/k3) and loss.aggregate (entropy bonus, masked aggregation): accuracy vs float64
formulas with gradients, micro-batch / permutation / layout invariance on raw bits with a
negative control, a combined PPO + KL + entropy objective split into micro-batches, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import loss as L
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.microbatch import LAYOUTS, check_microbatch_invariance
from tests.helpers.threads import threads
from tests.ops.loss.helpers import DTYPES, f64_kl, f64_reduce, make_batch, splits

CHECK = dict(
    combine=L.combine_microbatch_losses,
    compare_of=lambda o: {"loss": o.loss, **o.metrics},
    loss_of=lambda o: o.loss,
    rows_of=lambda o: o.seq_terms,
)


def _den(mask, red):
    d = L.loss_denominator(mask, red, loss_scale_factor=32.0 if red.endswith("-norm") else None)
    return d if d > 0 else 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), B=st.integers(1, 10), T=st.integers(1, 70), estimator=st.sampled_from(L.KL_ESTIMATORS),
       reduction=st.sampled_from(L.REDUCTIONS), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_kl_microbatch_permutation_layout_invariance(dtype, data, B, T, estimator, reduction, layout, seed):
    with threads(1):  # tiny calls; thread-count independence is tested in test_loss_determinism_gpu.py
        lp, ref, _, mask, _ = make_batch(B, T, dtype, seed, spread=0.3)
        den = _den(mask, reduction)
        fn = lambda lp_, ref_, m_: L.kl_penalty(lp_, ref_, m_, estimator=estimator, reduction=reduction, denominator=den)  # noqa: E731
        rep = check_microbatch_invariance(fn, [lp, ref, mask], data.draw(splits(B)), layout=layout, mask_arg=2, grad_args=(0,), **CHECK)
        assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), B=st.integers(1, 10), T=st.integers(1, 70), reduction=st.sampled_from(L.REDUCTIONS),
       entropy=st.booleans(), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_aggregate_microbatch_permutation_layout_invariance(dtype, data, B, T, reduction, entropy, layout, seed):
    with threads(1):  # tiny calls; thread-count independence is tested in test_loss_determinism_gpu.py
        values, _, _, mask, _ = make_batch(B, T, dtype, seed)
        values = -values  # entropies are >= 0
        den = _den(mask, reduction)
        op = L.entropy_bonus if entropy else L.masked_aggregate
        fn = lambda v, m: op(v, m, reduction=reduction, denominator=den)  # noqa: E731
        rep = check_microbatch_invariance(fn, [values, mask], data.draw(splits(B)), layout=layout, mask_arg=1, grad_args=(0,), **CHECK)
        assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40)  # each op has its own 200-example test; this checks their sum
@given(data=st.data(), B=st.integers(2, 10), T=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_combined_objective_gradients_are_microbatch_invariant(dtype, data, B, T, seed):
    """loss = grpo + β·k3 + (−c)·entropy on micro-batches: accumulated log-prob gradients equal the
    full batch's rows and the combined logged losses equal the full-batch values, bitwise."""
    with threads(1):  # tiny calls; thread-count independence is tested in test_loss_determinism_gpu.py
        lp, old, adv, mask, _ = make_batch(B, T, dtype, seed)
        ref = old.flip(0).contiguous()
        ent = (-lp).contiguous()
        red = "seq-mean-token-mean"
        den = _den(mask, red)

        def fn(lp_, old_, adv_, ref_, ent_, m_):
            pg = L.grpo_loss(lp_, old_, adv_, m_, denominator=den)
            kl = L.kl_penalty(lp_, ref_, m_, reduction=red, denominator=den)
            eb = L.entropy_bonus(ent_, m_, reduction=red, denominator=den)
            return pg, kl, eb

        def combine(parts):
            return tuple(L.combine_microbatch_losses([p[i] for p in parts]) for i in range(3))

        rep = check_microbatch_invariance(
            fn, [lp, old, adv, ref, ent, mask], data.draw(splits(B)), combine=combine,
            compare_of=lambda o: {"pg": o[0].loss, "kl": o[1].loss, "ent": o[2].loss},
            loss_of=lambda o: o[0].loss + 0.05 * o[1].loss - 0.01 * o[2].loss,
            grad_args=(0, 4), layout=data.draw(st.sampled_from(LAYOUTS)), mask_arg=5,
        )
        assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", L.KL_ESTIMATORS)
@pytest.mark.parametrize("reduction", L.REDUCTIONS)
def test_kl_accuracy_vs_float64(dtype, estimator, reduction):
    lp, ref, _, mask, _ = make_batch(7, 45, dtype, seed=21, spread=0.5)
    mask[2] = False
    x = lp.clone().requires_grad_()
    out = L.kl_penalty(x, ref, mask, estimator=estimator, reduction=reduction,
                       loss_scale_factor=32.0 if reduction.endswith("-norm") else None)
    out.loss.backward()
    x64 = lp.double().requires_grad_()
    tok = f64_kl(x64, ref.double(), estimator)
    want, rows = f64_reduce(tok, mask, reduction, C=32.0)
    want.backward()
    dt = getattr(torch, dtype)
    fwd, bwd = contracts.tolerance("loss.kl", dt, "forward"), contracts.tolerance("loss.kl", dt, "backward")
    assert fwd.check(out.loss, want), fwd.max_violation(out.loss, want)
    assert fwd.check(out.seq_terms, rows), fwd.max_violation(out.seq_terms, rows)
    assert bwd.check(x.grad, x64.grad), bwd.max_violation(x.grad, x64.grad)
    assert fwd.check(out.metrics["kl"], tok.detach()[mask].mean())
    if estimator == "k3":
        assert float(out.loss.detach()) >= 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", L.REDUCTIONS)
def test_entropy_accuracy_vs_float64(dtype, reduction):
    ent, _, _, mask, _ = make_batch(6, 33, dtype, seed=5)
    ent = (-ent).requires_grad_()
    out = L.entropy_bonus(ent, mask, reduction=reduction, loss_scale_factor=32.0 if reduction.endswith("-norm") else None)
    out.loss.backward()
    e64 = ent.detach().double().requires_grad_()
    want, rows = f64_reduce(e64, mask, reduction, C=32.0)
    want.backward()
    dt = getattr(torch, dtype)
    fwd, bwd = contracts.tolerance("loss.aggregate", dt, "forward"), contracts.tolerance("loss.aggregate", dt, "backward")
    assert fwd.check(out.loss, want) and fwd.check(out.seq_terms, rows)
    assert bwd.check(ent.grad, e64.grad) and ent.grad.dtype == dt
    assert fwd.check(out.metrics["entropy"], e64.detach()[mask].mean())


def test_negative_control_flattened_mean_is_caught():
    """``torch.mean`` of the flattened masked values under a permutation differs; ours does not."""
    v, _, _, mask, _ = make_batch(32, 300, "float32", seed=3)
    gen = torch.Generator().manual_seed(0)
    perms = [[torch.randperm(32, generator=gen).tolist()] for _ in range(8)]  # 8 tries: robust on any CPU
    kw = dict(combine=lambda p: p[0], compare_of=lambda t: {"loss": t}, loss_of=lambda t: t)
    naive = lambda v_, m_: torch.sum(torch.where(m_, v_, 0.0)) / m_.sum()  # noqa: E731
    assert not check_microbatch_invariance(naive, [v, mask], perms, **kw).ok
    ours = lambda v_, m_: L.masked_aggregate(v_, m_).loss  # noqa: E731
    assert check_microbatch_invariance(ours, [v, mask], perms, **kw).ok


def test_kl_estimators_known_values():
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    m = torch.ones(1, 1, dtype=torch.bool)
    log_rho = math.log(0.5)
    assert L.kl_penalty(lp, ref, m, estimator="k1").loss.item() == pytest.approx(-log_rho)
    assert L.kl_penalty(lp, ref, m, estimator="k2").loss.item() == pytest.approx(0.5 * log_rho**2)
    assert L.kl_penalty(lp, ref, m, estimator="k3").loss.item() == pytest.approx(0.5 - 1 - log_rho)
    same = L.kl_penalty(lp, lp, m, estimator="k3")
    assert same.loss.item() == 0.0


def test_bad_input_messages_name_the_argument():
    lp, ref, _, mask, _ = make_batch(3, 6, "float32", seed=5)
    with pytest.raises(ValueError, match="^estimator: expected one of"):
        L.kl_penalty(lp, ref, mask, estimator="k4")
    with pytest.raises(ValueError, match="^ref_log_probs: expected shape"):
        L.kl_penalty(lp, ref[:2].contiguous(), mask)
    with pytest.raises(ValueError, match="^entropy: expected dtype"):
        L.entropy_bonus(lp.half(), mask)
    with pytest.raises(ValueError, match="^values: contains NaN"):
        L.masked_aggregate(torch.full_like(lp, float("nan")), mask)
    with pytest.raises(ValueError, match="^mask: expected dtype"):
        L.masked_aggregate(lp, mask.to(torch.complex64))
    with pytest.raises(ValueError, match="^loss_scale_factor: required"):
        L.entropy_bonus(lp, mask, reduction="seq-mean-token-sum-norm")


def test_zero_active_tokens():
    lp, ref, _, mask, _ = make_batch(3, 6, "float32", seed=5)
    x = lp.clone().requires_grad_()
    out = L.kl_penalty(x, ref, torch.zeros_like(mask))
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x)) and math.isnan(out.metrics["kl"].item())
    assert same_bits(L.masked_aggregate(lp, torch.zeros_like(mask)).loss, torch.zeros(()))


def test_references_agree_with_the_implementation():
    from rl_engine.runtime import implementations, reference_for

    lp, ref, _, mask, _ = make_batch(5, 40, "float32", seed=8, spread=0.4)
    for op, args in (("loss.kl", [(lp, ref, mask, e) for e in L.KL_ESTIMATORS]), ("loss.aggregate", [(-lp, mask)])):
        tol = contracts.tolerance(op, torch.float32, "forward")
        impl = implementations(op)[0]
        for a in args:
            for got, want in zip(impl.fn(*a), reference_for(op)(*a)):
                assert tol.check(got, want), (op, a[-1])
