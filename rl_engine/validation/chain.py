"""WS1 model chain: the Qwen3 (or Qwen3-MoE) model over layout and decode cells, raw bits.

Every cell rolls out the workload's prompts on the rollout side (chunked prefill + decode over
KV caches, continuous batching) and scores the sampled sequences on the train side in one
layout; active tokens are aligned by ``(sample_id, position)`` and compared on raw bits
(zero mismatches to pass). Cells (:data:`CELLS`):

* ``BN/full`` whole-prompt prefill, all samples at once; train packed;
* ``B1/singleton`` one sequence at a time on both sides;
* ``BN/chunked`` chunked prefill (workload chunk) and the chunked fused LM-head log-prob;
* ``packed``, ``padded-left``, ``padded-right``, ``permuted`` train layouts;
* decode sweep: ``decode/B1-short``, ``decode/B1-long`` (one sample, short / long prompt and
  response), ``decode/BN-varlen`` (staggered arrivals, varied lengths), ``decode/BN-padded``.

**Gradient invariance across cells**: on one frozen set of sequences the train side runs every
layout with autograd; the gradient of ``Σ u(sample, position) · logp`` (``u`` a fixed
per-token weight) w.r.t. each token's embedding output row must have the same bits in every
layout.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.workloads import LoadedWorkload, Workload
from rl_engine.engine.executor import Layout, RolloutExecutor, RolloutRequest, SamplingParams, TrainSequence, layout_stream, score
from rl_engine.runtime.plan import Plan
from rl_engine.utils.threads import intra_op_threads
from rl_engine.utils.bits import same_bits
from rl_engine.validation import capture as cap_mod
from rl_engine.validation.alignment import align, compare
from rl_engine.validation.faults import ProviderFactory, default_factory, faulty_factory
from rl_engine.engine import ops_for

__all__ = ["CELLS", "ChainCell", "build_model", "requests_for", "rollout", "run_chain", "gradient_invariance",
           "train_layouts", "sequences_of"]


@dataclass(frozen=True)
class ChainCell:
    name: str
    layout: Layout
    samples: str = "all"  # all | shortest | longest
    max_seqs: int | None = None  # None: all samples at once
    prefill_chunk: str = "workload"  # workload | full
    response_scale: int = 1


def build_model(w: Workload, *, device: str = "cpu", dtype: str | None = None):
    from rl_engine.models.qwen3 import dtype_from_name
    from rl_engine.models.registry import PRESETS, from_pretrained, random_model

    if w.model.path is not None:
        return from_pretrained(w.model.path, dtype=dtype_from_name(dtype or w.model.dtype), device=device)
    if w.model.preset not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {w.model.preset!r}; known: {sorted(PRESETS)}")
    return random_model(PRESETS[w.model.preset], seed=w.model.seed, dtype=dtype_from_name(dtype or w.model.dtype),
                        device=device)


def requests_for(w: Workload, vocab: int, which: str = "all", response_scale: int = 1) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(20_000 + w.seed)
    reqs = []
    for i, s in enumerate(w.samples):
        ids = torch.randint(1, vocab, (s.prompt_len,), generator=g).tolist()
        reqs.append(RolloutRequest(i, tuple(ids), s.response_len * response_scale, arrival_step=s.arrival_step))
    if which == "shortest":
        return [min(reqs, key=lambda r: (len(r.prompt), r.sample_id))]
    if which == "longest":
        return [max(reqs, key=lambda r: (len(r.prompt), -r.sample_id))]
    return reqs


def sampling_of(w: Workload) -> SamplingParams:
    return SamplingParams(temperature=w.temperature, top_k=w.top_k, top_p=w.top_p, seed=w.seed)


def rollout(model, ops, w: Workload, reqs: Sequence[RolloutRequest], *, max_seqs: int | None = None,
            prefill_chunk: int | None = None, max_step_tokens: int | None = None):
    max_len = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    ex = RolloutExecutor(model, ops, max_seqs=max_seqs or len(reqs), max_len=max_len,
                         prefill_chunk=prefill_chunk or w.chunks.prefill_chunk,
                         max_step_tokens=max_step_tokens or w.chunks.max_step_tokens)
    return ex.generate(reqs, sampling_of(w)), ex


def sequences_of(samples) -> list[TrainSequence]:
    """The rollout's samples as train sequences with their kept-set records (processed log-probs)."""
    return [TrainSequence.of(s) for s in samples.values()]


def train_layouts(w: Workload) -> dict[str, Layout]:
    c = w.chunks
    return {
        "packed": Layout("packed"),
        "padded-left": Layout("padded-left", padding="left"),
        "padded-right": Layout("padded-right", padding="right"),
        "permuted": Layout("permuted", permute_seed=w.permutation_seed),
        "micro-batched": Layout("micro-batched", micro_batch=2, permute_seed=w.permutation_seed + 1),
        "chunked": Layout("chunked", token_chunk=c.token_chunk, vocab_chunk=c.vocab_chunk),
        "singleton": Layout("singleton", micro_batch=1),
    }


def cells_for(w: Workload) -> list[ChainCell]:
    L = train_layouts(w)
    pad = L[f"padded-{w.padding_side}"]
    return [
        ChainCell("BN/full", L["packed"], prefill_chunk="full"),
        ChainCell("B1/singleton", L["singleton"], max_seqs=1),
        ChainCell("BN/chunked", L["chunked"]),
        ChainCell("packed", L["packed"]),
        ChainCell("padded-left", L["padded-left"]),
        ChainCell("padded-right", L["padded-right"]),
        ChainCell("permuted", L["permuted"]),
        ChainCell("decode/B1-short", L["packed"], samples="shortest", max_seqs=1),
        ChainCell("decode/B1-long", L["packed"], samples="longest", max_seqs=1, response_scale=3),
        ChainCell("decode/BN-varlen", L["micro-batched"]),
        ChainCell("decode/BN-padded", pad, max_seqs=3),
    ]


CELLS = tuple(c.name for c in cells_for(Workload(name="x", version=1, description="names only",
                                                   samples=({"prompt_len": 1, "response_len": 1},))))


def _weight(sid: int, pos: int) -> float:
    return random.Random(sid * 1_000_003 + pos).uniform(-1.0, 1.0)


def gradient_invariance(model, ops, seqs: Sequence[TrainSequence], layouts: dict[str, Layout], *, pad_id: int = 0,
                        temperature: float = 1.0) -> dict[str, Any]:
    """Per-token gradients w.r.t. the embedding output in every layout; raw-bit equal to the first."""
    emb = model.params["model.embed_tokens.weight"]
    was = emb.requires_grad
    emb.requires_grad_(True)
    per_layout: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    try:
        for name, lay in layouts.items():
            order = list(seqs)
            if lay.permute_seed is not None:
                random.Random(lay.permute_seed).shuffle(order)
            mb = lay.micro_batch or len(order)
            grads: dict[tuple[int, int], torch.Tensor] = {}
            for b in range(0, len(order), mb):
                group = order[b : b + mb]
                ids, pos, cu, tgt, offsets = layout_stream(group, lay, pad_id)
                keys: list = [None] * ids.shape[0]
                for s in group:
                    for p in range(len(s.tokens)):
                        keys[offsets[s.sample_id] + p] = (s.sample_id, p)
                with cap_mod.capture(retain_grad=True) as cap:
                    cap.set_rows(keys)
                    hidden = model.hidden_train(ids, pos, cu, ops)
                lp, _ = ops.lm_head_logprobs(hidden, model.lm_head_weight, tgt, temperature,
                                             token_chunk=lay.token_chunk, vocab_chunk=lay.vocab_chunk)
                u = torch.zeros_like(lp)
                for s in group:
                    o = offsets[s.sample_id]
                    for p in range(1, len(s.tokens)):
                        if s.loss_mask[p]:
                            u[o + p - 1] = _weight(s.sample_id, p)
                (lp * u).sum().backward()
                (rows, live), = cap.live
                for i, key in enumerate(rows):
                    if key is not None:
                        grads[key] = live.grad[i].detach().clone()
            per_layout[name] = grads
            emb.grad = None
    finally:
        emb.requires_grad_(was)
        emb.grad = None
    names = list(per_layout)
    base = per_layout[names[0]]
    results = []
    for name in names[1:]:
        other = per_layout[name]
        keys = sorted(set(base) & set(other))
        a = torch.stack([base[k] for k in keys])
        b = torch.stack([other[k] for k in keys])
        d = same_bits(b, a)
        results.append({"layout": name, "against": names[0], "tokens": len(keys), "equal": d.equal,
                        "mismatched_elements": d.mismatched, "max_abs_diff": d.max_abs_diff if not d.equal else 0.0})
    return {"layouts": names, "comparisons": results, "passed": all(r["equal"] for r in results) and bool(results)}


def run_cell(model, plan: Plan, w: Workload, cell: ChainCell, factory: ProviderFactory = default_factory,
             threads: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """One chain cell; ``threads`` = (rollout, train) torch intra-op threads (None: unchanged)."""
    reqs = requests_for(w, model.spec.vocab_size, cell.samples, cell.response_scale)
    full = sum(len(r.prompt) for r in reqs) + len(reqs)
    with intra_op_threads(threads[0]):
        samples, ex = rollout(model, factory(plan, "rollout"), w, reqs, max_seqs=cell.max_seqs,
                              prefill_chunk=max(len(r.prompt) for r in reqs) if cell.prefill_chunk == "full" else None,
                              max_step_tokens=full if cell.prefill_chunk == "full" else None)
    with intra_op_threads(threads[1]):
        scored = score(model, factory(plan, "train"), sequences_of(samples), cell.layout,
                       temperature=sampling_of(w).logprob_temperature, pad_id=w.pad_id)
    c = compare(align(samples, scored))
    return {"cell": cell.name, "layout": cell.layout.name, "rollout_steps": len(ex.batch_log),
            "max_sequences_per_step": max(len(s) for s in ex.batch_log), **c.as_dict()}


def run_chain(lw: LoadedWorkload, *, plan: str = "R/R", device: str = "cpu", factory: ProviderFactory = default_factory,
              cells: Sequence[str] | None = None, grads: bool = True, with_controls: bool = True,
              progress: Callable[[str, int, int], None] | None = None,
              rollout_threads: int | None = None, train_threads: int | None = None) -> dict[str, Any]:
    """Run the chain cells (all, or the named ones), the gradient-invariance check and the
    negative controls (a batch-dependent R norm must be caught forward and backward).

    ``rollout_threads`` / ``train_threads``: torch intra-op threads of each cell's rollout and
    train scoring (None: unchanged); the bits must not depend on them (``threads`` invariance)."""
    from rl_engine.utils.checks import nan_policy

    w = lw.workload
    p = Plan.parse(plan)
    all_cells = cells_for(w)
    if cells is not None:
        unknown = sorted(set(cells) - {c.name for c in all_cells})
        if unknown:
            raise ValueError(f"cells: unknown {unknown}; expected names from {[c.name for c in all_cells]}")
        all_cells = [c for c in all_cells if c.name in cells]
    model = build_model(w, device=device)
    out = []
    with nan_policy("propagate"):
        for k, cell in enumerate(all_cells):
            if progress:
                progress(f"chain {cell.name}", k, len(all_cells) + 1)
            with torch.no_grad():
                out.append(run_cell(model, p, w, cell, factory, (rollout_threads, train_threads)))
        grad = None
        if grads:
            if progress:
                progress("chain gradients", len(all_cells), len(all_cells) + 1)
            with torch.no_grad():
                samples, _ = rollout(model, factory(p, "rollout"), w, requests_for(w, model.spec.vocab_size))
            grad = gradient_invariance(model, factory(p, "train"), sequences_of(samples), train_layouts(w),
                                       pad_id=w.pad_id, temperature=sampling_of(w).logprob_temperature)
        controls = _negative_controls(model, w) if with_controls else []
    mism = sum(c["mismatched_tokens"] for c in out)
    return {
        "suite": "chain",
        "plan": p.label,
        "threads": {"rollout": rollout_threads or torch.get_num_threads(), "train": train_threads or torch.get_num_threads()},
        "cells": out,
        "compared_tokens": sum(c["compared_tokens"] for c in out),
        "mismatched_tokens": mism,
        "gradient_invariance": grad,
        "negative_controls": controls,
        "passed": all(c["passed"] for c in out) and (grad is None or grad["passed"]) and all(c["detected"] for c in controls),
    }


def _negative_controls(model, w: Workload) -> list[dict[str, Any]]:
    """A batch-dependent R norm (forward, then backward only) must be caught by the same checks;
    for a mixture-of-experts model also a batch-dependent R router (its routing) and a
    batch-dependent MoE backward."""
    rr = Plan.parse("R/R")
    cell = next(c for c in cells_for(w) if c.name == "packed")
    with torch.no_grad():
        samples, _ = rollout(model, ops_for(rr, "rollout"), w, requests_for(w, model.spec.vocab_size))
    lay = train_layouts(w)
    controls = []
    for module in ("norm", *(("moe",) if getattr(model.spec, "num_experts", 0) else ())):
        with torch.no_grad():
            fwd = run_cell(model, rr, w, cell, faulty_factory(module))
        bwd = gradient_invariance(model, faulty_factory(module, kind="backward")(rr, "train"), sequences_of(samples),
                                  {k: lay[k] for k in ("packed", "padded-left", "singleton")}, pad_id=w.pad_id,
                                  temperature=sampling_of(w).logprob_temperature)
        controls += [
            {"name": f"batch-dependent R {module} (forward)", "check": "train↔rollout raw bits, cell packed",
             "detected": not fwd["passed"], "mismatched_tokens": fwd["mismatched_tokens"]},
            {"name": f"batch-dependent R {module} (backward only)", "check": "gradient invariance across layouts",
             "detected": not bwd["passed"]},
        ]
    return controls
