"""loss.advantages (GRPO ± std, RLOO, REINFORCE++-baseline): accuracy vs float64 formulas,
invariance to batch permutation, group relabelling and token layout on raw bits, with a
negative control; singleton groups, empty batches and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import loss as L
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.microbatch import LAYOUTS, relayout
from tests.helpers.threads import threads
from tests.ops.loss.helpers import DTYPES, f64_group_adv

OP = "loss.advantages"
ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce_pp_baseline")


def _adv(estimator, scores, gids, mask):
    if estimator == "grpo":
        return L.grpo_advantages(scores, gids, mask)
    if estimator == "grpo_no_std":
        return L.grpo_advantages(scores, gids, mask, norm_by_std=False)
    if estimator == "rloo":
        return L.rloo_advantages(scores, gids, mask)
    return L.reinforce_pp_baseline_advantages(scores, gids, mask)


def _f64(estimator, scores, gids, mask):
    if estimator == "reinforce_pp_baseline":
        a = f64_group_adv(scores, gids, "grpo_no_std", 0.0)
        x = a[:, None].expand(mask.shape)[mask]
        if x.numel() == 0:
            return torch.zeros(mask.shape, dtype=torch.float64)
        var = x.var() if x.numel() > 1 else torch.zeros((), dtype=torch.float64)
        return torch.where(mask, (a[:, None] - x.mean()) / torch.sqrt(var + 1e-8), torch.zeros((), dtype=torch.float64))
    a = f64_group_adv(scores, gids, estimator, 1e-6)
    return torch.where(mask, a[:, None], torch.zeros((), dtype=torch.float64))


@st.composite
def batches(draw, dtype, estimator):
    groups = draw(st.integers(1, 5))
    sizes = [draw(st.integers(2 if estimator == "rloo" else 1, 6)) for _ in range(groups)]
    ids = torch.tensor([draw(st.integers(-50, 50)) for _ in range(groups)])
    ids = torch.unique(ids) if ids.unique().numel() == groups else torch.arange(groups) * 7 - 3
    gids = torch.cat([torch.full((n,), int(i)) for n, i in zip(sizes, ids)])
    B = gids.numel()
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if draw(st.booleans()):
        scores = (torch.rand(B, generator=g) < 0.5).float()  # 0/1 outcome rewards
    else:
        scores = torch.randn(B, generator=g) * draw(st.sampled_from([0.01, 1.0, 30.0]))
    T = draw(st.integers(1, 30))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if draw(st.booleans()):  # holes
        mask &= torch.rand(B, T, generator=g) < 0.8
    perm = torch.tensor(draw(st.permutations(range(B))))
    return scores.to(getattr(torch, dtype)), gids, mask, perm


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), estimator=st.sampled_from(ESTIMATORS), layout=st.sampled_from(LAYOUTS))
def test_permutation_relabel_layout_invariance(dtype, data, estimator, layout):
    with threads(1):  # tiny calls; thread-count independence is tested in test_loss_determinism_gpu.py
        scores, gids, mask, perm = data.draw(batches(dtype, estimator))
        full = _adv(estimator, scores, gids, mask)
        # batch permutation
        assert same_bits(_adv(estimator, scores[perm], gids[perm], mask[perm]), full[perm])
        # group relabelling (ids only name groups)
        assert same_bits(_adv(estimator, scores, gids * 3 + 1000, mask), full)
        # token layout: trim / extend / left padding / holes change no active token's bits
        if layout is not None:
            (new_mask,), back = relayout([mask], 0, layout)
            out = back(_adv(estimator, scores, gids, new_mask))
            assert same_bits(out, full)
        # run to run
        assert same_bits(_adv(estimator, scores, gids, mask), full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accuracy_vs_float64(dtype, estimator, seed):
    g = torch.Generator().manual_seed(seed)
    gids = torch.tensor([3, 3, 3, 3, 9, 9, 1, 1, 1, 1, 1, 1, 5, 5])
    if estimator != "rloo":
        gids = torch.cat([gids, torch.tensor([42])])  # a singleton group
    B = gids.numel()
    scores = (torch.randn(B, generator=g) * 2).to(getattr(torch, dtype))
    mask = torch.rand(B, 23, generator=g) < 0.7
    got = _adv(estimator, scores, gids, mask)
    want = _f64(estimator, scores, gids, mask)
    tol = contracts.tolerance(OP, getattr(torch, dtype), "forward")
    assert got.dtype == torch.float32 and got.shape == mask.shape
    assert tol.check(got, want), tol.max_violation(got, want)
    assert torch.all(got[~mask] == 0) and not torch.any(got[~mask].signbit())


def test_singleton_and_flat_groups_give_zero():
    scores = torch.tensor([5.0, 1.0, 1.0, 1.0, 2.0, 4.0])
    gids = torch.tensor([0, 1, 1, 1, 2, 2])
    mask = torch.ones(6, 3, dtype=torch.bool)
    for est in ("grpo", "grpo_no_std"):
        a = _adv(est, scores, gids, mask)[:, 0]
        assert a[0].item() == 0.0 and torch.all(a[1:4] == 0)
        assert a[4].item() < 0 < a[5].item()
    a = L.rloo_advantages(scores[4:], gids[4:], mask[4:])[:, 0]
    assert a.tolist() == [-2.0, 2.0]  # s_i minus the other sample's score
    r = L.reinforce_pp_baseline_advantages(scores, gids, mask)
    assert r[0, 0].item() == r[1, 0].item()  # singleton and flat group both have a = 0


def test_negative_control_batch_order_group_mean_is_caught():
    """Group means accumulated in batch order (``index_add_``) change bits under a permutation."""
    g = torch.Generator().manual_seed(0)
    B = 64
    scores = torch.randn(B, generator=g) * 3
    gids = torch.arange(B) % 4
    mask = torch.ones(B, 2, dtype=torch.bool)

    def naive(s, ids):
        sums = torch.zeros(4).index_add_(0, ids, s)
        return s - (sums / torch.bincount(ids, minlength=4).float())[ids]

    caught = False
    for seed in range(8):  # several permutations: robust to the CPU's reduction kernel
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
        caught |= not same_bits(naive(scores[perm], gids[perm]), naive(scores, gids)[perm]).equal
        ours = L.grpo_advantages(scores, gids, mask, norm_by_std=False)
        assert same_bits(L.grpo_advantages(scores[perm], gids[perm], mask, norm_by_std=False), ours[perm])
    assert caught


def test_empty_batch_and_no_active_tokens():
    e = L.grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool))
    assert e.shape == (0, 4)
    for est in ESTIMATORS:
        out = _adv(est, torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.zeros(2, 3, dtype=torch.bool))
        assert same_bits(out, torch.zeros(2, 3))


def test_bad_input_messages_name_the_argument():
    s, ids, m = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]), torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^group_ids: RLOO needs at least 2 samples per group; group\(s\) \[1\]"):
        L.rloo_advantages(s, ids, m)
    with pytest.raises(ValueError, match=r"^scores: expected shape \(3,\)"):
        L.grpo_advantages(s[:2].contiguous(), ids, m)
    with pytest.raises(ValueError, match=r"^group_ids: expected shape \(3,\)"):
        L.grpo_advantages(s, ids[:2].contiguous(), m)
    with pytest.raises(ValueError, match="^group_ids: expected dtype"):
        L.grpo_advantages(s, ids.float(), m)
    with pytest.raises(ValueError, match="^scores: contains NaN"):
        L.grpo_advantages(torch.tensor([1.0, float("nan"), 0.0]), ids, m)
    with pytest.raises(ValueError, match="^scores: expected 1 dimensions"):
        L.grpo_advantages(s[:, None], ids, m)
    with pytest.raises(ValueError, match="^eps: expected"):
        L.grpo_advantages(s, ids, m, eps=-1.0)
    with pytest.raises(ValueError, match="^norm_by_std: expected a bool"):
        L.grpo_advantages(s, ids, m, norm_by_std="yes")
    with pytest.raises(ValueError, match="^mask: expected 2 dimensions"):
        L.grpo_advantages(s, ids, m[0])


def test_reference_agrees_with_the_implementation():
    from rl_engine.runtime import implementations, reference_for

    g = torch.Generator().manual_seed(3)
    scores, gids = torch.randn(12, generator=g), torch.tensor([0, 0, 0, 4, 4, 7, 7, 7, 7, 9, 9, 9])
    mask = torch.rand(12, 10, generator=g) < 0.8
    tol = contracts.tolerance(OP, torch.float32, "forward")
    impl = implementations(OP)[0]
    for est, eps in (("grpo", 1e-6), ("grpo_no_std", 0.0), ("rloo", 0.0), ("reinforce_pp_baseline", 1e-8)):
        assert tol.check(impl.fn(scores, gids, mask, est, eps), reference_for(OP)(scores, gids, mask, est, eps)), est
