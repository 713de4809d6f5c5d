"""Losses that take log-probs reject values that are no log-probability at an active token
(``+inf``, ``-inf``, ``> 0``) with an error naming the argument; padding is not read."""

from __future__ import annotations

import pytest
import torch

import rl_engine.ops.loss as L
from rl_engine.utils.checks import nan_policy


def _lp():
    return torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])


CALLS = {
    "ppo_clip_loss": (lambda a, b, m: L.ppo_clip_loss(a, b, torch.ones_like(a), m), ("log_probs", "old_log_probs")),
    "grpo_loss": (lambda a, b, m: L.grpo_loss(a, b, torch.ones_like(a), m), ("log_probs", "old_log_probs")),
    "dapo_loss": (lambda a, b, m: L.dapo_loss(a, b, torch.ones_like(a), m), ("log_probs", "old_log_probs")),
    "gspo_loss": (lambda a, b, m: L.gspo_loss(a, b, torch.ones_like(a), m), ("log_probs", "old_log_probs")),
    "cispo_loss": (lambda a, b, m: L.cispo_loss(a, b, torch.ones_like(a), m, eps_high=0.2), ("log_probs", "old_log_probs")),
    "dr_grpo_loss": (lambda a, b, m: L.dr_grpo_loss(a, b, torch.ones_like(a), m, loss_scale_factor=4.0),
                     ("log_probs", "old_log_probs")),
    "kl_penalty": (lambda a, b, m: L.kl_penalty(a, b, m), ("log_probs", "ref_log_probs")),
    "rollout_correction": (lambda a, b, m: L.rollout_correction(a, b, m), ("log_probs", "rollout_log_probs")),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("bad", [5.0, 1e-3, float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 1])
def test_a_value_that_is_no_log_prob_is_rejected(name, bad, position):
    fn, names = CALLS[name]
    mask = torch.ones(2, 3, dtype=torch.bool)
    args = [_lp(), _lp() - 0.05]
    args[position][1, 2] = bad
    with pytest.raises(ValueError, match=rf"^{names[position]}: expected log-probabilities \(finite and <= 0\).*\[1, 2\]"):
        fn(*args, mask)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_padding_is_not_read_and_valid_log_probs_pass(name):
    fn, _ = CALLS[name]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    a, b = _lp(), _lp() - 0.05
    a[0, 2] = 7.0  # padding: not an active token
    b[0, 2] = float("inf")
    out = fn(a, b, mask)
    values = [out.loss] if hasattr(out, "loss") else [out.metrics["kl"]]
    assert all(bool(torch.isfinite(v).all()) for v in values)


def test_propagate_policy_skips_the_scan():
    with nan_policy("propagate"):
        out = L.ppo_clip_loss(torch.full((1, 2), 5.0), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert out.loss.shape == ()
