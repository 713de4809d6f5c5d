"""Alignment by (sample_id, position) and the raw-bit comparison report."""

from __future__ import annotations

import pytest
import torch

from rl_engine.engine.executor import RolloutSample, ScoredSequence
from rl_engine.validation.alignment import align, compare


def _rollout(sid, prompt, resp, lps):
    return RolloutSample(sid, tuple(prompt), list(resp), [torch.tensor(v, dtype=torch.float32) for v in lps])


def _scored(sid, lps, mask):
    return ScoredSequence(sid, torch.tensor(lps, dtype=torch.float32), torch.tensor(mask))


def test_equal_runs_pass_and_alignment_is_by_identity():
    ro = {7: _rollout(7, [1, 2], [3, 4], [-0.5, -1.25]), 2: _rollout(2, [9], [8], [-2.0])}
    tr = {2: _scored(2, [0.0, -2.0], [False, True]), 7: _scored(7, [0.0, -9.0, -0.5, -1.25], [False, False, True, True])}
    a = align(ro, tr)
    assert a.keys == [(2, 1), (7, 2), (7, 3)]
    c = compare(a)
    assert c.passed and c.compared_tokens == 3 and c.mismatched_tokens == 0 and c.first_mismatch is None
    assert c.k3_kl == 0.0 and c.mean_abs_prob_diff == 0.0


def test_one_ulp_and_signed_zero_are_mismatches():
    nxt = float(torch.nextafter(torch.tensor(-1.25), torch.tensor(0.0)))  # one fp32 ulp
    ro = {0: _rollout(0, [1], [3, 4, 5], [-0.5, -1.25, 0.0])}
    tr = {0: _scored(0, [0.0, -0.5, nxt, -0.0], [False, True, True, True])}
    c = compare(align(ro, tr))
    assert not c.passed and c.mismatched_tokens == 2
    assert (c.first_mismatch.sample_id, c.first_mismatch.position) == (0, 2)
    assert c.first_mismatch.rollout == -1.25 and c.first_mismatch.train != -1.25
    assert 0 < c.max_abs_diff < 1e-6 and c.k3_kl >= 0 and c.mean_abs_prob_diff > 0


def test_nothing_compared_does_not_pass():
    c = compare(align({0: _rollout(0, [1], [2], [-1.0])}, {0: _scored(0, [0.0, -1.0], [False, False])}))
    assert c.compared_tokens == 0 and not c.passed


def test_alignment_errors():
    with pytest.raises(ValueError, match="only one side"):
        align({0: _rollout(0, [1], [2], [-1.0])}, {1: _scored(1, [0.0, -1.0], [False, True])})
    with pytest.raises(ValueError, match="not a sampled token"):
        align({0: _rollout(0, [1, 2], [3], [-1.0])}, {0: _scored(0, [0.0, -1.0, -1.0], [False, True, True])})
