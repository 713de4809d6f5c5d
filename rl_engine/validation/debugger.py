"""Consistency debugger: where do two sides first diverge for one sample?

Both sides run the same frozen tokens (prompt + the response sampled by an ``R/R`` rollout of
the workload) with every workload sample in the batch:

* side A — the **train path** of ``plan_a`` (teacher forcing, packed);
* side B — the **rollout path** of ``plan_b`` (chunked prefill, then one-token decode steps
  against KV caches, all samples co-batched, so decode batches change as prompts finish).

The model's capture points (:mod:`rl_engine.validation.capture`) record every stage —
embedding; per layer ``input_norm``, ``attention``, ``attn_proj``, ``post_attention_norm``,
for a mixture-of-experts layer ``router_logits``, ``routing`` (the experts each token chose)
and ``routing_weights``, then ``mlp``, ``residual``; ``final_norm``; then ``logits`` and
``logprob`` (of the next token) — for every token, keyed by ``(sample_id, position)``. Stages
are compared on raw bits in execution order; the first differing stage is reported with the
token position, the feature index and both values — for ``routing``, also the experts the token
chose on each side (``experts_a``, ``experts_b``, in rank order). Per-stage max ``|Δ|`` is kept
for the plot.

Outcomes: ``equal`` (exit 0), ``diverged`` (exit 1), ``not_comparable`` (exit 2: the sample is
missing, a stage was captured on one side only, or shapes differ).

An engine integration compares itself the same way: run its forward inside
``with capture() as cap`` after ``cap.set_rows(keys)`` and hand both captures to
:func:`compare_captures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_engine.workloads import LoadedWorkload
from rl_engine.engine.executor import Layout, layout_stream
from rl_engine.runtime.plan import Plan
from rl_engine.utils.bits import same_bits, int_view
from rl_engine.validation import capture as cap_mod
from rl_engine.validation.capture import LAYER_STAGES, ROUTING_STAGES
from rl_engine.validation.chain import build_model, requests_for, rollout, sampling_of, sequences_of
from rl_engine.validation.faults import ProviderFactory, default_factory

__all__ = ["stage_order", "compare_captures", "capture_train", "capture_rollout", "run_debug", "EXIT_CODES"]

EXIT_CODES = {"equal": 0, "diverged": 1, "not_comparable": 2}


def stage_order(num_layers: int, sparse_layers: Sequence[int] = ()) -> list[tuple[int, str]]:
    """``(layer, stage)`` in execution order; the layers in ``sparse_layers`` (mixture of experts)
    have the routing stages before ``mlp``."""
    sparse = set(sparse_layers)
    order = [(-1, "embedding")]
    for i in range(num_layers):
        for s in LAYER_STAGES:
            if s == "mlp" and i in sparse:
                order += [(i, r) for r in ROUTING_STAGES]
            order.append((i, s))
    return order + [(-1, "final_norm"), (-1, "logits"), (-1, "logprob")]


def _head(model, ops, hidden, keys, tokens: dict[int, Sequence[int]], temperature: float, fused: bool) -> None:
    """Tap logits and next-token log-probs of every keyed row."""
    W = model.lm_head_weight
    logits = ops.linear(hidden, W)
    cap_mod.tap(-1, "logits", logits)
    tgt = torch.tensor([tokens[k[0]][k[1] + 1] if k is not None and k[1] + 1 < len(tokens[k[0]]) else 0 for k in keys],
                       dtype=torch.int64, device=hidden.device)
    if fused:
        lp, _ = ops.lm_head_logprobs(hidden, W, tgt, temperature)
    else:
        lp = ops.token_logprobs(logits, tgt, temperature)
    cap_mod.tap(-1, "logprob", lp)


def capture_train(model, ops, seqs, *, temperature: float, pad_id: int = 0) -> cap_mod.Capture:
    ids, pos, cu, _, offsets = layout_stream(list(seqs), Layout("packed"), pad_id)
    keys: list = [None] * ids.shape[0]
    for s in seqs:
        for p in range(len(s.tokens)):
            keys[offsets[s.sample_id] + p] = (s.sample_id, p)
    tokens = {s.sample_id: s.tokens for s in seqs}
    with cap_mod.capture() as cap, torch.no_grad():
        cap.set_rows(keys)
        hidden = model.hidden_train(ids, pos, cu, ops)
        _head(model, ops, hidden, keys, tokens, temperature, fused=True)
    return cap


def capture_rollout(model, ops, seqs, *, temperature: float, prefill_chunk: int, prompt_lens: dict[int, int]) -> cap_mod.Capture:
    """Replay the sequences on the rollout path: chunked prefill of each prompt, then decode."""
    seqs = list(seqs)
    tokens = {s.sample_id: s.tokens for s in seqs}
    caches = model.new_kv_caches(ops, len(seqs), max(len(s.tokens) for s in seqs))
    fed = {s.sample_id: 0 for s in seqs}
    slot = {s.sample_id: i for i, s in enumerate(seqs)}
    with cap_mod.capture() as cap, torch.no_grad():
        while any(fed[s.sample_id] < len(s.tokens) for s in seqs):
            ids, pos, cu, slots, keys = [], [], [0], [], []
            for s in seqs:
                sid, f = s.sample_id, fed[s.sample_id]
                if f >= len(s.tokens):
                    continue
                n = min(prefill_chunk, prompt_lens[sid] - f) if f < prompt_lens[sid] else 1
                ids += list(s.tokens[f : f + n])
                pos += list(range(f, f + n))
                keys += [(sid, p) for p in range(f, f + n)]
                cu.append(cu[-1] + n)
                slots.append(slot[sid])
                fed[sid] = f + n
            cap.set_rows(keys)
            t = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt, device=model.device)  # noqa: E731
            hidden = model.hidden_cached(t(ids), t(pos), caches, t(slots), t(cu, torch.int32), ops)
            _head(model, ops, hidden, keys, tokens, temperature, fused=False)
    return cap


def _bits(x: torch.Tensor) -> str:
    """The raw bit pattern of one element, as hex of its width (``0x3f800000``, bf16 ``0x3f80``)."""
    width = x.element_size() * 8
    return f"0x{int(int_view(x.reshape(1))[0]) & ((1 << width) - 1):0{width // 4}x}"


def compare_captures(a: cap_mod.Capture, b: cap_mod.Capture, sample_id: int, num_layers: int) -> dict[str, Any]:
    """Raw-bit comparison of one sample's stages on two captures (see module docstring)."""
    sa, sb = a.sample_stages(sample_id), b.sample_stages(sample_id)
    stages = []
    first = None
    reason = ""
    for layer, stage in stage_order(num_layers, range(num_layers)):  # stages neither side captured are skipped
        ra, rb = sa.get((layer, stage)), sb.get((layer, stage))
        if not ra or not rb:
            if ra or rb:
                reason = reason or f"stage {stage} (layer {layer}) captured on one side only"
            continue
        positions = sorted(set(ra) & set(rb))
        if not positions:
            reason = reason or f"stage {stage} (layer {layer}) has no common token"
            continue
        xa = torch.stack([ra[p].reshape(-1) for p in positions])
        xb = torch.stack([rb[p].reshape(-1) for p in positions])
        if xa.shape != xb.shape or xa.dtype != xb.dtype:
            reason = reason or f"stage {stage} (layer {layer}): shapes/dtypes differ {tuple(xa.shape)} vs {tuple(xb.shape)}"
            continue
        d = same_bits(xa, xb)
        entry = {"layer": layer, "stage": stage, "tokens": len(positions), "equal": d.equal,
                 "mismatched": d.mismatched, "max_abs_diff": 0.0 if d.equal else d.max_abs_diff}
        stages.append(entry)
        if not d.equal and first is None:
            ti, fi = d.first_index
            first = {"layer": layer, "stage": stage, "position": positions[ti], "feature": fi,
                     "side_a": d.first_values[0], "side_b": d.first_values[1],
                     "side_a_bits": _bits(xa[ti, fi]), "side_b_bits": _bits(xb[ti, fi])}
            if stage == "routing":
                first["experts_a"], first["experts_b"] = xa[ti].tolist(), xb[ti].tolist()
    if not stages:
        outcome = "not_comparable"
        reason = reason or f"sample {sample_id} was not captured on both sides"
    elif reason:
        outcome = "not_comparable"
    else:
        outcome = "diverged" if first is not None else "equal"
    return {"outcome": outcome, "first_divergence": first, "stages": stages, "reason": reason}


def run_debug(lw: LoadedWorkload, *, sample: int = 0, plan_a: str = "R/R", plan_b: str | None = None,
              device: str = "cpu", factory: ProviderFactory = default_factory) -> dict[str, Any]:
    """Train side of ``plan_a`` vs rollout side of ``plan_b`` (default: the same plan) for one sample."""
    from rl_engine.utils.checks import nan_policy

    w = lw.workload
    pa, pb = Plan.parse(plan_a), Plan.parse(plan_b or plan_a)
    model = build_model(w, device=device)
    T = sampling_of(w).logprob_temperature
    with nan_policy("propagate"), torch.no_grad():
        samples, _ = rollout(model, default_factory(Plan.parse("R/R"), "rollout"), w, requests_for(w, model.spec.vocab_size))
        seqs = sequences_of(samples)
        if sample not in samples:
            res = {"outcome": "not_comparable", "first_divergence": None, "stages": [],
                   "reason": f"sample {sample} is not in the workload (samples 0..{len(samples) - 1})"}
        else:
            ca = capture_train(model, factory(pa, "train"), seqs, temperature=T, pad_id=w.pad_id)
            cb = capture_rollout(model, factory(pb, "rollout"), seqs, temperature=T, prefill_chunk=w.chunks.prefill_chunk,
                                 prompt_lens={s.sample_id: len(s.prompt) for s in samples.values()})
            res = compare_captures(ca, cb, sample, model.spec.num_hidden_layers)
    spec = model.spec
    sparse = [i for i in range(spec.num_hidden_layers) if hasattr(spec, "is_sparse") and spec.is_sparse(i)]
    return {"suite": "debug", "sample": sample, "side_a": {"path": "train", "plan": pa.label},
            "side_b": {"path": "rollout", "plan": pb.label}, "num_layers": spec.num_hidden_layers,
            "sparse_layers": sparse, **res,
            "passed": res["outcome"] == "equal"}
