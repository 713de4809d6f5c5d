"""Train/rollout parity run: the engine behind ``rlk check``.

One run:

1. load the model (a HF Qwen3 or Qwen3-MoE checkpoint directory, or a preset's dimensions — ``tiny`` by
   default — with seeded random weights) in the requested dtype on the requested device;
2. **rollout** the built-in prompt set (:func:`builtin_prompts`: varied lengths, staggered
   arrivals, different response lengths; ``extra_prompt_tokens`` lengthens every prompt so that
   the contexts cross the 1024-key KV splits) with the plan's rollout provider: chunked prefill +
   decode over KV caches, continuous batching, recording each sampled token's **processed**
   log-prob (``log softmax(z / T)`` renormalised over the tokens top-k / top-p kept: the
   distribution it was drawn from) and that step's kept-set record;
3. **score** the same sequences on the train path under every layout in ``layouts``
   (packed, padded left/right, permuted, micro-batched, chunked LM head) with the plan's
   train provider — ``logprobs="processed"``: renormalised over each token's recorded kept set
   (the replay: raw-bit equal); ``"full"``: over the whole vocabulary (the systematic bias of a
   trainer that ignores the filter: mismatches wherever a filter dropped mass — the negative
   control of the replay);
4. **align** by ``(sample_id, position)`` on the active (response) tokens and compare raw bits.

``passed`` means: every layout compared at least one token and no active token differs in
any bit. Diagnostics (max ``|Δ|``, K3-KL, mean ``|Δp|``) are reported, never used to pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rl_engine.engine.executor import LAYOUTS, RolloutExecutor, RolloutRequest, SamplingParams, TrainSequence, score
from rl_engine.runtime.plan import Plan
from rl_engine.utils.threads import intra_op_threads
from rl_engine.validation.alignment import align, bits_digest, compare
from rl_engine.engine import ops_for

__all__ = ["ParityConfig", "builtin_prompts", "check_context", "layout_totals", "load_model", "run_parity", "sampling_summary",
           "SCHEMA_VERSION", "PROMPT_LENGTHS", "LOGPROB_DISTRIBUTIONS"]

SCHEMA_VERSION = 1
#: Prompt lengths of the built-in prompt set (cycled): short, long, odd, one-token.
PROMPT_LENGTHS = (7, 33, 3, 52, 18, 1, 41, 12, 26, 64, 9, 21, 47, 5, 30, 15)


class ParityConfig(BaseModel):
    """Everything that defines one parity run (defaults = the embedded default of ``rlk check``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None  # HF checkpoint directory; None = ``preset``'s dimensions, random weights
    #: the preset (``rl_engine.models.registry.PRESETS``: Qwen3 dense and Qwen3-MoE) whose dimensions the random-weight model
    #: takes when ``model`` is None: ``tiny`` (head dim 32), or a Qwen3 size such as
    #: ``qwen3-0.6b`` (head dim 128: the GPU kernels' value-sliced decode steps)
    preset: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    num_prompts: int = Field(default=12, ge=1)
    max_new_tokens: int = Field(default=24, ge=1)
    #: tokens added to every built-in prompt (``builtin_prompts``): with 1000 the contexts are
    #: 1021-1085 tokens (12 prompts), past position 1024, the attention contract's first KV split
    extra_prompt_tokens: int = Field(default=0, ge=0)
    #: the rollout's rl-kernel KV cache (plan rollout ``R``): one contiguous buffer per sequence
    #: slot, or 16-token pages handed out from a shared pool (``PagedKVCache``: a sequence's pages
    #: interleave with the others', so the kernels gather each block through the page table)
    kv_cache: Literal["contiguous", "paged"] = "contiguous"
    #: what the train side scores: ``processed`` (renormalised over each token's kept set, as the
    #: rollout reports) or ``full`` (the whole vocabulary)
    logprobs: Literal["processed", "full"] = "processed"
    seed: int = 0
    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=50, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    plan: str = "R/R"
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    #: the rollout scheduler (``RolloutExecutor``): sequences at once (cache slots), prompt tokens a
    #: sequence feeds per step, and one step's token budget (decode tokens first, then chunks)
    max_seqs: int = Field(default=8, ge=1)
    prefill_chunk: int = Field(default=16, ge=1)
    max_step_tokens: int = Field(default=40, ge=1)
    #: torch intra-op threads of the rollout and of the train scoring (None: the caller's count).
    #: The CPU backend's bits do not depend on them (the ``threads`` invariance).
    rollout_threads: int | None = Field(default=None, ge=1)
    train_threads: int | None = Field(default=None, ge=1)
    #: the rollout engine's tensor-parallel size (``--engine vllm``: vLLM's ``tensor_parallel_size``)
    tp: int = Field(default=1, ge=1)
    #: who scores the train side: ``default`` (the engine's own train layouts) or ``megatron``
    #: (Megatron-core at ``train_tp`` ranks on gloo, :mod:`rl_engine.validation.engines.megatron`)
    train_engine: Literal["default", "megatron"] = "default"
    train_tp: int = Field(default=1, ge=1)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        from rl_engine.models.registry import preset

        preset(v)  # ModelLoadError (a ValueError) naming the known presets
        return v


#: What each side's log-prob is, by ``--logprobs`` (the ``sampling.logprob_distribution`` field).
LOGPROB_DISTRIBUTIONS = {
    "processed": "rollout and train: log_softmax(logits / T) renormalised over the kept set of the token's sampling "
                 "step (top-k, then top-p of the top-k mass; the whole vocabulary without filters; T = 1 when greedy)",
    "full": "rollout: renormalised over the kept set (what it sampled from); train: log_softmax(logits / T) over the "
            "whole vocabulary (T = 1 when greedy) -- differs wherever a filter dropped mass",
}


def layout_totals(layouts: list[dict[str, Any]], first: Any) -> dict[str, Any]:
    """The report's totals over its per-layout comparisons: tokens compared and mismatched (sums),
    the largest ``|Δ|``, ``k3`` KL and mean probability difference of any layout, and ``first``
    (the first mismatch, or ``None``). Every ``rlk check`` engine reports them the same way."""
    return {
        "compared_tokens": sum(lay["compared_tokens"] for lay in layouts),
        "mismatched_tokens": sum(lay["mismatched_tokens"] for lay in layouts),
        "max_abs_diff": max((lay["max_abs_diff"] for lay in layouts), default=0.0),
        "first_mismatch": first,
        "k3_kl": max((lay["k3_kl"] for lay in layouts), default=0.0),
        "mean_abs_prob_diff": max((lay["mean_abs_prob_diff"] for lay in layouts), default=0.0),
    }


def sampling_summary(sampling: SamplingParams, logprobs: str, samples, kept_by: str) -> dict[str, Any]:
    """The ``sampling`` field of a check result: the parameters, ``logprobs`` (the mode), what
    the compared log-probs are, who produced the kept sets and ``filtered_tokens`` (sampled
    tokens whose kept set is smaller than the vocabulary: the tokens where ``full`` differs)."""
    return {**sampling.model_dump(), "logprobs": logprobs, "logprob_distribution": LOGPROB_DISTRIBUTIONS[logprobs],
            "kept_sets": kept_by, "filtered_tokens": sum(s.filtered_tokens() for s in samples)}


def builtin_prompts(n: int, vocab_size: int, max_new_tokens: int, seed: int,
                    extra_tokens: int = 0) -> list[RolloutRequest]:
    """``n`` prompts of varied length (:data:`PROMPT_LENGTHS`, each plus ``extra_tokens``) with
    token ids in ``[1, vocab)``.

    Sample ``i`` arrives at step ``2 * (i // 3)`` and asks for ``max_new_tokens - 3 * (i % 4)``
    tokens (at least 1), so sequences join and finish at different steps. With ``extra_tokens =
    0`` the prompts are the embedded default's (``rlk check``'s prompt ids never change).
    """
    if extra_tokens < 0:
        raise ValueError(f"extra_tokens: expected a count >= 0, got {extra_tokens}")
    g = torch.Generator().manual_seed(10_000 + seed)
    reqs = []
    for i in range(n):
        L = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] + extra_tokens
        ids = torch.randint(1, vocab_size, (L,), generator=g).tolist()
        reqs.append(RolloutRequest(i, tuple(ids), max(1, max_new_tokens - 3 * (i % 4)), arrival_step=2 * (i // 3)))
    return reqs


def check_context(reqs: list[RolloutRequest], max_positions: int) -> int:
    """The longest context of ``reqs`` (prompt + response tokens); raises ``ValueError`` (naming
    ``--extra-prompt-tokens``) when it exceeds the model's ``max_position_embeddings``."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    if longest > max_positions:
        raise ValueError(f"extra_prompt_tokens (--extra-prompt-tokens): the longest prompt + response is {longest} "
                         f"tokens, more than the model's max_position_embeddings = {max_positions}")
    return longest


def load_model(cfg: ParityConfig):
    """The model of ``cfg`` (raises ModelLoadError / ValueError on a bad directory or dtype)."""
    from rl_engine.models.qwen3 import dtype_from_name
    from rl_engine.models.registry import from_pretrained, preset, random_model

    dtype = dtype_from_name(cfg.dtype)
    if cfg.model is None:
        return (random_model(preset(cfg.preset), seed=cfg.seed, dtype=dtype, device=cfg.device),
                f"{cfg.preset} (random weights)")
    return from_pretrained(cfg.model, dtype=dtype, device=cfg.device), str(Path(cfg.model))


def run_parity(cfg: ParityConfig, progress: Callable[[str, int, int], None] | None = None,
               model: Any | None = None) -> dict[str, Any]:
    """Run the check of ``cfg``; returns the JSON-ready result (see docs/check.md).

    Args:
        progress: called as ``progress(stage, done, total)``.
        model: an already loaded model to use instead of loading ``cfg.model``.
    """
    from rl_engine import __version__ as rlk_version
    from rl_engine.platforms import platform_of
    from rl_engine.runtime import current_policy
    from rl_engine.runtime import provenance as prov
    from rl_engine.utils.checks import current_nan_policy, nan_policy

    def tick(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    t0 = time.perf_counter()
    plan = Plan.parse(cfg.plan)
    bad = [name for name in cfg.layouts if name not in LAYOUTS]
    if bad:
        raise ValueError(f"layouts: unknown {bad}; expected names from {list(LAYOUTS)}")
    total = 2 + len(cfg.layouts)
    tick("load model", 0, total)
    if model is None:
        model, model_name = load_model(cfg)
    else:
        model_name = getattr(model.spec, "name", "model")
    bad_w = [k for k, v in model.params.items() if not torch.isfinite(v).all()]
    if bad_w:
        raise ValueError(f"model: parameters {bad_w[:3]} contain NaN or Inf")
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)
    reqs = builtin_prompts(cfg.num_prompts, model.spec.vocab_size, cfg.max_new_tokens, cfg.seed,
                           cfg.extra_prompt_tokens)
    max_len = check_context(reqs, model.spec.max_position_embeddings)
    tick("rollout", 1, total)
    records: list = []
    # The rollout runs as engines run it, without per-call NaN scans ("propagate": none on the host
    # either; the weights are checked finite above, and a NaN would reach a log-prob and fail the
    # comparison anyway). The train layouts are scored under the caller's policy
    # (default "auto": the scans a trainer's calls run on host tensors, and the kernels they
    # select: on Hopper the train path's TMA and warpgroup forward assume finite inputs and run
    # under every policy but "propagate").
    train_policy = current_nan_policy()
    with prov.record() as records, torch.no_grad():
        with nan_policy("propagate"):
            ex = RolloutExecutor(model, ops_for(plan, "rollout", kv_cache=cfg.kv_cache), max_seqs=cfg.max_seqs,
                                 max_len=max_len,
                                 prefill_chunk=cfg.prefill_chunk, max_step_tokens=cfg.max_step_tokens)
            t_r = time.perf_counter()
            with intra_op_threads(cfg.rollout_threads):
                rollout = ex.generate(reqs, sampling,
                                      progress=lambda done, n: tick(f"rollout: {done}/{n} tokens", 1, total))
            rollout_s = time.perf_counter() - t_r
        seqs = [TrainSequence.of(s, cfg.logprobs) for s in rollout.values()]
        layouts = []
        aligned = []
        for k, name in enumerate(cfg.layouts):
            tick(f"train layout {name}", 2 + k, total)
            t_l = time.perf_counter()
            with intra_op_threads(cfg.train_threads):
                scored = score(model, ops_for(plan, "train"), seqs, name, temperature=sampling.logprob_temperature)
            aligned.append((name, align(rollout, scored)))
            c = compare(aligned[-1][1])
            layouts.append({"name": name, **c.as_dict(), "seconds": round(time.perf_counter() - t_l, 3)})
    tick("done", total, total)
    first = next(({"layout": lay["name"], **lay["first_mismatch"]} for lay in layouts if lay["first_mismatch"]), None)
    compositions = {tuple(sid for sid, _ in step) for step in ex.batch_log}
    platform = platform_of(torch.empty(0, device=cfg.device))
    summary = prov.summarize(records)
    return {
        "schema_version": SCHEMA_VERSION,
        "model": model_name,
        "model_spec": model.spec.model_dump(),
        "dtype": cfg.dtype,
        "device": cfg.device,
        "plan": plan.label,
        "plan_detail": plan.as_dict(),
        "sampling": sampling_summary(sampling, cfg.logprobs, rollout.values(),
                                     "the reference executor's canonical top-k / top-p filter"),
        "num_prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "extra_prompt_tokens": cfg.extra_prompt_tokens,
        "max_context": max(len(s.tokens) for s in rollout.values()),
        "kv_cache": cfg.kv_cache,
        "seed": cfg.seed,
        "rollout": {
            "steps": len(ex.batch_log),
            "distinct_batch_compositions": len(compositions),
            "max_sequences_per_step": max(len(s) for s in ex.batch_log),
            "max_tokens_per_step": max(sum(n for _, n in s) for s in ex.batch_log),
            "scheduler": {"max_seqs": cfg.max_seqs, "prefill_chunk": cfg.prefill_chunk,
                          "max_step_tokens": cfg.max_step_tokens},
            "active_tokens": sum(len(s.response) for s in rollout.values()),
            "seconds": round(rollout_s, 3),
        },
        "layouts": layouts,
        **layout_totals(layouts, first),
        "provenance": {
            "rl_engine": rlk_version,
            "platform": platform.as_dict(),
            "policy": current_policy(),
            "nan_policy": {"rollout": "propagate", "train": train_policy},
            "torch_threads": torch.get_num_threads(),
            "fallback": any(r["fallback"] for r in summary),
            "operators": summary,
            "native_modules": sorted({f"{m}:{side}" for (m, side), v in plan.choices.items() if v == "P"}),
        },
        "seconds": round(time.perf_counter() - t0, 3),
        "bits_digest": bits_digest(aligned),
        "threads": {"rollout": cfg.rollout_threads or torch.get_num_threads(),
                    "train": cfg.train_threads or torch.get_num_threads()},
        "passed": bool(layouts) and all(lay["passed"] for lay in layouts),
    }
