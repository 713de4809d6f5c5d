"""GRPO with TRL on CPU: a tiny Qwen3, HF ``generate`` as the rollout, rl_engine installed.

Run:  python examples/post_training/grpo_trl_cpu.py [--steps 3] [--dtype float32|bfloat16] [--native] [--trl-loss]
          [--top-k K] [--top-p P] [--logprobs processed|full] [--moe]

Prints, for every step, how many rollout log-probs (from ``generate``'s raw logits, renormalised
over each token's top-k / top-p kept set: the distribution it was drawn from) were compared with
the trainer's recomputed log-probs and how many differ in any bit. With rl_engine attached the
answer is 0; with ``--native`` (plain TRL + transformers) it is not; with ``--logprobs full`` and
a filter on (the trainer scores the whole vocabulary) every filtered token differs.
By default the loss is rl_engine's (``RLKGRPOTrainer``); ``--trl-loss`` uses TRL's own.
``--moe`` trains a tiny Qwen3-MoE (8 experts, 2 per token) instead of the dense Qwen3.
Everything is built locally (random weights, a word-level tokenizer): no hub access.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 512
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def build_tokenizer():
    """A word-level tokenizer over ``<pad> <eos> w2 .. w511`` (whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


#: The Qwen3-MoE variant (``--moe``): the same attention, every layer a sparse MoE block.
MOE_CONFIG = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def build_model(dtype: torch.dtype, seed: int = 0, moe: bool = False):
    """Tiny random Qwen3 or Qwen3-MoE (matrices ~N(0, 0.2) so the logits are a few units, not ~0)."""
    torch.manual_seed(seed)
    if moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG, **MOE_CONFIG, pad_token_id=0, eos_token_id=1,
                                                   bos_token_id=1))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or (moe and p.dim() == 3):  # Qwen3-MoE keeps its experts as [E, out, in]
                p.normal_(0.0, 0.2)
    return model.to(dtype)


def reward_many_small_ids(completions, **kwargs):
    """Toy reward: the fraction of completion words with an id below 64."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(1 for w in words if w.startswith("w") and int(w[1:]) < 64) / max(1, len(words)))
    return out


def run(steps: int = 3, dtype: str = "float32", native: bool = False, trl_loss: bool = False, seed: int = 0,
        output_dir: str | None = None, top_k: int = 0, top_p: float = 1.0, logprobs: str = "processed",
        moe: bool = False) -> dict:
    """Train ``steps`` GRPO steps; returns ``{"history": [...per-step parity...], "log": trainer logs}``.

    ``top_k`` / ``top_p``: TRL's sampling filters (rl_engine's canonical filter under
    :func:`~rl_engine.integrations.trl.attach`); ``logprobs``: what the attached trainer scores."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rl_engine.integrations import trl as rlk_trl

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tok = build_tokenizer()
    model = build_model(dt, seed, moe)
    g = torch.Generator().manual_seed(seed)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (int(n),), generator=g))
               for n in torch.randint(2, 9, (8,), generator=g)]
    out_dir = output_dir or tempfile.mkdtemp(prefix="rlk-grpo-")
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=steps, report_to="none", logging_steps=1,
                      save_strategy="no", seed=seed, loss_type="dapo", bf16=False, top_k=top_k, top_p=top_p)
    cls = GRPOTrainer if (native or trl_loss) else rlk_trl.RLKGRPOTrainer
    trainer = cls(model=model, reward_funcs=reward_many_small_ids, args=args,
                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    attachment = None if native else rlk_trl.attach(trainer, logprobs=logprobs)
    monitor = rlk_trl.LogprobParityMonitor(trainer)
    try:
        trainer.train()
    finally:
        monitor.close()
        if attachment is not None:
            attachment.detach()
    return {"history": monitor.history, "log": trainer.state.log_history}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--native", action="store_true", help="plain TRL + transformers (the negative control)")
    p.add_argument("--trl-loss", action="store_true", help="TRL's own loss instead of rl_engine.ops.loss")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling filter (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p sampling filter (1 = off)")
    p.add_argument("--logprobs", choices=["processed", "full"], default="processed",
                   help="what the trainer scores: renormalised over each token's kept set, or the whole vocabulary")
    p.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE instead of the dense Qwen3")
    a = p.parse_args()
    res = run(a.steps, a.dtype, a.native, a.trl_loss, top_k=a.top_k, top_p=a.top_p, logprobs=a.logprobs, moe=a.moe)
    for row in res["history"]:
        print(f"step {row['step']}: {row['compared']} tokens compared, {row['mismatched']} mismatched "
              f"(max |Δ| {row['max_abs_diff']:.3e})")
    losses = [r["loss"] for r in res["log"] if "loss" in r]
    print("losses:", losses)


if __name__ == "__main__":
    main()
