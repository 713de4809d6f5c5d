"""loss.policy (PPO clip / dual clip, GRPO, Dr. GRPO, DAPO, GSPO, CISPO): accuracy vs float64
formulas (loss, per-sequence terms, gradients), micro-batch / permutation / layout invariance on
raw bits (loss, metrics, gradients) with negative controls, run-to-run determinism, dispatch and
bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.utils.reductions import fixed_order_sum
from rl_engine.ops import loss as L
from rl_engine.runtime import implementations, provenance, reference_for
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.microbatch import LAYOUTS, check_microbatch_invariance
from tests.helpers.threads import threads
from tests.ops.loss.helpers import DEFAULT_REDUCTION, DTYPES, VARIANTS, f64_reduce, f64_token_terms, make_batch, splits

OP = "loss.policy"
REDUCTIONS = L.REDUCTIONS


def _call(name, reduction=None, **extra):
    fn, kw, *_ = VARIANTS[name]
    kw = dict(kw)
    if reduction is not None:
        kw["reduction"] = reduction
        if reduction != "seq-mean-token-sum-norm":
            kw.pop("loss_scale_factor", None)
        else:
            kw.setdefault("loss_scale_factor", 48.0)
    kw.update(extra)
    return lambda lp, old, adv, mask, w=None: fn(lp, old, adv, mask, is_weights=w, **kw)


def _lossout_checker_kwargs():
    return dict(
        combine=L.combine_microbatch_losses,
        compare_of=lambda o: {"loss": o.loss, **o.metrics},
        loss_of=lambda o: o.loss,
        rows_of=lambda o: o.seq_terms,
        grad_args=(0,),
        mask_arg=3,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(
    data=st.data(),
    B=st.integers(1, 10),
    T=st.integers(1, 70),
    variant=st.sampled_from(sorted(VARIANTS)),
    reduction=st.sampled_from((None, *REDUCTIONS)),
    use_w=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_microbatch_permutation_layout_invariance(dtype, data, B, T, variant, reduction, use_w, layout, seed):
    with threads(1):  # tiny calls; thread-count independence is tested in test_loss_determinism_gpu.py
        lp, old, adv, mask, w = make_batch(B, T, dtype, seed, p_active=data.draw(st.sampled_from([0.1, 0.6, 1.0])))
        red = reduction or DEFAULT_REDUCTION[variant]
        lsf = 48.0 if red == "seq-mean-token-sum-norm" else None
        den = L.loss_denominator(mask, red, loss_scale_factor=lsf)
        if den == 0:
            den = 1.0  # nothing active: any positive denominator, the loss is 0
        fn = _call(variant, red, denominator=den)
        args = [lp, old, adv, mask] + ([w] if use_w else [])
        rep = check_microbatch_invariance(fn, args, data.draw(splits(B)), layout=layout, **_lossout_checker_kwargs())
        assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("reduction", [None, *REDUCTIONS])
def test_accuracy_vs_float64(dtype, variant, reduction):
    _, _, kind, (eps_low, eps_high), dual = VARIANTS[variant]
    red = reduction or DEFAULT_REDUCTION[variant]
    lp, old, adv, mask, w = make_batch(9, 37, dtype, seed=11, seq_adv=(kind == "gspo"))
    mask[4] = False  # a sequence without active tokens
    lp = lp.clone().requires_grad_()
    out = _call(variant, red)(lp, old, adv, mask, w)
    out.loss.backward()
    lp64 = lp.detach().double().requires_grad_()
    tok = f64_token_terms(kind, lp64, old.double(), adv.double(), eps_low, eps_high, dual, mask) * w.double()
    want, want_rows = f64_reduce(tok, mask, red, C=48.0)
    want.backward()
    dt = getattr(torch, dtype)
    fwd, bwd = contracts.tolerance(OP, dt, "forward"), contracts.tolerance(OP, dt, "backward")
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert fwd.check(out.loss, want), fwd.max_violation(out.loss, want)
    assert fwd.check(out.seq_terms, want_rows), fwd.max_violation(out.seq_terms, want_rows)
    assert lp.grad.dtype == dt
    assert bwd.check(lp.grad, lp64.grad), bwd.max_violation(lp.grad, lp64.grad)
    assert torch.all(lp.grad[~mask] == 0)
    # metrics against float64 definitions
    m64 = mask
    ratio = torch.exp(lp64.detach() - old.double())[m64]
    assert int(out.metrics["active_tokens"]) == int(mask.sum())
    assert int(out.metrics["active_sequences"]) == int(mask.any(-1).sum())
    assert fwd.check(out.metrics["approx_kl"], (old.double() - lp64.detach())[m64].mean())
    if kind != "gspo":
        assert fwd.check(out.metrics["ratio_mean"], ratio.mean())
        assert fwd.check(out.metrics["ratio_max"], ratio.max())
        assert fwd.check(out.metrics["ratio_min"], ratio.min())
    if kind == "ppo":
        a = adv.double()[m64]
        clipped = (-a * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)) > (-a * ratio)
        assert abs(float(out.metrics["clip_frac"]) - float(clipped.double().mean())) <= 1.5 / ratio.numel()


def test_gspo_equals_sequence_level_objective():
    """With one advantage per sequence, GSPO-token + seq-mean-token-mean is the sequence-level GSPO."""
    lp, old, adv, mask, _ = make_batch(6, 29, "float32", seed=3, seq_adv=True)
    lp = lp.clone().requires_grad_()
    out = L.gspo_loss(lp, old, adv, mask, eps_low=0.01, eps_high=0.02)
    out.loss.backward()
    lp64 = lp.detach().double().requires_grad_()
    m = mask.double()
    n = m.sum(-1)
    s = torch.exp(((lp64 - old.double()) * m).sum(-1) / n)
    A = adv.double()[:, 0]
    seq_obj = torch.max(-A * s, -A * torch.clamp(s, 0.99, 1.02)).mean()
    seq_obj.backward()
    tol = contracts.tolerance(OP, torch.float32, "forward")
    assert tol.check(out.loss, seq_obj)
    assert contracts.tolerance(OP, torch.float32, "backward").check(lp.grad, lp64.grad)


def test_dual_clip_caps_negative_advantage_loss():
    lp = torch.tensor([[-1.0, -3.0, -1.0]])
    old = torch.full((1, 3), -3.0)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    plain = L.ppo_clip_loss(lp, old, adv, mask, reduction="seq-mean-token-sum")
    dual = L.ppo_clip_loss(lp, old, adv, mask, reduction="seq-mean-token-sum", dual_clip=3.0)
    # token 0: ratio e^2 ≈ 7.39 with A = -1 → plain loss 7.39, dual-clipped to 3
    assert math.isclose(plain.loss.item(), math.exp(2) + 1 - 1.2, rel_tol=1e-6)
    assert math.isclose(dual.loss.item(), 3 + 1 - 1.2, rel_tol=1e-6)
    assert dual.metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert dual.metrics["clip_frac_high"].item() == pytest.approx(1 / 3)


def test_cispo_keeps_gradient_on_clipped_tokens():
    lp = torch.tensor([[-1.0, -2.5]], requires_grad=True)
    old = torch.full((1, 2), -2.0)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = L.cispo_loss(lp, old, adv, mask, eps_high=0.2)
    out.loss.backward()
    # weight of token 0 truncated to 1.2, token 1 is e^-0.5; grad = -w A / N
    assert lp.grad[0, 0].item() == pytest.approx(-1.2 / 2, rel=1e-6)
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(-0.5) / 2, rel=1e-6)
    assert out.metrics["clip_frac_high"].item() == 0.5
    ppo = L.ppo_clip_loss(lp.detach().clone().requires_grad_(), old, adv, mask)
    assert ppo.metrics["clip_frac_high"].item() == 0.5


def test_dr_grpo_is_sum_over_constant():
    lp, old, adv, mask, _ = make_batch(5, 20, "float32", seed=4)
    out = L.dr_grpo_loss(lp, old, adv, mask, loss_scale_factor=64)
    same = L.ppo_clip_loss(lp, old, adv, mask, reduction="seq-mean-token-sum", denominator=5 * 64)
    assert same_bits(out.loss, same.loss)
    assert out.denominator == 5 * 64


# ------------------------------------------------------------------------------ negative controls


def _naive_token_mean(den):
    """verl-style: torch.sum over the flattened masked loss (order follows the tensor layout)."""

    def fn(lp, old, adv, mask):
        r = torch.exp(lp - old)
        tok = torch.max(-adv * r, -adv * torch.clamp(r, 0.8, 1.2))
        return torch.sum(tok * mask) / den

    return fn


def _per_microbatch_mean(lp, old, adv, mask):
    r = torch.exp(lp - old)
    tok = torch.max(-adv * r, -adv * torch.clamp(r, 0.8, 1.2))
    return torch.sum(tok * mask) / mask.sum()


def test_negative_controls_are_caught():
    lp, old, adv, mask, _ = make_batch(24, 200, "float32", seed=7)
    den = L.loss_denominator(mask)
    split = [[list(range(0, 5)), list(range(5, 17)), list(range(17, 24))]]
    gen = torch.Generator().manual_seed(1)
    perms = [torch.randperm(24, generator=gen).tolist() for _ in range(8)]
    # eight splits: whether one rounding-order change flips the last bit depends on the data and
    # on the CPU's reduction kernel; across eight, a non-invariant sum is caught on any machine
    splits8 = split + [[p[:k], p[k:]] for p, k in zip(perms[1:], range(3, 24, 3))]
    kw = dict(compare_of=lambda t: {"loss": t}, loss_of=lambda t: t, grad_args=(0,))
    # (1) flattened torch.sum, micro-batch losses summed: rounding order depends on the split
    rep = check_microbatch_invariance(_naive_token_mean(den), [lp, old, adv, mask], splits8, combine=lambda p: sum(p[1:], p[0]), **kw)
    assert not rep.ok
    # (2) per-micro-batch token mean, averaged: not even the same number (nor the same gradients)
    rep = check_microbatch_invariance(_per_microbatch_mean, [lp, old, adv, mask], split, combine=lambda p: sum(p) / len(p), **kw)
    assert not rep.ok and any("gradient" in f for f in rep.failures)
    # (3) flattened torch.sum under batch permutations
    rep = check_microbatch_invariance(_naive_token_mean(den), [lp, old, adv, mask], [[p] for p in perms], combine=lambda p: p[0], **kw)
    assert not rep.ok
    # (4) positional (uncompacted) fixed-order per-sequence sums are not invariant to masked holes
    def positional(lp_, old_, adv_, mask_):
        r = torch.exp(lp_ - old_)
        return fixed_order_sum(torch.where(mask_, torch.max(-adv_ * r, -adv_ * torch.clamp(r, 0.8, 1.2)), 0.0))

    rep = check_microbatch_invariance(positional, [lp, old, adv, mask], [[list(range(24))]], combine=lambda p: p[0],
                                      compare_of=lambda t: {"seq_sums": t}, rows_of=lambda t: t, loss_of=lambda t: t.sum(),
                                      layout="interleave", mask_arg=3)
    assert not rep.ok
    # ... and ours passes the same four checks
    ours = dict(_lossout_checker_kwargs())
    for sp, layout in ((splits8, None), (splits8, "trim"), ([[p] for p in perms], None), ([[list(range(24))]], "interleave")):
        rep = check_microbatch_invariance(_call("ppo", denominator=den), [lp, old, adv, mask], sp, layout=layout, **ours)
        assert rep.ok, str(rep)


# ------------------------------------------------------------------------------ determinism, dispatch


@pytest.mark.parametrize("variant", ["ppo_dual", "gspo", "cispo"])
def test_run_to_run_determinism(variant):
    lp, old, adv, mask, w = make_batch(16, 300, "bfloat16", seed=9)
    runs = []
    for _ in range(3):
        x = lp.clone().requires_grad_()
        out = _call(variant)(x, old, adv, mask, w)
        out.loss.backward()
        runs.append((out.loss, out.seq_terms, x.grad, *out.metrics.values()))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert same_bits(a, b)


def test_dispatch_provenance_and_reference():
    impl = implementations(OP)[0]
    assert impl.impl_id == "portable.fixed_order" and set(impl.untested_families) == {"cuda", "rocm"}
    lp, old, adv, mask, w = make_batch(4, 9, "float32", seed=1)
    with provenance.record() as recs:
        L.grpo_loss(lp, old, adv, mask)
    assert [r.impl_id for r in recs] == ["portable.fixed_order"] and not recs[0].fallback
    ref = reference_for(OP)
    tol = contracts.tolerance(OP, torch.float32, "forward")
    for kind, lo, hi, dual in (("ppo_clip", 0.2, 0.3, 2.0), ("gspo", 0.01, 0.01, None), ("cispo", math.inf, 0.2, None)):
        want = ref(lp, old, adv, mask, w, kind, lo, hi, dual)
        got = impl.fn(lp, old, adv, mask, w, kind, lo, hi, dual)
        assert tol.check(got[0], want[0]) and tol.check(got[1], want[1])


def test_opcheck_custom_ops():
    from rl_engine.backends.cpu.loss.token import loss_policy

    lp, old, adv, mask, w = make_batch(3, 7, "float32", seed=2)
    for args in ((lp.requires_grad_(), old, adv, mask, w, "ppo_clip", 0.2, 0.2, 3.0), (lp, old, adv, mask, None, "gspo", 0.1, 0.1, None)):
        torch.library.opcheck(loss_policy, args)


# ------------------------------------------------------------------------------ edge cases, bad input


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_zero_active_tokens_gives_zero_loss_and_nan_metrics(variant):
    lp, old, adv, mask, _ = make_batch(3, 5, "float32", seed=0)
    x = lp.clone().requires_grad_()
    out = _call(variant)(x, old, adv, torch.zeros_like(mask))
    out.loss.backward()
    assert out.loss.item() == 0.0 and not out.loss.signbit()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert int(out.metrics["active_tokens"]) == 0 and math.isnan(out.metrics["clip_frac"].item())
    for B, T in ((0, 5), (3, 0), (0, 0)):
        e = torch.zeros(B, T, requires_grad=True)
        out = _call(variant)(e, e.detach(), e.detach(), torch.zeros(B, T, dtype=torch.bool))
        out.loss.backward()
        assert out.loss.item() == 0.0 and e.grad.shape == (B, T) and out.seq_terms.shape == (B,)


def test_mask_accepts_01_numbers():
    lp, old, adv, mask, _ = make_batch(3, 6, "float32", seed=5)
    a = L.ppo_clip_loss(lp, old, adv, mask)
    for m in (mask.float(), mask.long(), mask.to(torch.uint8)):
        assert same_bits(L.ppo_clip_loss(lp, old, adv, m).loss, a.loss)


def test_bad_input_messages_name_the_argument():
    lp, old, adv, mask, _ = make_batch(3, 6, "float32", seed=5)
    f = L.ppo_clip_loss
    cases = [
        (lambda: f(lp, old, adv, mask[:, :5].contiguous()), ValueError, "^log_probs: expected shape"),
        (lambda: f(lp, old, adv[:, :5].contiguous(), mask), ValueError, "^advantages: expected shape"),
        (lambda: f(lp, old, adv, mask.float() * 2), ValueError, r"^mask: expected values in \{0, 1\}"),
        (lambda: f(lp, old, adv, mask[0]), ValueError, "^mask: expected 2 dimensions"),
        (lambda: f(lp.double(), old, adv, mask), ValueError, "^log_probs: expected dtype"),
        (lambda: f(lp.t().contiguous().t(), old, adv, mask), ValueError, "^log_probs: expected a contiguous"),
        (lambda: f(torch.full_like(lp, float("nan")), old, adv, mask), ValueError, "^log_probs: contains NaN"),
        (lambda: f([[0.0]], old, adv, mask), TypeError, "^log_probs: expected a torch.Tensor"),
        (lambda: f(lp, old, adv, mask, eps_low=1.5), ValueError, "^eps_low: expected"),
        (lambda: f(lp, old, adv, mask, eps_high=-0.1), ValueError, "^eps_high: expected"),
        (lambda: f(lp, old, adv, mask, dual_clip=1.0), ValueError, "^dual_clip: expected"),
        (lambda: f(lp, old, adv, mask, reduction="mean"), ValueError, "^reduction: expected one of"),
        (lambda: f(lp, old, adv, mask, denominator=0), ValueError, "^denominator: expected"),
        (lambda: f(lp, old, adv, mask, denominator=float("inf")), ValueError, "^denominator: expected a finite"),
        (lambda: f(lp, old, adv, mask, is_weights=torch.ones(3, 5)), ValueError, "^is_weights: expected shape"),
        (lambda: L.dr_grpo_loss(lp, old, adv, mask), ValueError, "^loss_scale_factor: required"),
        (lambda: L.loss_denominator(mask, "token-mean", loss_scale_factor=3), ValueError, "^loss_scale_factor: only used"),
        (lambda: L.cispo_loss(lp, old, adv, mask, eps_high=None), ValueError, "^eps_high: expected"),
        (lambda: f(lp.to("meta"), old, adv, mask), ValueError, "device"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()


def test_combine_rejects_local_or_mixed_denominators():
    lp, old, adv, mask, _ = make_batch(6, 8, "float32", seed=5)
    a = L.ppo_clip_loss(lp[:3], old[:3], adv[:3], mask[:3])
    b = L.ppo_clip_loss(lp[3:], old[3:], adv[3:], mask[3:])
    with pytest.raises(ValueError, match=r"^parts\[1\]: denominator|^parts\[0\]: computed its own"):
        L.combine_microbatch_losses([a, b])
    den = L.loss_denominator(mask)
    a = L.ppo_clip_loss(lp[:3], old[:3], adv[:3], mask[:3], denominator=den)
    c = L.grpo_loss(lp[3:], old[3:], adv[3:], mask[3:], denominator=den)
    with pytest.raises(ValueError, match=r"^parts\[1\]: policy/seq-mean-token-mean differs"):
        L.combine_microbatch_losses([a, c])
    with pytest.raises(ValueError, match="^parts: expected at least one"):
        L.combine_microbatch_losses([])
    single = L.ppo_clip_loss(lp, old, adv, mask)
    assert same_bits(L.combine_microbatch_losses([single]).loss, single.loss)
