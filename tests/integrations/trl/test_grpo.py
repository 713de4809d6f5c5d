"""TRL GRPOTrainer on CPU with rl_engine attached: rollout (``generate``) log-probs and the
trainer's recomputed log-probs are raw-bit equal at every step; rl_engine's losses serve as the
trainer's loss. Runs the documented example (examples/post_training/grpo_trl_cpu.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rl_engine import contracts
from rl_engine.integrations.hf.install import is_installed
from rl_engine.integrations import trl as rlk_trl

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "post_training" / "grpo_trl_cpu.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("grpo_trl_cpu", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_grpo_steps_zero_mismatches(example, tmp_path, dtype):
    res = example.run(steps=3, dtype=dtype, output_dir=str(tmp_path))
    hist = res["history"]
    assert [h["step"] for h in hist] == [1, 2, 3]
    for h in hist:
        assert h["compared"] > 0 and h["unmatched_rows"] == 0, h
        assert h["mismatched"] == 0, h
    assert sum("loss" in r for r in res["log"]) == 3
    assert any("rlk/ratio_mean" in r for r in res["log"])  # the loss came from rl_engine.ops.loss


def test_negative_control_plain_trl_mismatches(example, tmp_path):
    """Plain TRL + transformers through the same monitor: the checker finds mismatching tokens."""
    res = example.run(steps=1, dtype="float32", native=True, output_dir=str(tmp_path))
    assert all(h["compared"] > 0 for h in res["history"])
    assert sum(h["mismatched"] for h in res["history"]) > 0


def _trainer(example, tmp_path, loss_type):
    from datasets import Dataset
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to="none", save_strategy="no", loss_type=loss_type)
    return rlk_trl.RLKGRPOTrainer(model=example.build_model(torch.float32), reward_funcs=example.reward_many_small_ids,
                                  args=args, train_dataset=Dataset.from_dict({"prompt": ["w5 w6", "w7"] * 4}),
                                  processing_class=example.build_tokenizer())


@pytest.mark.parametrize("loss_type,beta", [("grpo", 0.0), ("dapo", 0.0), ("dr_grpo", 0.0), ("grpo", 0.04)])
def test_rl_engine_loss_serves_as_trainer_loss(example, tmp_path, loss_type, beta):
    """``RLKGRPOTrainer._compute_loss`` (rl_engine.ops.loss) equals TRL's own loss and gradient on
    the same batch, off-policy (ratios != 1, some clipped), within the loss contract's tolerance."""
    from trl import GRPOTrainer

    trainer = _trainer(example, tmp_path, loss_type)
    trainer.beta = beta  # the KL term reads only inputs["ref_per_token_logps"] (no reference model built here)
    trainer.args.use_bias_correction_kl = False  # TRL's default weights the KL by the ratio; ours is the plain k3
    att = rlk_trl.attach(trainer)
    try:
        g = torch.Generator().manual_seed(0)
        B, P, C = 4, 3, 8
        cmask = torch.ones(B, C, dtype=torch.int64)
        cmask[1, 5:] = 0
        cmask[3, 2:] = 0
        pmask = torch.ones(B, P, dtype=torch.int64)
        pmask[2, 0] = 0
        inputs = {"prompt_ids": torch.randint(2, 512, (B, P), generator=g) * pmask, "prompt_mask": pmask,
                  "completion_ids": torch.randint(2, 512, (B, C), generator=g) * cmask, "completion_mask": cmask,
                  "advantages": torch.randn(B, generator=g), "num_items_in_batch": cmask.sum().float()}
        with torch.no_grad():
            lp, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([pmask, cmask], 1), C)
        inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(B, C, generator=g)
        if beta:
            inputs["ref_per_token_logps"] = lp + 0.1 * torch.randn(B, C, generator=g)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() for each accumulation window
        results = []
        for fn in (rlk_trl.RLKGRPOTrainer._compute_loss, GRPOTrainer._compute_loss):
            trainer.model.zero_grad(set_to_none=True)
            loss = fn(trainer, trainer.model, inputs)
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
        tol = contracts.tolerance("loss.policy", torch.float32, "forward")
        assert tol.check(results[0][0], results[1][0].double()), (loss_type, results[0][0], results[1][0])
        assert float(results[0][0]) != 0.0
        tol_b = contracts.tolerance("loss.policy", torch.float32, "backward")
        for n, g0 in results[0][1].items():
            assert tol_b.check(g0, results[1][1][n].double()), n
    finally:
        att.detach()


def test_attach_detach_and_unsupported_options(example, tmp_path):
    trainer = _trainer(example, tmp_path, "dapo")
    fused = trainer.model.__dict__["forward"]  # TRL's fused LM head on the instance
    att = rlk_trl.attach(trainer)
    assert is_installed(trainer.model) and trainer.model.__dict__["forward"] is not fused
    att.detach()
    assert not is_installed(trainer.model) and trainer.model.__dict__["forward"] is fused
    with pytest.raises(TypeError, match="trainer: expected a TRL"):
        rlk_trl.attach(object())
    from datasets import Dataset
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to="none", loss_type="sapo")
    with pytest.raises(ValueError, match="loss_type='sapo'"):
        rlk_trl.RLKGRPOTrainer(model=example.build_model(torch.float32), reward_funcs=example.reward_many_small_ids,
                               args=args, train_dataset=Dataset.from_dict({"prompt": ["w5"] * 4}),
                               processing_class=example.build_tokenizer())


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (0, 0.8), (50, 0.9)])
def test_top_k_top_p_processed_logprobs_zero_mismatches(example, tmp_path, top_k, top_p):
    """TRL samples with top-k / top-p (rl_engine's canonical filter in generate); the trainer's
    fused LM head replays each token's kept set: the rollout's processed log-probs and the
    trainer's are raw-bit equal at every step."""
    res = example.run(steps=2, dtype="float32", output_dir=str(tmp_path), top_k=top_k, top_p=top_p)
    for h in res["history"]:
        assert h["compared"] > 0 and h["unmatched_rows"] == 0 and h["mismatched"] == 0, h


def test_full_vocabulary_trainer_under_top_p_is_the_negative_control(example, tmp_path):
    """The same sampling, the trainer scoring the whole vocabulary: the filtered tokens differ."""
    res = example.run(steps=1, dtype="float32", output_dir=str(tmp_path), top_p=0.8, logprobs="full")
    assert all(h["compared"] > 0 for h in res["history"])
    assert sum(h["mismatched"] for h in res["history"]) > 0


def test_attach_rejects_unreplayed_options_and_bad_mode(example, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to="none", save_strategy="no",
                      repetition_penalty=1.2)
    trainer = GRPOTrainer(model=example.build_model(torch.float32), reward_funcs=example.reward_many_small_ids, args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["w5 w6"] * 4}), processing_class=example.build_tokenizer())
    with pytest.raises(ValueError, match="^args.repetition_penalty: 1.2 changes the sampling distribution"):
        rlk_trl.attach(trainer)
    with pytest.raises(ValueError, match="^logprobs: expected 'processed' or 'full'"):
        rlk_trl.attach(trainer, logprobs="raw")
    att = rlk_trl.attach(trainer, logprobs="full")  # nothing replayed: allowed
    assert is_installed(trainer.model)
    att.detach()
    assert "generate" not in trainer.model.__dict__ and not is_installed(trainer.model)
