"""Losses and rollout correction on processed log-probs (top-k / top-p replay): the rollout's
processed log-probs and the trainer's replay are the same bits, so ``mismatched_tokens`` is 0,
every IS weight is exactly 1 and the KL metrics are 0; the full-vocabulary trainer values (the
negative control) mismatch on every filtered token with the metrics of verl's formulas
unchanged. A processed log-prob can be exactly 0 (a kept set of one token): a log-prob the
losses accept."""

from __future__ import annotations

import torch

from rl_engine.ops import gemm, logprob
from rl_engine.ops import loss as L
from rl_engine.ops.logprob import kept_set, scale_logits
from rl_engine.utils.bits import same_bits

B, T, H, V, TEMP = 6, 9, 32, 1500, 0.8


def _rollout_and_train(top_k, top_p, seed=0):
    """A rollout's processed log-probs ``[B, T]`` (unfused: ``linear`` + ``token_logprobs``),
    the trainer's processed and full log-probs (fused LM head), and the records."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (3.0 / H**0.5)
    logits = gemm.linear(hidden, weight)
    kept = kept_set(logits, TEMP, top_k, top_p)
    keep = kept.mask(scale_logits(logits, TEMP)).reshape(B * T, V)
    tokens = torch.multinomial(keep.float(), 1, generator=g).reshape(B, T)
    rollout = logprob.token_logprobs(logits, tokens, TEMP, kept=kept)
    train = logprob.linear_token_logprobs(hidden, weight, tokens, TEMP, kept=kept, token_chunk=7, vocab_chunk=1024)
    full = logprob.linear_token_logprobs(hidden, weight, tokens, TEMP)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 6:] = False
    return rollout, train, full, mask, kept


def test_processed_replay_has_no_mismatch_and_unit_weights():
    rollout, train, _, mask, kept = _rollout_and_train(40, 0.9)
    assert not bool(kept.keeps_everything().any())
    assert same_bits(train, rollout)
    res = L.rollout_correction(train, rollout, mask, is_level="token", rs_level="token", rs_threshold=2.0)
    m = res.metrics
    assert int(m["mismatched_tokens"]) == 0 and float(m["kl"]) == 0.0 and float(m["k3_kl"]) == 0.0
    assert bool((res.is_weights[mask] == 1.0).all()) and torch.equal(res.mask, mask)
    seq = L.rollout_correction(train, rollout, mask, is_level="sequence")
    assert bool((seq.is_weights[mask] == 1.0).all())


def test_full_vocabulary_trainer_is_the_negative_control_with_unchanged_metrics():
    rollout, _, full, mask, _ = _rollout_and_train(0, 0.7)
    m = L.rollout_correction(full, rollout, mask).metrics
    n = int(mask.sum())
    assert int(m["mismatched_tokens"]) == n  # every token was drawn from a filtered distribution
    d = (rollout.double() - full.double())[mask]
    assert bool((d > 0).all()), "renormalising over a strict subset raises the log-prob"
    assert abs(float(m["kl"]) - float(d.mean())) <= 1e-6 * max(1.0, float(d.abs().max()))
    rho = torch.exp(-d)
    assert abs(float(m["k3_kl"]) - float((rho - torch.log(rho) - 1).mean())) <= 1e-5


def test_policy_losses_take_processed_log_probs_including_exact_zero():
    """top-k = 1 keeps one token: its processed log-prob is +0 (a sure draw); a loss with the
    replayed values as both old and new log-probs has ratio exactly 1."""
    rollout, train, _, mask, kept = _rollout_and_train(1, 1.0, seed=1)
    assert bool((rollout == 0).all()) and not bool(torch.signbit(rollout).any())
    adv = torch.randn(B, T, generator=torch.Generator().manual_seed(2))
    rollout2, train2, _, _, _ = _rollout_and_train(30, 0.95, seed=3)
    for old, new in ((rollout, train), (rollout2, train2)):
        out = L.grpo_loss(new.clone().requires_grad_(), old, adv, mask)
        assert float(out.metrics["ratio_min"]) == float(out.metrics["ratio_max"]) == 1.0
        assert float(out.metrics["clip_frac"]) == 0.0
