"""``rlk check --engine vllm``: the ``rlk check`` flow with vLLM as the rollout engine.

1. **rollout** — one ``vllm.LLM.generate`` call over the built-in prompt set
   (:func:`~rl_engine.validation.parity.builtin_prompts`: varied lengths, per-prompt token
   budgets; vLLM's scheduler batches them continuously, at most ``max_seqs`` at a time) with
   ``SamplingParams(logprobs=0, ignore_eos=True)``, a per-request seed and
   ``logprobs_mode="processed_logprobs"``: vLLM returns, for every sampled token, the
   log-prob of the distribution it was drawn from — ``log softmax(z / T)`` renormalised over
   the top-k / top-p kept set (the full distribution at T = 1 when greedy). The rollout side of
   the plan decides whether vLLM runs rl_engine operators (``R``: the vLLM plugin,
   :mod:`rl_engine.integrations.vllm`, strict mode — its sampler runs rl_engine's canonical
   filter and keeps each token's kept-set record, fetched with
   :func:`~rl_engine.integrations.vllm.kept_sets`) or its own (``P``: vLLM's filter, whose kept
   sets are not exposed; the train side then scores the full vocabulary).
2. **train** — the finished sequences are teacher-forced on the same checkpoint, at the
   sampling temperature (1 when greedy), in every layout of :data:`VLLM_LAYOUTS`, with the
   records (``logprobs="processed"``) or over the whole vocabulary (``"full"``): ``packed``
   is rl_engine's Qwen3 (:mod:`rl_engine.models.qwen3`) over one varlen batch with the train
   side of the plan (``R`` rl_engine ops, ``P`` native torch); the others are the transformers
   layouts of :mod:`~rl_engine.validation.engines.hf` (left/right padding, permuted,
   micro-batched, single) with rl_engine installed (``R``) or unpatched (``P``).
   With ``cfg.train_engine == "megatron"`` the train side is instead one layout,
   ``megatron-tp<N>``: Megatron-core at ``cfg.train_tp`` ranks on gloo
   (:mod:`~rl_engine.validation.engines.megatron`; train ``R``: the full-K row scheme, ``P``:
   Megatron's native K-shard all-reduce).
3. align by ``(sample_id, position)`` and compare raw bits (``validation.alignment``).

``cfg.tp > 1`` runs vLLM with ``tensor_parallel_size = cfg.tp``: its workers are processes
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), each bound to its share of this process's CPUs
(``VLLM_CPU_OMP_THREADS_BIND``, unless set); under the plugin every rank's provenance is checked.

The result has the fields of ``run_parity`` / ``run_hf_parity`` plus ``engine: "vllm"`` and
``provenance.vllm`` (each vLLM worker's operator counts,
:func:`~rl_engine.integrations.vllm.vllm_provenance`). Needs the vLLM environment (``.venv-vllm``).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rl_engine.engine import ops_for

__all__ = ["VLLM_LAYOUTS", "VLLM_ENV_HINT", "VLLM_ENV_DEFAULTS", "VllmUnavailable", "cpu_binding", "require_vllm", "run_vllm_parity"]

#: The train layouts: ``packed`` (rl_engine Qwen3) + the transformers layouts of ``hf.HF_LAYOUTS``.
VLLM_LAYOUTS: tuple[str, ...] = ("packed", "padded-left", "padded-right", "permuted", "micro-batched", "single")

#: What to run when vLLM is missing.
VLLM_ENV_HINT = "run it in the vLLM env: .venv-vllm/bin/rlk check --engine vllm (created by `make test` or `make setup`)"


class VllmUnavailable(ImportError):
    """vLLM (or the training side's transformers) cannot be imported here."""


#: Environment defaults set (unless already set) before vLLM is imported: 1 GiB of CPU KV cache
#: (vLLM-CPU otherwise takes ~10 GiB), the engine in this process, vLLM's log on stderr (stdout
#: carries ``--json``).
VLLM_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "VLLM_LOGGING_STREAM": "ext://sys.stderr"}


def require_vllm() -> None:
    """Set :data:`VLLM_ENV_DEFAULTS`, import vLLM, or raise :class:`VllmUnavailable` whose
    message says where to run instead."""
    for k, v in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (e.g. a CUDA torchvision beside CPU torch)
        raise VllmUnavailable(f"--engine vllm needs vLLM, which is not importable here ({type(exc).__name__}: "
                              f"{exc}); {VLLM_ENV_HINT}") from exc


def _rollout(llm, reqs, sampling, seed: int, with_records: bool) -> tuple[dict, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rl_engine.engine.executor import RolloutSample
    from rl_engine.integrations.vllm import kept_sets

    params = []
    for r in reqs:
        kw: dict[str, Any] = dict(max_tokens=r.max_new_tokens, logprobs=0, ignore_eos=True)
        if sampling.greedy:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      seed=seed * 1_000_003 + r.sample_id)
        params.append(SamplingParams(**kw))
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt)) for r in reqs], params, use_tqdm=False)
    records = kept_sets(llm, outs, require=not sampling.greedy) if with_records else [None] * len(outs)
    rollout = {}
    for r, o, kept in zip(reqs, outs, records):
        c = o.outputs[0]
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise ValueError(f"logprobs: vLLM returned no log-prob for some tokens of sample {r.sample_id}")
        # Logprob.logprob is the fp32 value widened to a Python float: narrowing back is exact.
        lps = [torch.tensor(c.logprobs[t][tok].logprob, dtype=torch.float64).float() for t, tok in enumerate(ids)]
        rollout[r.sample_id] = RolloutSample(r.sample_id, tuple(r.prompt), ids, lps,
                                             [kept[j] for j in range(len(ids))] if kept is not None else [])
    return rollout, sum(len(s.response) for s in rollout.values())


def _score_packed(model, seqs, ops, temperature: float) -> dict:
    """rl_engine Qwen3, one packed varlen forward; ``lp[t] = log softmax(z_{t-1} / T)[tok_t]``,
    renormalised over token ``t``'s kept set for sequences with records."""
    from rl_engine.engine.executor import ScoredSequence

    lens = [len(s.tokens) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64, device=model.device)
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(model.device)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    h = model.hidden_train(ids, pos, cu.to(model.device), ops)
    scored = {}
    for s, st, n in zip(seqs, cu[:-1].tolist(), lens):
        z = model.logits(h[st : st + n - 1].contiguous(), ops).float().contiguous()
        kept = s.kept[1:].contiguous().to(z.device) if s.kept is not None else None
        lp = torch.zeros(n, dtype=torch.float32)
        lp[1:] = ops.token_logprobs(z, ids[st + 1 : st + n].contiguous(), temperature, kept=kept).cpu()
        m = torch.tensor(s.loss_mask, dtype=torch.bool)
        m[0] = False
        scored[s.sample_id] = ScoredSequence(s.sample_id, lp, m)
    return scored


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers: this process's CPUs in ``ranks``
    contiguous shares (``"0-3|4-7"``), or ``"nobind"`` when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < ranks:
        return "nobind"
    per = len(cpus) // ranks
    shares = [cpus[r * per:(r + 1) * per] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in share) for share in shares)


def _build_llm(model_dir: str, cfg, max_len: int):
    from vllm import LLM

    if cfg.tp > 1:  # TP workers are processes; the CPU engine binds each to its share of the CPUs
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(cfg.tp))
    return LLM(model=model_dir, dtype=cfg.dtype, enforce_eager=True, seed=cfg.seed, max_model_len=max_len,
               max_num_seqs=cfg.max_seqs, tensor_parallel_size=cfg.tp, logprobs_mode="processed_logprobs")


def _shutdown(llm) -> None:
    """Stop a multiprocess engine's workers now (an in-process engine goes with the object)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_vllm_parity(cfg, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the ``rlk check`` flow of ``cfg`` (a :class:`~rl_engine.validation.parity.ParityConfig`)
    with vLLM as the rollout engine; returns the ``rlk check`` result dict (``engine: "vllm"``).

    ``cfg.model=None`` writes ``cfg.preset``'s dimensions (``tiny`` by default: head_dim 32, as
    vLLM's CPU attention needs) with ``cfg.seed``'s weights to a temporary checkpoint directory.
    :data:`VLLM_ENV_DEFAULTS` are set unless already set.

    Raises:
        VllmUnavailable: vLLM is not importable (the message names the vLLM environment).
        ValueError: the checkpoint cannot be loaded, or vLLM returned no log-probs.
        ProvenanceError: plan rollout ``R`` and a native vLLM operator ran or a kind never ran.
    """
    from rl_engine import __version__ as rlk_version
    from rl_engine.validation.engines.hf import load_hf_model, score_hf_layout
    from rl_engine.validation.engines.megatron import (check_megatron_layout, megatron_layout_name, require_megatron,
                                                       score_megatron)
    from rl_engine.integrations.hf.install import install as hf_install
    from rl_engine.models.qwen3 import Qwen3ForCausalLM, dtype_from_name
    from rl_engine.platforms import platform_of
    from rl_engine.runtime import current_policy
    from rl_engine.runtime import provenance as prov
    from rl_engine.engine.executor import SamplingParams, TrainSequence
    from rl_engine.runtime.plan import Plan
    from rl_engine.utils.checks import nan_policy
    from rl_engine.validation.alignment import align, compare
    from rl_engine.validation.parity import SCHEMA_VERSION, builtin_prompts, check_context, layout_totals, sampling_summary

    def tick(stage: str, done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)

    require_vllm()
    if cfg.train_engine == "megatron":
        require_megatron()
    import transformers
    import vllm

    from rl_engine.integrations import vllm as rlk_vllm

    t0 = time.perf_counter()
    plan = Plan.parse(cfg.plan)
    train_letter, rollout_letter = plan.label.split("/")
    dtype = dtype_from_name(cfg.dtype)
    megatron = cfg.train_engine == "megatron"
    layout_names = (megatron_layout_name(cfg.train_tp),) if megatron else VLLM_LAYOUTS
    total = 3 + len(layout_names)
    tick("load model", 0, total)
    tmp = None
    if cfg.model is None:
        from rl_engine.integrations.vllm.parity import write_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="rlk-check-vllm-")
        model_dir = str(write_tiny_checkpoint(Path(tmp.name) / cfg.preset, preset=cfg.preset, seed=cfg.seed))
        model_name = cfg.preset
    else:
        model_dir, model_name = str(cfg.model), str(cfg.model)
    try:
        ours = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype, device=cfg.device)
        hf, _ = load_hf_model(model_dir, dtype, cfg.device, cfg.seed)
    except Exception as exc:
        if tmp is not None:
            tmp.cleanup()
        raise ValueError(f"model: cannot load {model_dir!r}: {exc}") from exc
    if megatron:
        try:
            check_megatron_layout(ours.spec, cfg.train_tp)
        except ValueError:
            if tmp is not None:
                tmp.cleanup()
            raise
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed)
    reqs = builtin_prompts(cfg.num_prompts, ours.spec.vocab_size, cfg.max_new_tokens, cfg.seed,
                           cfg.extra_prompt_tokens)
    try:
        max_len = check_context(reqs, ours.spec.max_position_embeddings) + 1
    except ValueError:
        if tmp is not None:
            tmp.cleanup()
        raise
    installed_here = False
    if rollout_letter == "R" and not rlk_vllm.is_installed():
        rlk_vllm.install(strict=True)
        installed_here = True
    elif rollout_letter == "P" and rlk_vllm.is_installed():
        raise ValueError("plan: the rollout side is P (native vLLM) but the rl_engine vLLM plugin is installed in "
                         "this process (RLK_VLLM set?); unset it or use a rollout side of R")
    llm = None
    inst = None
    records: list = []
    try:
        tick("build vLLM engine", 1, total)
        llm = _build_llm(model_dir, cfg, max(max_len, 64))
        vllm_prov: list[dict[str, Any]] = []
        if rollout_letter == "R":
            rlk_vllm.reset_provenance(llm)
        tick("rollout (vLLM generate)", 2, total)
        t_r = time.perf_counter()
        rollout, active = _rollout(llm, reqs, sampling, cfg.seed, with_records=rollout_letter == "R")
        rollout_s = time.perf_counter() - t_r
        vllm_prov = rlk_vllm.vllm_provenance(llm) if rlk_vllm.is_installed() else []
        if rollout_letter == "R":
            # the returned log-probs: compute_logprobs serves all-greedy steps, the sampler's
            # processed path every sampled one
            logprob_kind = "Sampler.compute_logprobs" if sampling.greedy else "Sampler.processed_logprobs"
            rlk_vllm.assert_no_fallbacks(vllm_prov, require=tuple(k for k in rlk_vllm.QWEN3_KINDS
                                                                  if k != "Sampler.compute_logprobs") + (logprob_kind,))
        seqs = [TrainSequence.of(s, cfg.logprobs) for s in rollout.values()]
        _shutdown(llm)  # free the rollout's workers and KV cache before the train side runs
        ops = ops_for(plan, "train")
        inst = hf_install(hf) if train_letter == "R" and not megatron else None
        layouts = []
        T = sampling.logprob_temperature
        with prov.record() as records, torch.no_grad(), nan_policy("propagate"):
            for k, name in enumerate(layout_names):
                tick(f"train layout {name}", 3 + k, total)
                t_l = time.perf_counter()
                if megatron:
                    scored = score_megatron(model_dir, seqs, tp=cfg.train_tp, dtype=cfg.dtype, temperature=T,
                                            train_letter=train_letter)
                elif name == "packed":
                    scored = _score_packed(ours, seqs, ops, T)
                else:
                    scored = score_hf_layout(hf, seqs, name, T, cfg.device)
                c = compare(align(rollout, scored))
                layouts.append({"name": name, **c.as_dict(), "seconds": round(time.perf_counter() - t_l, 3)})
    finally:
        if inst is not None:
            inst.unapply()
        del llm
        gc.collect()
        if installed_here:
            rlk_vllm.uninstall()
        if tmp is not None:
            tmp.cleanup()
    tick("done", total, total)
    first = next(({"layout": lay["name"], **lay["first_mismatch"]} for lay in layouts if lay["first_mismatch"]), None)
    summary = prov.summarize(records)
    native = []
    if rollout_letter == "P":
        native.append("rollout: all (native vLLM)")
    if train_letter == "P":
        native.append("train: Megatron's native row-parallel all-reduce" if megatron
                      else "train: all (native torch / unpatched transformers)")
    return {
        "schema_version": SCHEMA_VERSION,
        "engine": "vllm",
        "model": model_name,
        "model_spec": ours.spec.model_dump(),
        "dtype": cfg.dtype,
        "device": cfg.device,
        "plan": plan.label,
        "plan_detail": plan.as_dict(),
        "sampling": sampling_summary(sampling, cfg.logprobs, rollout.values(),
                                     "vLLM processed_logprobs under the rl_engine plugin: rl_engine's canonical top-k / "
                                     "top-p filter in vLLM's sampler (rollout R); vLLM's own filter, records not "
                                     "exposed (rollout P)"),
        "num_prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "extra_prompt_tokens": cfg.extra_prompt_tokens,
        "max_context": max(len(s.prompt) + len(s.response) for s in rollout.values()),
        "seed": cfg.seed,
        "tp": cfg.tp,
        "train_engine": cfg.train_engine,
        "train_tp": cfg.train_tp,
        "rollout": {
            "steps": None,  # vLLM's scheduler steps are not observed from outside
            "distinct_batch_compositions": None,
            "max_sequences_per_step": min(cfg.max_seqs, cfg.num_prompts),
            "active_tokens": active,
            "seconds": round(rollout_s, 3),
        },
        "layouts": layouts,
        **layout_totals(layouts, first),
        "provenance": {
            "rl_engine": rlk_version,
            "vllm_version": vllm.__version__,
            "transformers": transformers.__version__,
            "platform": platform_of(torch.empty(0, device=cfg.device)).as_dict(),
            "policy": current_policy(),
            "torch_threads": torch.get_num_threads(),
            "fallback": any(r["fallback"] for r in summary) or any(p.get("fallback") for p in vllm_prov),
            "operators": summary,
            "vllm": vllm_prov,
            "native_modules": native,
        },
        "seconds": round(time.perf_counter() - t0, 3),
        "passed": bool(layouts) and all(lay["passed"] for lay in layouts),
    }
