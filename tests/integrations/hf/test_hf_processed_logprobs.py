"""HF ``generate`` with top-k / top-p as rl_engine's canonical filter (``KeptSetRecorder``): the
rollout's processed log-probs and the training forward's replay with the same records are
raw-bit equal, fp32 and bf16; scored over the whole vocabulary the filtered tokens differ (the
negative control); every sampled token lies in its recorded kept set."""

from __future__ import annotations

import pytest
import torch

from rl_engine.integrations.hf.install import install
from rl_engine.integrations.hf.rollout import KeptSetRecorder, generate_with_logprobs
from rl_engine.integrations.hf.train import train_token_logprobs
from rl_engine.ops.logprob import scale_logits
from rl_engine.utils.bits import same_bits
from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.int64)
    mask = torch.zeros(len(lengths), P, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, P - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, P - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def model():
    m = build_hf_model(TINY_CONFIGS["h16-gqa2-tied-2l"])
    m.generation_config.pad_token_id = 0
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,top_p", [(8, 1.0), (0, 0.7), (40, 0.9)])
def test_generate_processed_logprobs_replayed_by_the_training_forward(model, dtype, top_k, top_p):
    m = model.to(dtype)
    ids, mask = _prompts(m.config.vocab_size, [5, 9, 3])
    with install(m):
        r = generate_with_logprobs(m, ids, mask, max_new_tokens=7, do_sample=True, temperature=0.8, seed=3,
                                   top_k=top_k, top_p=top_p)
        with torch.no_grad():
            processed = train_token_logprobs(m, r.sequences, r.attention_mask, r.prompt_len, temperature=0.8, kept=r.kept)
            full = train_token_logprobs(m, r.sequences, r.attention_mask, r.prompt_len, temperature=0.8)
            logits = m(input_ids=r.sequences, attention_mask=r.attention_mask).logits[:, r.prompt_len - 1 : -1]
    assert r.kept.shape == r.logprobs.shape == (3, 7)
    assert not bool(r.kept.keeps_everything().any())
    assert same_bits(r.logprobs, processed), same_bits(r.logprobs, processed)
    new = r.sequences[:, r.prompt_len:]
    keep = r.kept.mask(scale_logits(logits.float(), 0.8))
    assert bool(keep.gather(2, new[..., None]).all()), "a sampled token outside its kept set"
    assert not bool((full == processed).any()), "the full-vocabulary log-probs must differ on filtered steps"


def test_no_filter_and_greedy_give_the_full_bits(model):
    m = model.float()
    ids, mask = _prompts(m.config.vocab_size, [4, 6])
    with install(m):
        for do_sample in (True, False):
            r = generate_with_logprobs(m, ids, mask, max_new_tokens=5, do_sample=do_sample, temperature=0.7, seed=1)
            assert bool(r.kept.keeps_everything().all())
            with torch.no_grad():
                t = train_token_logprobs(m, r.sequences, r.attention_mask, r.prompt_len,
                                         temperature=0.7 if do_sample else 1.0)
            assert same_bits(r.logprobs, t)


def test_recorder_rejects_greedy_temperature():
    with pytest.raises(ValueError, match="^temperature: expected > 0"):
        KeptSetRecorder(0.0)


def test_recorder_without_filters_keeps_everything_without_reading_the_logits(monkeypatch):
    """Without top-k / top-p the kept set is the whole vocabulary whatever the logits: the
    recorder returns the scaled logits and keep-all records without ``canonical_prefix`` (which
    sorts ``[B, V]`` on the host every step), with the same bits as that path. The control: a
    filtering recorder still calls it."""
    import rl_engine.integrations.hf.rollout as rollout

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 50, generator=g)
    calls = []
    real = rollout.canonical_prefix
    monkeypatch.setattr(rollout, "canonical_prefix", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    for top_k in (0, 50, 80):
        rec = KeptSetRecorder(0.7, top_k=top_k)
        z = rec(None, scores)
        want = real(rollout.scale_logits(scores, 0.7), 0, 1.0).kept
        assert same_bits(z, rollout.scale_logits(scores, 0.7))
        assert same_bits(rec.steps[0].threshold, want.threshold) and same_bits(rec.steps[0].boundary, want.boundary)
    assert calls == []
    KeptSetRecorder(0.7, top_p=0.9)(None, scores)
    assert calls == [1]
    with pytest.raises(ValueError, match="^top_p: expected a value in"):
        KeptSetRecorder(0.7, top_p=1.5)
