"""Cross-config paired scoring: one knob at a time from a baseline, on frozen inputs.

The workload's prompts are rolled out once (baseline plan ``R/R``); those sequences are then
frozen and scored on the train side under the baseline configuration and under each
:func:`knobs_for` variant — batch size (micro-batches), chunk size (LM-head token/vocab chunks),
padding side, permutation, dtype, plan — one knob changed at a time. Each active token is
paired by ``(sample_id, position)`` and compared on raw bits.

Statuses: ``PASS`` every paired token raw-bit equal; ``FAIL`` at least one differs;
``INVALID`` the variant is not comparable on raw bits (another dtype: different weights and
output precision; ``|Δ log p|`` is still reported); ``ZERO_ACTIVE`` no active token to pair.
Knobs that must not change any bit are ``expect="PASS"``; the plan knob (``P/P`` on the train
side) is the negative control: it must be detected as ``FAIL``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.workloads import LoadedWorkload
from rl_engine.engine.executor import Layout, score
from rl_engine.runtime.plan import Plan
from rl_engine.utils.bits import same_bits
from rl_engine.validation.chain import build_model, requests_for, rollout, sampling_of, sequences_of
from rl_engine.validation.faults import ProviderFactory, default_factory

__all__ = ["Knob", "knobs_for", "paired_status", "run_cross_config", "STATUSES"]

STATUSES = ("PASS", "FAIL", "INVALID", "ZERO_ACTIVE")


@dataclass(frozen=True)
class Knob:
    name: str
    value: str
    layout: Layout
    dtype: str | None = None
    plan: str = "R/R"
    expect: str = "PASS"  # PASS | FAIL (negative control) | INVALID


def knobs_for(lw: LoadedWorkload) -> list[Knob]:
    w = lw.workload
    c = w.chunks
    base = Layout("baseline")
    other_dtype = "bfloat16" if w.model.dtype == "float32" else "float32"
    return [
        Knob("batch size", "micro-batch 1", Layout("mb1", micro_batch=1)),
        Knob("batch size", "micro-batch 2", Layout("mb2", micro_batch=2)),
        Knob("chunk size", f"token {c.token_chunk}, vocab {c.vocab_chunk}",
             Layout("chunk", token_chunk=c.token_chunk, vocab_chunk=c.vocab_chunk)),
        Knob("chunk size", "token 1", Layout("chunk1", token_chunk=1)),
        Knob("padding side", "left", Layout("left", padding="left")),
        Knob("padding side", "right", Layout("right", padding="right")),
        Knob("permutation", f"seed {w.permutation_seed}", Layout("perm", permute_seed=w.permutation_seed)),
        Knob("dtype", other_dtype, base, dtype=other_dtype, expect="INVALID"),
        Knob("plan", "P/P (native train side)", base, plan="P/P", expect="FAIL"),
    ]


def paired_status(base: dict, var: dict, comparable: bool) -> tuple[str, dict[str, Any]]:
    """Pair the active tokens of two scorings; returns the status and the per-token data."""
    keys, a, b = [], [], []
    for sid in sorted(base):
        sb, sv = base[sid], var[sid]
        for pos in torch.nonzero(sb.mask & sv.mask).flatten().tolist():
            keys.append((sid, pos))
            a.append(sb.logprobs[pos].detach().float())
            b.append(sv.logprobs[pos].detach().float())
    if not keys:
        return "ZERO_ACTIVE", {"tokens": 0}
    at, bt = torch.stack(a), torch.stack(b)
    delta = (at.double() - bt.double()).abs()
    info = {"tokens": len(keys), "max_abs_diff": float(delta.max()), "abs_diff": [float(x) for x in delta],
            "keys": [list(k) for k in keys]}
    if not comparable:
        return "INVALID", info
    d = same_bits(bt, at)
    info["mismatched_tokens"] = d.mismatched
    if not d.equal and d.first_index is not None:
        info["first_mismatch"] = {"sample_id": keys[d.first_index[0]][0], "position": keys[d.first_index[0]][1],
                                  "baseline": float(at[d.first_index[0]]), "variant": float(bt[d.first_index[0]])}
    return ("PASS" if d.equal else "FAIL"), info


def run_cross_config(lw: LoadedWorkload, *, device: str = "cpu", factory: ProviderFactory = default_factory,
                     progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    from rl_engine.utils.checks import nan_policy

    w = lw.workload
    knobs = knobs_for(lw)
    models = {w.model.dtype: build_model(w, device=device)}
    T = sampling_of(w).logprob_temperature
    base_plan = Plan.parse("R/R")
    with nan_policy("propagate"), torch.no_grad():
        model = models[w.model.dtype]
        samples, _ = rollout(model, factory(base_plan, "rollout"), w, requests_for(w, model.spec.vocab_size))
        seqs = sequences_of(samples)  # frozen inputs of every variant
        base = score(model, factory(base_plan, "train"), seqs, Layout("baseline"), temperature=T, pad_id=w.pad_id)
        rows = []
        for k, knob in enumerate(knobs):
            if progress:
                progress(f"cross-config {knob.name}: {knob.value}", k, len(knobs))
            dt = knob.dtype or w.model.dtype
            if dt not in models:
                models[dt] = build_model(w, device=device, dtype=dt)
            var = score(models[dt], factory(Plan.parse(knob.plan), "train"), seqs, knob.layout, temperature=T, pad_id=w.pad_id)
            status, info = paired_status(base, var, comparable=knob.dtype is None)
            rows.append({"knob": knob.name, "value": knob.value, "expect": knob.expect, "status": status,
                         "ok": status == knob.expect, **info})
    return {
        "suite": "cross-config",
        "baseline": {"plan": "R/R", "dtype": w.model.dtype, "layout": "packed, no chunking, given order"},
        "results": rows,
        "negative_controls": [{"name": "plan P/P on the train side", "detected": r["status"] == "FAIL"}
                              for r in rows if r["expect"] == "FAIL"],
        "passed": all(r["ok"] for r in rows),
    }
