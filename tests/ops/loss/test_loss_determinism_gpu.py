"""Loss family: bits independent of the intra-op thread count, profiler-visible op names, and
(on a GPU machine) the same invariances on CUDA tensors — the portable implementation is
registered for cuda/rocm as untested families; these tests are how it gets checked there."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops import loss as L
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.microbatch import same_bits_allow_nan, check_microbatch_invariance
from tests.helpers.determinism import thread_count_failures
from tests.helpers.threads import threads
from tests.ops.loss.helpers import make_batch


def _policy_fn(name):
    fn = {"ppo": lambda *a: L.ppo_clip_loss(*a, dual_clip=3.0), "gspo": L.gspo_loss,
          "cispo": lambda *a: L.cispo_loss(*a, eps_high=0.2), "grpo": L.grpo_loss}[name]

    def run(lp, old, adv, mask):
        out = fn(lp, old, adv, mask)
        return out.loss, out.seq_terms

    return run


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "grpo"])
def test_policy_bits_do_not_depend_on_thread_count(name):
    lp, old, adv, mask, _ = make_batch(64, 520, "float32", seed=1)  # 33280 elements: torch splits work
    run = _policy_fn(name)
    assert thread_count_failures(lambda x, m: run(x, old, adv, m), [lp, mask]) == []


def test_kl_aggregate_advantages_correction_bits_do_not_depend_on_thread_count():
    lp, ref, adv, mask, _ = make_batch(64, 520, "bfloat16", seed=2)
    assert thread_count_failures(lambda a, m: L.kl_penalty(a, ref, m).loss, [lp, mask]) == []
    assert thread_count_failures(lambda v, m: L.entropy_bonus(v, m, reduction="seq-mean-token-mean").seq_terms, [-lp, mask]) == []
    scores = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    gids = torch.arange(4096) // 8
    big_mask = torch.ones(4096, 16, dtype=torch.bool)
    results = []
    for n in (1, 2, 3):
        with threads(n):
            results.append((
                L.grpo_advantages(scores, gids, big_mask),
                L.reinforce_pp_baseline_advantages(scores, gids, big_mask),
                L.rollout_correction(lp, ref, mask, is_level="sequence", rs_level="geometric", rs_threshold=1.5),
            ))
    for other in results[1:]:
        assert same_bits(other[0], results[0][0]) and same_bits(other[1], results[0][1])
        assert same_bits(other[2].is_weights, results[0][2].is_weights) and same_bits(other[2].mask, results[0][2].mask)
        for k, v in results[0][2].metrics.items():
            assert same_bits_allow_nan(other[2].metrics[k], v), k


def test_custom_ops_are_profiled_under_the_rlk_namespace():
    from torch.profiler import ProfilerActivity, profile

    lp, old, adv, mask, _ = make_batch(4, 16, "float32", seed=3)
    x = lp.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        L.grpo_loss(x, old, adv, mask).loss.backward()
        L.kl_penalty(x, old, mask).loss.backward()
        L.entropy_bonus(-lp, mask)
    names = {e.name for e in prof.events()}
    assert {"rlk::loss_policy", "rlk::loss_policy_backward", "rlk::loss_kl", "rlk::loss_kl_backward", "rlk::loss_masked_row_sum"} <= names


# ---------------------------------------------------------------------------------------- GPU


def _cuda(*ts):
    return [t.cuda() for t in ts]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["ppo", "grpo", "gspo", "cispo"])
def test_gpu_microbatch_permutation_layout_invariance(dtype, name):
    lp, old, adv, mask, _ = _cuda(*make_batch(48, 700, dtype, seed=4))
    red = {"grpo": "seq-mean-token-mean", "gspo": "seq-mean-token-mean"}.get(name, "token-mean")
    den = L.loss_denominator(mask, red)
    fn = {"ppo": L.ppo_clip_loss, "grpo": L.grpo_loss, "gspo": L.gspo_loss,
          "cispo": lambda *a, **k: L.cispo_loss(*a, eps_high=0.2, **k)}[name]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(48, generator=g).tolist()
    splits = [[perm[:7], perm[7:30], perm[30:]], [list(range(48))]]
    for layout in (None, "right_align", "interleave"):
        rep = check_microbatch_invariance(
            lambda *a: fn(*a, denominator=den), [lp, old, adv, mask], splits, layout=layout, mask_arg=3,
            combine=L.combine_microbatch_losses, compare_of=lambda o: {"loss": o.loss, **o.metrics},
            loss_of=lambda o: o.loss, rows_of=lambda o: o.seq_terms,
        )
        assert rep.ok, str(rep)


@pytest.mark.gpu
def test_gpu_run_to_run_and_close_to_cpu():
    from rl_engine import contracts

    lp, old, adv, mask, w = make_batch(32, 900, "float32", seed=5)
    cpu = L.dapo_loss(lp, old, adv, mask, is_weights=w)
    outs = []
    for _ in range(3):
        x = lp.cuda().requires_grad_()
        out = L.dapo_loss(x, old.cuda(), adv.cuda(), mask.cuda(), is_weights=w.cuda())
        out.loss.backward()
        outs.append((out.loss, out.seq_terms, x.grad))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert same_bits(a, b)
    tol = contracts.tolerance("loss.policy", torch.float32, "forward")
    assert tol.check(outs[0][0].cpu(), cpu.loss) and tol.check(outs[0][1].cpu(), cpu.seq_terms)
    scores, gids = torch.randn(64), torch.arange(64) // 4
    m = torch.ones(64, 8, dtype=torch.bool)
    perm = torch.randperm(64)
    a = L.grpo_advantages(scores.cuda(), gids.cuda(), m.cuda())
    assert same_bits(L.grpo_advantages(scores[perm].cuda(), gids[perm].cuda(), m.cuda()), a[perm.cuda()])
    r, ro, mk = lp.cuda(), old.cuda(), mask.cuda()
    base = L.rollout_mismatch_metrics(r, ro, mk)
    p = torch.randperm(32).cuda()
    again = L.rollout_mismatch_metrics(r[p], ro[p], mk[p])
    for k, v in base.items():
        assert same_bits_allow_nan(again[k], v), k
