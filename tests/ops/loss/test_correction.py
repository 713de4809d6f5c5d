"""loss.rollout_correction: TIS weights, MIS/veto masks and mismatch metrics — accuracy vs
float64 formulas written here (verl's definitions), exact raw-bit ``mismatched_tokens``,
row / permutation / layout invariance on raw bits with a negative control, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import loss as L
from rl_engine.utils.bits import same_bits
from rl_engine.utils.checks import nan_policy
from rl_engine.validation.common import check_row_invariance
from rl_engine.validation.common.microbatch import LAYOUTS, relayout, same_bits_allow_nan
from tests.helpers.strategies import row_trials
from tests.helpers.threads import threads
from tests.ops.loss.helpers import DTYPES

OP = "loss.rollout_correction"


def _data(B, T, dtype, seed, p_equal=0.3, spread=0.2):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    train = (-torch.rand(B, T, generator=g) * 4).to(dt)
    rollout = (train.float() + torch.randn(B, T, generator=g) * spread).clamp(max=0.0).to(dt)  # log-probs are <= 0
    same = torch.rand(B, T, generator=g) < p_equal
    rollout = torch.where(same, train, rollout)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) < 0.9)
    return train, rollout, mask


@st.composite
def settings_(draw):
    kw = {"is_level": draw(st.sampled_from([None, "token", "sequence"])), "is_threshold": draw(st.sampled_from([1.5, 2.0, 5.0]))}
    rs = draw(st.sampled_from([None, "token", "sequence", "geometric"]))
    if rs is not None:
        kw.update(rs_level=rs, rs_threshold=draw(st.sampled_from([1.05, 1.5, 3.0])))
        if draw(st.booleans()):
            kw["rs_threshold_lower"] = draw(st.sampled_from([0.5, 0.9]))
    if draw(st.booleans()):
        kw["veto_threshold"] = draw(st.sampled_from([1e-4, 0.7]))
    return kw


def _same_metrics(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert same_bits_allow_nan(a[k], b[k]), f"{k}: {a[k]} vs {b[k]}"


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), B=st.integers(1, 10), T=st.integers(1, 50), seed=st.integers(0, 2**16),
       kw=settings_(), layout=st.sampled_from(LAYOUTS))
def test_row_permutation_layout_invariance(dtype, data, B, T, seed, kw, layout):
    with threads(1):  # tiny calls; thread-count independence is tested in test_loss_determinism_gpu.py
        train, rollout, mask = _data(B, T, dtype, seed)
        full = L.rollout_correction(train, rollout, mask, **kw)
        perm = torch.tensor(data.draw(st.permutations(range(B))))
        p = L.rollout_correction(train[perm], rollout[perm], mask[perm], **kw)
        _same_metrics(p.metrics, full.metrics)
        assert same_bits(p.mask, full.mask[perm])
        if full.is_weights is not None:
            assert same_bits(p.is_weights, full.is_weights[perm])
        # weights and corrected mask of a row depend only on that row
        fn = lambda a, b, m: (lambda r: (r.mask,) if r.is_weights is None else (r.is_weights, r.mask))(L.rollout_correction(a, b, m, **kw))  # noqa: E731
        rep = check_row_invariance(fn, [train, rollout, mask], data.draw(row_trials(B)))
        assert rep.ok, str(rep)
        if layout is not None:
            (t2, r2, m2), back = relayout([train, rollout, mask], 2, layout)
            q = L.rollout_correction(t2, r2, m2, **kw)
            _same_metrics(q.metrics, full.metrics)
            assert same_bits(back(q.mask), full.mask)
            if full.is_weights is not None:
                assert same_bits(back(q.is_weights), full.is_weights)


def _f64_metrics(train, rollout, mask, is_level, thr):
    lp, rl = train.double(), rollout.double()
    lr = lp - rl
    act = lr[mask]
    rho = torch.exp(lr)
    seq_sum = torch.where(mask, lr, 0.0).sum(-1)
    seqs = mask.any(-1)
    pd = (torch.exp(rl) - torch.exp(lp)).abs()[mask]
    out = {
        "kl": (-act).mean(),
        "k3_kl": (torch.exp(act) - act - 1).mean(),
        "chi2_token": (rho[mask] ** 2).mean() - 1,
        "chi2_seq": torch.exp(2 * seq_sum[seqs]).mean() - 1,
        "rollout_probs_diff_mean": pd.mean(),
        "rollout_probs_diff_max": pd.max(),
        "rollout_probs_diff_std": pd.std(),
    }
    w = rho if is_level == "token" else torch.exp(seq_sum)[:, None].expand(mask.shape)
    wa = w[mask]
    out["rollout_is_mean"] = wa.mean()
    out["rollout_is_max"] = wa.max()
    out["rollout_is_min"] = wa.min()
    wc = wa.clamp(1 / thr, thr)
    out["rollout_is_std"] = (wc.pow(2).mean() - wc.mean() ** 2).clamp(min=0).sqrt()
    out["rollout_is_eff_sample_size"] = 1 / ((wc / (wc.mean() + 1e-8)) ** 2).mean()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_metrics_accuracy_vs_float64(dtype, is_level, seed):
    train, rollout, mask = _data(12, 40, dtype, seed, spread=0.05)
    got = L.rollout_mismatch_metrics(train, rollout, mask, is_level=is_level, is_threshold=2.0)
    want = _f64_metrics(train, rollout, mask, is_level, 2.0)
    tol = contracts.tolerance(OP, getattr(torch, dtype), "forward")
    for k, v in want.items():
        assert got[k].dtype == torch.float32
        assert tol.check(got[k], v), (k, tol.max_violation(got[k], v))
    assert int(got["active_tokens"]) == int(mask.sum())
    assert int(got["mismatched_tokens"]) == int(((train != rollout) & mask).sum())


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_and_rejection_vs_float64(dtype):
    train, rollout, mask = _data(10, 30, dtype, 4, spread=0.1)
    lr = train.double() - rollout.double()
    seq = torch.where(mask, lr, 0.0).sum(-1)
    n = mask.sum(-1).clamp(min=1)
    tol = contracts.tolerance(OP, getattr(torch, dtype), "forward")
    tok = L.rollout_correction(train, rollout, mask, is_level="token", is_threshold=1.1)
    assert tol.check(tok.is_weights, torch.where(mask, torch.exp(lr).clamp(max=1.1), 0.0))
    sq = L.rollout_correction(train, rollout, mask, is_level="sequence", is_threshold=1.1)
    assert tol.check(sq.is_weights, torch.where(mask, torch.exp(seq).clamp(max=1.1)[:, None], 0.0))
    for level, v in (("token", torch.exp(lr)), ("sequence", torch.exp(seq)[:, None].expand(mask.shape)),
                     ("geometric", torch.exp(seq / n)[:, None].expand(mask.shape))):
        r = L.rollout_correction(train, rollout, mask, rs_level=level, rs_threshold=1.08, rs_threshold_lower=0.95)
        keep = (v >= 0.95) & (v <= 1.08)
        assert torch.equal(r.mask, mask & keep)  # (no ratio within an ulp of a threshold in this data)
        assert r.metrics["rollout_rs_masked_fraction"].item() == pytest.approx(float((mask & ~keep).sum() / mask.sum()))
    v = L.rollout_correction(train, rollout, mask, veto_threshold=0.9)
    vetoed = (mask & (lr < math.log(0.9))).any(-1)
    assert torch.equal(v.mask, mask & ~vetoed[:, None])
    assert v.metrics["rollout_is_veto_fraction"].item() == pytest.approx(float(vetoed.sum() / mask.any(-1).sum()))


def test_mismatched_tokens_counts_raw_bits():
    train = torch.tensor([[-1.0, -2.0, 0.0, -3.0, -4.0]])
    rollout = train.clone()
    mask = torch.tensor([[True, True, True, True, False]])
    m = L.rollout_mismatch_metrics(train, rollout, mask)
    assert m["mismatched_tokens"].item() == 0 and m["mismatched_tokens"].dtype == torch.int64
    assert m["kl"].item() == 0.0 and m["rollout_probs_diff_max"].item() == 0.0
    r = rollout.clone()
    r[0, 1] = torch.nextafter(r[0, 1], torch.tensor(0.0))  # one ulp
    r[0, 2] = -0.0  # same value, different bits
    r[0, 4] = 7.0  # inactive: not counted
    m = L.rollout_mismatch_metrics(train, r, mask)
    assert m["mismatched_tokens"].item() == 2
    assert m["mismatched_token_fraction"].item() == 0.5
    with nan_policy("propagate"):
        r[0, 0] = float("nan")
        assert L.rollout_mismatch_metrics(train, r, mask)["mismatched_tokens"].item() == 3


def test_negative_control_flattened_masked_mean_is_caught():
    """verl-style ``masked_mean`` (``torch.sum`` over the flattened batch) changes bits under a
    permutation of the batch; the same metric from rollout_correction does not."""
    train, rollout, mask = _data(64, 200, "float32", 0, p_equal=0.0)

    def naive_kl(t, r, m):
        return torch.sum((r - t) * m) / m.sum()

    caught = False
    base = L.rollout_mismatch_metrics(train, rollout, mask)
    for seed in range(8):  # several permutations: robust to the CPU's reduction kernel
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
        caught |= not same_bits(naive_kl(train[perm], rollout[perm], mask[perm]), naive_kl(train, rollout, mask)).equal
        _same_metrics(L.rollout_mismatch_metrics(train[perm], rollout[perm], mask[perm]), base)
    assert caught


def test_zero_active_tokens():
    train, rollout, mask = _data(3, 5, "float32", 0)
    r = L.rollout_correction(train, rollout, torch.zeros_like(mask), is_level="token", rs_level="token", rs_threshold=2.0, veto_threshold=0.5)
    assert same_bits(r.is_weights, torch.zeros(3, 5)) and not r.mask.any()
    assert r.metrics["active_tokens"].item() == 0 and r.metrics["mismatched_tokens"].item() == 0
    assert math.isnan(r.metrics["kl"].item()) and math.isnan(r.metrics["rollout_is_eff_sample_size"].item())
    e = L.rollout_mismatch_metrics(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))
    assert e["active_tokens"].item() == 0 and math.isnan(e["rollout_is_max"].item())


def test_bad_input_messages_name_the_argument():
    t, r, m = _data(3, 6, "float32", 0)
    f = L.rollout_correction
    cases = [
        (lambda: f(t, r.bfloat16(), m), "^rollout_log_probs: expected dtype torch.float32"),
        (lambda: f(t, r[:, :5].contiguous(), m), "^rollout_log_probs: expected shape"),
        (lambda: f(t, r, m, is_level="seq"), "^is_level: expected one of"),
        (lambda: f(t, r, m, rs_level="token"), "^rs_threshold: required"),
        (lambda: f(t, r, m, rs_threshold=2.0), "^rs_threshold: only used"),
        (lambda: f(t, r, m, rs_level="token", rs_threshold=2.0, rs_threshold_lower=3.0), "^rs_threshold_lower: expected <="),
        (lambda: f(t, r, m, is_threshold=0.0), "^is_threshold: expected"),
        (lambda: f(t, r, m, veto_threshold=-1.0), "^veto_threshold: expected"),
        (lambda: f(t, r, m, rs_level="geometric", rs_threshold=float("nan")), "^rs_threshold: expected a finite"),
        (lambda: L.rollout_mismatch_metrics(t, r, m, is_level=None), "^is_level: expected one of"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


def test_reference_agrees_with_the_implementation():
    from rl_engine.runtime import implementations, reference_for

    t, r, m = _data(9, 33, "float32", 6, spread=0.05)
    tol = contracts.tolerance(OP, torch.float32, "forward")
    impl = implementations(OP)[0]
    for args in ((t, r, m, "token", 2.0, "token", 1.05, None, 0.5), (t, r, m, "sequence", 3.0, "geometric", 1.02, 0.99, None),
                 (t, r, m, None, 2.0, "sequence", 1.5, None, None)):
        w, mask, metrics = impl.fn(*args)
        w_ref, mask_ref, metrics_ref = reference_for(OP)(*args)
        assert (w is None) == (w_ref is None) and (w is None or tol.check(w, w_ref))
        assert torch.equal(mask, mask_ref)
        assert metrics.keys() == metrics_ref.keys()
        for k, v in metrics.items():
            assert tol.check(v, metrics_ref[k]), k
