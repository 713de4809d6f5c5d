"""rl_engine installed into a transformers Qwen3: training forward vs ``generate`` raw-bit parity.

The rollout log-probs come from ``generate(output_logits=True)`` (KV cache, left-padded batch)
and the train log-probs from one teacher-forced forward of the same sequences; both use
``ops.logprob.token_logprobs`` on the fp32 logits. With the install they must be raw-bit equal
for every generated token; without it (HF's sdpa kernels) the same check must find mismatches.
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch

from rl_engine import contracts
from rl_engine.integrations.hf.install import ATTN_NAME, SUBSTITUTIONS, InstallConflict, install, is_installed
from rl_engine.integrations.hf.rollout import generate_with_logprobs
from rl_engine.integrations.hf.train import train_token_logprobs
from rl_engine.utils.bits import same_bits
from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model

CONFIGS = ["h16-gqa2-tied-2l", "h32-gqa6-untied-3l"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD = 0
#: (prompt lengths = batch size and left padding, sampling?, new tokens)
CASES = [([5], False, 6), ([3, 9, 1], True, 6), ([9, 4, 7, 2, 6], False, 6), ([20, 13, 30, 7], True, 16)]


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), PAD, dtype=torch.int64)
    mask = torch.zeros(len(lengths), P, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, P - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, P - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def models():
    out = {}
    for name in CONFIGS:
        base = build_hf_model(TINY_CONFIGS[name])
        base.generation_config.pad_token_id = PAD
        for dname, dt in DTYPES.items():
            out[name, dname] = copy.deepcopy(base).to(dt)
    return out


def _mismatches(model, lengths, *, do_sample, max_new_tokens=6, seed=0):
    ids, mask = _prompts(model.config.vocab_size, lengths, seed)
    T = 0.7 if do_sample else 1.0
    r = generate_with_logprobs(model, ids, mask, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=T, seed=seed)
    with torch.no_grad():
        t = train_token_logprobs(model, r.sequences, r.attention_mask, r.prompt_len, temperature=T)
    return r, t, same_bits(r.logprobs, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_generate_vs_train_raw_bit_equal(models, name, dtype):
    model = models[name, dtype]
    with install(model):
        for lengths, do_sample, n in CASES:
            r, t, d = _mismatches(model, lengths, do_sample=do_sample, max_new_tokens=n)
            assert r.logprobs.numel() == len(lengths) * n
            assert d.equal, f"{name} {dtype} B={len(lengths)} sample={do_sample}: {d}"
    assert not is_installed(model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rollout_logprobs_do_not_depend_on_the_batch(models, dtype):
    """The same prompt decoded alone and inside a padded batch gives the same bits (greedy)."""
    model = models[CONFIGS[0], dtype]
    with install(model):
        alone, _, _ = _mismatches(model, [5], do_sample=False, seed=1)
        batch, _, _ = _mismatches(model, [5, 11, 2], do_sample=False, seed=1)
    assert torch.equal(alone.sequences[0, -6:], batch.sequences[0, -6:])
    assert same_bits(alone.logprobs[0], batch.logprobs[0]).equal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_negative_control_without_install_mismatches(models, name, dtype):
    """The same check on the unpatched model (sdpa) finds mismatching tokens: the checker bites."""
    model = models[name, dtype]
    assert not is_installed(model)
    total = 0
    for lengths, do_sample, n in CASES:
        total += _mismatches(model, lengths, do_sample=do_sample, max_new_tokens=n)[2].mismatched
    assert total > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_accuracy_against_float64_transformers(models, name, dtype):
    """Patched padded-batch log-probs vs unpatched transformers in float64 on the same weights
    (rounded to ``dtype``), per row without padding; tolerance from the model contract."""
    model = models[name, dtype]
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation("eager")
    ids, mask = _prompts(model.config.vocab_size, [12, 5, 9], seed=4)
    tol = contracts.tolerance("models.qwen3", DTYPES[dtype], "forward")
    with install(model), torch.no_grad():
        lp = train_token_logprobs(model, ids, mask, 1)
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        row = ids[b, -n:][None]
        with torch.no_grad():
            z = ref(input_ids=row).logits[0, :-1]
        ref_lp = torch.log_softmax(z, -1).gather(-1, row[0, 1:, None])[:, 0]
        got = lp[b, -(n - 1):] if n > 1 else lp[b, :0]
        assert tol.check(got, ref_lp), f"{name} {dtype} row {b}: {tol.max_violation(got, ref_lp):.3e} ({tol.reason})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_forward_has_gradients_and_is_deterministic(models, dtype):
    model = models[CONFIGS[1], dtype]
    ids, mask = _prompts(model.config.vocab_size, [7, 3, 5], seed=5)
    grads = []
    with install(model):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            lp = train_token_logprobs(model, ids, mask, 1)
            (-(lp * mask[:, 1:]).sum()).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    assert set(grads[0]) == {n for n, _ in model.named_parameters()}
    for n, g in grads[0].items():
        assert torch.isfinite(g).all(), n
        assert same_bits(g, grads[1][n]).equal, n
    assert any(g.abs().sum() > 0 for n, g in grads[0].items() if "q_proj" in n)


def test_unapply_restores_exactly(models, caplog):
    model = models[CONFIGS[0], "float32"]
    ids, mask = _prompts(model.config.vocab_size, [6, 3], seed=6)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    impl = model.config._attn_implementation
    classes = {type(m).__name__ for m in model.modules()}
    with caplog.at_level(logging.INFO, logger="rl_engine.integrations.hf"):
        inst = install(model)
    n_targets = sum(type(m).__name__ in SUBSTITUTIONS for m in model.modules())
    assert len(inst.replaced) == n_targets > 0
    assert sum("replaced" in r.getMessage() for r in caplog.records) == n_targets  # one log line per replacement
    assert {c for _, c in inst.replaced} == set(SUBSTITUTIONS) & classes
    assert model.config._attn_implementation == ATTN_NAME and is_installed(model)
    assert inst.generation_cache and "_prepare_cache_for_generation" in model.__dict__
    with torch.no_grad():
        during = model(input_ids=ids, attention_mask=mask).logits
    inst.unapply()
    assert model.config._attn_implementation == impl and not is_installed(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert "_prepare_cache_for_generation" not in model.__dict__
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert same_bits(before, after).equal
    assert same_bits(before, during).mismatched > 0  # the install really changed the arithmetic
    inst.unapply()  # idempotent


def test_conflicts_are_detected(models):
    model = models[CONFIGS[0], "float32"]
    with install(model):
        with pytest.raises(InstallConflict, match="already installed"):
            install(model)
    # an instance-level patch from someone else
    norm = model.model.norm
    norm.forward = types.MethodType(lambda self, x: x, norm)
    try:
        with pytest.raises(InstallConflict, match="model.norm .*overridden on the instance"):
            install(model)
    finally:
        del norm.__dict__["forward"]
    assert not is_installed(model) and model.config._attn_implementation != ATTN_NAME
    # a global class patch (kernel-library style)
    cls = type(model.model.norm)
    original = cls.forward

    def patched(self, x):
        return original(self, x)

    cls.forward = patched
    try:
        with pytest.raises(InstallConflict, match="patched globally"):
            install(model)
    finally:
        cls.forward = original
    # the attention name taken by a foreign function
    from transformers import AttentionInterface

    saved = AttentionInterface._global_mapping.get(ATTN_NAME)
    AttentionInterface._global_mapping[ATTN_NAME] = lambda *a, **k: None
    try:
        with pytest.raises(InstallConflict, match="already registered"):
            install(model)
    finally:
        if saved is None:
            del AttentionInterface._global_mapping[ATTN_NAME]
        else:
            AttentionInterface._global_mapping[ATTN_NAME] = saved


def test_bad_arguments():
    with pytest.raises(TypeError, match="model: expected a transformers"):
        install(torch.nn.Linear(2, 2))
    m = build_hf_model(TINY_CONFIGS[CONFIGS[0]])
    ids, mask = _prompts(m.config.vocab_size, [3])
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        train_token_logprobs(m, ids, mask[:, :2], 1)
    with pytest.raises(ValueError, match="prompt_len"):
        train_token_logprobs(m, ids, mask, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_with_logprobs(m, ids, mask, max_new_tokens=0)


def test_key_validity_and_logical_positions():
    from rl_engine.integrations.hf.install import key_validity, logical_positions

    valid = torch.tensor([[False, False, True, True], [True, True, True, False]])
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    bool_mask = (causal[None] & valid[:, None, :])[:, None]  # what sdpa_mask builds: [B, 1, Lq, Lk]
    assert torch.equal(key_validity(bool_mask, 2, 4, "cpu"), valid)
    additive = torch.where(bool_mask, 0.0, float("-inf"))
    assert torch.equal(key_validity(additive, 2, 4, "cpu"), valid)
    assert key_validity(None, 2, 3, "cpu").all()
    assert logical_positions(valid).tolist() == [[0, 0, 0, 1], [0, 1, 2, 2]]
    with pytest.raises(ValueError, match="attention_mask: expected .*static/sliding caches"):
        key_validity(bool_mask, 2, 6, "cpu")
