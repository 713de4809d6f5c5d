"""``rlk check --engine hf``: the ``rlk check`` flow through transformers.

Instead of the reference executors, HF is both engines:

1. **rollout** — ``model.generate`` (KV cache, left-padded batches of ``max_seqs`` prompts of
   the built-in prompt set; HF samples, ``top_k`` / ``top_p`` run as rl_engine's canonical
   filter, :class:`~rl_engine.integrations.hf.rollout.KeptSetRecorder`, which records each
   step's kept sets); each sampled token's processed log-prob is ``log softmax(z / T)[token]``
   of the raw logits (``output_logits``) renormalised over its kept set, computed with
   ``ops.logprob.token_logprobs(..., kept=)`` (T = 1 when greedy);
2. **train** — one teacher-forced ``model(...)`` forward per layout of :data:`HF_LAYOUTS`
   (left padding, right padding, a permuted batch, micro-batches of 2, each sequence alone),
   the same op on the fp32 logits, with the records (``logprobs="processed"``) or over the
   whole vocabulary (``"full"``);
3. align by ``(sample_id, position)`` and compare raw bits (``validation.alignment``).

Plan ``R/R`` installs rl_engine into the model (:func:`~rl_engine.integrations.hf.install.install`); ``P/P`` runs
unpatched transformers (sdpa): the negative control. Mixed plans have no meaning here (one
model serves both sides) and are rejected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rl_engine.integrations.hf.install import install, logical_positions

__all__ = ["HF_LAYOUTS", "load_hf_model", "run_hf_parity"]

#: name → (padding side, micro-batch size or None, permutation seed or None)
HF_LAYOUTS: dict[str, tuple[str, int | None, int | None]] = {
    "padded-left": ("left", None, None),
    "padded-right": ("right", None, None),
    "permuted": ("left", None, 1234),
    "micro-batched": ("right", 2, 99),
    "single": ("left", 1, None),
}


def load_hf_model(model_dir: str | None, dtype: torch.dtype, device: str, seed: int, preset: str = "tiny"):
    """A transformers ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (eval mode) and its display name.

    ``model_dir=None`` builds ``preset``'s dimensions (``rl_engine.models.registry.PRESETS``) with
    the same seeded weights as the reference check (``random_model``); otherwise
    ``from_pretrained`` (no hub), the class named by the directory's ``config.json``.
    """
    from transformers import Qwen3Config, Qwen3MoeConfig
    from transformers import Qwen3ForCausalLM as HFQwen3
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    from rl_engine.models.qwen3_moe import Qwen3MoeSpec
    from rl_engine.models.registry import load_spec, random_model
    from rl_engine.models.registry import preset as preset_spec

    if model_dir is None:
        spec = preset_spec(preset)
        moe = isinstance(spec, Qwen3MoeSpec)
        fields = {k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "rope_theta", "model_type")}
        hf = HFQwen3Moe(Qwen3MoeConfig(**fields)) if moe else HFQwen3(Qwen3Config(**fields))
        ours = random_model(spec, seed=seed)
        sd = ours.to_hf_state_dict(fused_experts=True) if moe else ours.to_hf_state_dict()
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"model: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
        hf.tie_weights()
        name = f"{preset} (random weights)"
    else:
        cls = HFQwen3Moe if isinstance(load_spec(model_dir), Qwen3MoeSpec) else HFQwen3
        hf = cls.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        name = str(model_dir)
    hf = hf.to(device=device, dtype=dtype).eval()
    if hf.generation_config.pad_token_id is None:
        hf.generation_config.pad_token_id = 0
    return hf, name


def _pad(rows: list[list[int]], side: str, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.int64)
    mask = torch.zeros(len(rows), L, dtype=torch.int64)
    for i, r in enumerate(rows):
        sl = slice(L - len(r), L) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.int64)
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


def _rollout(model, reqs, sampling, max_seqs: int, device) -> tuple[dict, list[int]]:
    from rl_engine.ops.logprob import KeptSet, token_logprobs
    from rl_engine.engine.executor import RolloutSample
    from rl_engine.integrations.hf.rollout import KeptSetRecorder

    pad = int(model.generation_config.pad_token_id)
    out: dict[int, RolloutSample] = {}
    steps = []
    T = sampling.logprob_temperature
    for start in range(0, len(reqs), max_seqs):
        group = reqs[start : start + max_seqs]
        ids, mask = _pad([list(r.prompt) for r in group], "left", pad, device)
        n = max(r.max_new_tokens for r in group)
        kw: dict[str, Any] = {"do_sample": not sampling.greedy}
        recorder = None
        if not sampling.greedy:
            recorder = KeptSetRecorder(sampling.temperature, sampling.top_k, sampling.top_p)
            kw.update(temperature=1.0, top_k=0, top_p=1.0, logits_processor=[recorder])
        torch.manual_seed(sampling.seed * 1_000_003 + start)
        g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, output_logits=True,
                           return_dict_in_generate=True, eos_token_id=None, **kw)
        new = g.sequences[:, ids.shape[1]:].contiguous()
        kept = recorder.kept(new.shape[0], new.device) if recorder is not None else KeptSet.everything(new.shape, new.device)
        lp = token_logprobs(torch.stack(g.logits, 1).float().contiguous(), new, temperature=T, kept=kept).cpu()
        kept = kept.to("cpu")
        steps.append(new.shape[1])
        for i, r in enumerate(group):
            k = r.max_new_tokens  # tokens past a row's budget are discarded (they never affect earlier ones)
            out[r.sample_id] = RolloutSample(r.sample_id, tuple(r.prompt), new[i, :k].tolist(), list(lp[i, :k].unbind()),
                                             [kept[i, j] for j in range(k)])
    return out, steps


def score_hf_layout(model, seqs, layout: str, temperature: float, device) -> dict:
    from rl_engine.ops.logprob import token_logprobs
    from rl_engine.engine.executor import ScoredSequence

    side, micro, perm_seed = HF_LAYOUTS[layout]
    order = list(range(len(seqs)))
    if perm_seed is not None:
        order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(perm_seed)).tolist()
    size = micro or len(order)
    pad = int(model.generation_config.pad_token_id)
    scored = {}
    for start in range(0, len(order), size):
        batch = [seqs[i] for i in order[start : start + size]]
        ids, mask = _pad([list(s.tokens) for s in batch], side, pad, device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=logical_positions(mask.bool())).logits
        L = ids.shape[1]
        for b, s in enumerate(batch):
            n = len(s.tokens)
            off = L - n if side == "left" else 0
            z = logits[b, off : off + n - 1].float().contiguous()
            tgt = ids[b, off + 1 : off + n].contiguous()
            kept = s.kept[1:].contiguous().to(z.device) if s.kept is not None else None
            lp = torch.zeros(n, dtype=torch.float32)
            lp[1:] = token_logprobs(z, tgt, temperature=temperature, kept=kept).cpu()
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            m[0] = False
            scored[s.sample_id] = ScoredSequence(s.sample_id, lp, m)
    return scored


def run_hf_parity(cfg, progress: Callable[[str, int, int], None] | None = None, model=None,
                  model_name: str | None = None) -> dict[str, Any]:
    """Run the ``rlk check`` flow of ``cfg`` (a :class:`~rl_engine.validation.parity.ParityConfig`)
    through transformers; returns a result with the same fields as ``run_parity`` plus
    ``engine: "hf"`` (``cfg.layouts`` is replaced by :data:`HF_LAYOUTS`).

    Raises:
        ValueError: a plan other than ``R/R`` or ``P/P``.
    """
    from rl_engine import __version__ as rlk_version
    from rl_engine.models.qwen3 import dtype_from_name
    from rl_engine.platforms import platform_of
    from rl_engine.runtime import current_policy
    from rl_engine.runtime import provenance as prov
    from rl_engine.engine.executor import SamplingParams, TrainSequence
    from rl_engine.runtime.plan import Plan
    from rl_engine.utils.checks import current_nan_policy, nan_policy
    from rl_engine.validation.alignment import align, compare
    from rl_engine.validation.parity import SCHEMA_VERSION, builtin_prompts, check_context, layout_totals, sampling_summary

    def tick(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    t0 = time.perf_counter()
    plan = Plan.parse(cfg.plan)
    if plan.label not in ("R/R", "P/P"):
        raise ValueError(f"plan: --engine hf runs one model for both sides, so only R/R (installed) or P/P "
                         f"(unpatched transformers) apply, got {plan.label}")
    total = 2 + len(HF_LAYOUTS)
    tick("load model", 0, total)
    if model is None:
        model, model_name = load_hf_model(cfg.model, dtype_from_name(cfg.dtype), cfg.device, cfg.seed, cfg.preset)
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)
    reqs = builtin_prompts(cfg.num_prompts, model.config.vocab_size, cfg.max_new_tokens, cfg.seed,
                           cfg.extra_prompt_tokens)
    check_context(reqs, model.config.max_position_embeddings)
    inst = install(model) if plan.label == "R/R" else None
    records: list = []
    try:
        # the rollout without per-call NaN scans, the training forward under the caller's policy
        # (default "auto"), as in rl_engine.validation.parity.run_parity
        train_policy = current_nan_policy()
        with prov.record() as records, torch.no_grad():
            tick("rollout (generate)", 1, total)
            t_r = time.perf_counter()
            with nan_policy("propagate"):
                rollout, steps = _rollout(model, reqs, sampling, cfg.max_seqs, cfg.device)
            rollout_s = time.perf_counter() - t_r
            seqs = [TrainSequence.of(s, cfg.logprobs) for s in rollout.values()]
            layouts = []
            for k, name in enumerate(HF_LAYOUTS):
                tick(f"train layout {name}", 2 + k, total)
                t_l = time.perf_counter()
                c = compare(align(rollout, score_hf_layout(model, seqs, name, sampling.logprob_temperature, cfg.device)))
                layouts.append({"name": name, **c.as_dict(), "seconds": round(time.perf_counter() - t_l, 3)})
    finally:
        if inst is not None:
            inst.unapply()
    tick("done", total, total)
    first = next(({"layout": lay["name"], **lay["first_mismatch"]} for lay in layouts if lay["first_mismatch"]), None)
    summary = prov.summarize(records)
    import transformers

    return {
        "schema_version": SCHEMA_VERSION,
        "engine": "hf",
        "model": model_name or type(model).__name__,
        "model_spec": {k: v for k, v in model.config.to_dict().items() if isinstance(v, (int, float, str, bool))},
        "dtype": cfg.dtype,
        "device": cfg.device,
        "plan": plan.label,
        "plan_detail": plan.as_dict(),
        "sampling": sampling_summary(sampling, cfg.logprobs, rollout.values(),
                                     "rl_engine's canonical top-k / top-p filter as generate's logits processor "
                                     "(KeptSetRecorder), on generate's raw logits"),
        "num_prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "extra_prompt_tokens": cfg.extra_prompt_tokens,
        "max_context": max(len(s.tokens) for s in rollout.values()),
        "seed": cfg.seed,
        "rollout": {
            "steps": sum(steps),
            "distinct_batch_compositions": len(steps),
            "max_sequences_per_step": min(cfg.max_seqs, cfg.num_prompts),
            "active_tokens": sum(len(s.response) for s in rollout.values()),
            "seconds": round(rollout_s, 3),
        },
        "layouts": layouts,
        **layout_totals(layouts, first),
        "provenance": {
            "rl_engine": rlk_version,
            "transformers": transformers.__version__,
            "platform": platform_of(torch.empty(0, device=cfg.device)).as_dict(),
            "policy": current_policy(),
            "nan_policy": {"rollout": "propagate", "train": train_policy},
            "torch_threads": torch.get_num_threads(),
            "fallback": any(r["fallback"] for r in summary),
            "operators": summary,
            "native_modules": [] if inst is not None else ["all (unpatched transformers)"],
        },
        "seconds": round(time.perf_counter() - t0, 3),
        "passed": bool(layouts) and all(lay["passed"] for lay in layouts),
    }
