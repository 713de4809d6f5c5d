"""GRPO with TRL and vLLM colocated on CPU, rl_engine on both sides: TRL's own
``sampling/sampling_logp_difference/max`` is exactly 0 at every step.

Run (in the vLLM environment, see docs/integrations/trl.md):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python examples/post_training/grpo_trl_vllm_colocate_cpu.py
        [--steps 3] [--temperature 1.0] [--top-k 0] [--top-p 1.0] [--logprobs processed|full] [--native] [--json]

TRL's ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` builds a vLLM ``LLM`` in the
trainer's process, samples the completions with it (``logprobs_mode="processed_logprobs"``:
the sampled token's ``log softmax(z / T)``), pushes the trainer's weights into it before each
generation (``load_weights``), recomputes every completion token's log-prob with the training
model and logs ``max |logp_train - logp_vllm|`` over the completion tokens as
``sampling/sampling_logp_difference/max``. With :func:`rl_engine.integrations.trl.
vllm_colocate` the vLLM model runs rl_engine operators (the vLLM plugin) and the trainer's
forward runs them too (the HF install and our log-prob head), so that metric is 0.0.

``--top-k`` / ``--top-p``: TRL's sampling filters. Under the plugin vLLM's sampler runs
rl_engine's canonical filter and its processed log-prob is renormalised over each token's kept
set; the kept-set records travel to the trainer (``colocate.attach(trainer, logprobs=...)``),
whose log-prob head replays them (``processed``: the metric stays 0.0) or scores the whole
vocabulary (``full``: the filter's bias, a positive metric — the negative control).

``--native`` is the negative control: plain vLLM and plain TRL. Stock vLLM-CPU cannot take
TRL's weight sync at all (it replaces linear weights by prepacked handles:
``'Parameter' object has no attribute 'weight_loader'``), so this mode applies the known
work-around (keep plain weights, ``F.linear``) — only here, never on the rl_engine path, where
the plugin keeps the weights and their loaders itself — and builds the engine eagerly, as the
rl_engine run does.

The model is a tiny random Qwen3 (head_dim 32: vLLM's CPU attention needs >= 32) saved in
bf16 with a word-level tokenizer — no hub access. bf16 because TRL builds the ``LLM`` with
``dtype="auto"`` and vLLM runs a float32 checkpoint in bf16 on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU takes ~10 GiB by default

import torch  # noqa: E402

VOCAB = 512
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
METRIC = "sampling/sampling_logp_difference/max"


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


def build_checkpoint(directory: str, seed: int = 0) -> str:
    """Save a tiny random bf16 Qwen3 (weights ~N(0, 0.2): logits of a few units) and the
    tokenizer to ``directory``; returns it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def reward_many_small_ids(completions, **kwargs):
    """Toy reward: the fraction of completion words with an id below 64."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(1 for w in words if w.startswith("w") and int(w[1:]) < 64) / max(1, len(words)))
    return out


def _plain_vllm_cpu_weights():
    """The negative control's set-up: stock vLLM-CPU keeps plain linear weights (``F.linear``)
    so that TRL's weight sync can run at all, and TRL's ``LLM`` is eager like the rl_engine run
    (which needs it), so the two runs differ only in the operators."""
    import trl.generation.vllm_generation as trl_vllm
    import vllm.model_executor.layers.utils as U

    def plain(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    U.dispatch_cpu_unquantized_gemm = plain
    llm = trl_vllm.LLM
    trl_vllm.LLM = lambda *a, **kw: llm(*a, **{**kw, "enforce_eager": True})


def run(steps: int = 3, native: bool = False, seed: int = 0, output_dir: str | None = None,
        strict: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
        logprobs: str = "processed") -> dict:
    """Train ``steps`` GRPO steps with vLLM colocated; returns ``{"metric": [per-step
    sampling_logp_difference/max], "log": trainer logs, "provenance": vLLM-side operator
    counts or None}``."""
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rl_engine.integrations import trl as rlk_trl

    out_dir = output_dir or tempfile.mkdtemp(prefix="rlk-grpo-vllm-")
    ckpt = build_checkpoint(os.path.join(out_dir, "model"), seed)
    model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)  # name_or_path = ckpt: TRL's LLM loads it
    tok = AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    g = torch.Generator().manual_seed(seed)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (int(n),), generator=g))
               for n in torch.randint(2, 9, (8,), generator=g)]
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=steps, report_to="none", logging_steps=1, save_strategy="no",
                      seed=seed, bf16=False, temperature=temperature, top_k=top_k, top_p=top_p,
                      use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=64, vllm_enable_sleep_mode=False)
    kwargs = dict(model=model, reward_funcs=reward_many_small_ids, args=args,
                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    if native:
        _plain_vllm_cpu_weights()
        trainer = GRPOTrainer(**kwargs)
        trainer.train()
        provenance = None
    else:
        with rlk_trl.vllm_colocate(strict=strict) as colocate:
            trainer = GRPOTrainer(**kwargs)  # builds its LLM: the plugin is on
            colocate.attach(trainer, logprobs=logprobs)  # the trainer's forward: HF install + our log-prob head
            trainer.train()
            provenance = colocate.assert_no_fallbacks() if strict else colocate.provenance()
    log = trainer.state.log_history
    return {"metric": [r[METRIC] for r in log if METRIC in r], "log": log, "provenance": provenance}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--native", action="store_true", help="plain vLLM + plain TRL (the negative control)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (TRL's args.temperature)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling filter (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p sampling filter (1 = off)")
    p.add_argument("--logprobs", choices=["processed", "full"], default="processed",
                   help="what the trainer scores: renormalised over each token's kept set, or the whole vocabulary")
    p.add_argument("--json", action="store_true", help="print the per-step metric and provenance as JSON")
    a = p.parse_args()
    res = run(a.steps, a.native, a.seed, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, logprobs=a.logprobs)
    if a.json:
        print(json.dumps({"metric": res["metric"], "provenance": res["provenance"],
                          "loss": [r["loss"] for r in res["log"] if "loss" in r]}))
        return
    for step, value in enumerate(res["metric"], 1):
        print(f"step {step}: {METRIC} = {value!r}")


if __name__ == "__main__":
    main()
