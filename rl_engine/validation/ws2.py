"""WS2 suite: the Qwen3 model trained at every TP × DP layout, raw bits against one process.

One rollout (rank 0's single process, plan R/R: chunked prefill, decode over KV caches) samples
the workload's prompts; every layout then scores the same sequences and back-propagates a fixed
per-token loss, over ``G`` micro-batches (one sequence each) reduced by
:class:`~rl_engine.distributed.data_parallel.TreeGradReducer`:

* the **reference**: one process, no ``torch.distributed``, the train side's operators;
* every layout ``(tp, dp)`` of ``--tp`` × ``--dp``: the model sharded by
  :func:`~rl_engine.distributed.qwen3.shard_qwen3` (row-parallel scheme ``full_k``; the largest
  TP also with ``auto``, the cheaper scheme per layer: ``exact_k`` on the CPU for float32 or
  ``K > 2N``), DP rank ``d`` running its block of micro-batches.

Per layout: every active token's log-prob (against the reference and against the rollout's
reported value), every stage of every layer of the forward (``embedding`` … ``final_norm``,
the TP-sharded ``attention`` stage gathered over the TP ranks), with the **first divergence**
in execution order (layer, stage, sample, position, feature), and every parameter's gradient
(TP shards gathered). All must be raw-bit equal.

**Negative controls**, which must be detected: the ``native`` row-parallel scheme (rounded
K-shard partials all-reduced by the backend) at the largest TP, held against the reference; the
native DP reduction (autograd's running gradient sum over a rank's micro-batches, then the
backend's all-reduce) at the largest DP, held against the same native reduction in one process.
A control whose size is 1 cannot differ and is reported ``n.a.``.

All ranks run in one world of ``max(tp · dp)`` processes (gloo), started by
:func:`rl_engine.distributed.launch.spawn`; a layout runs on the first ``tp · dp`` ranks (TP
groups of consecutive ranks, DP groups across them).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl_engine.utils.bits import same_bits
from rl_engine.workloads import LoadedWorkload, Workload

__all__ = ["run_ws2", "parse_sizes", "layouts_for", "LAYER_ORDER"]

#: Stages in execution order (model-level ones at layer -1: embedding first, final_norm last).
LAYER_ORDER = ("input_norm", "attention", "attn_proj", "post_attention_norm", "mlp", "residual")


def parse_sizes(text: str, name: str) -> tuple[int, ...]:
    """``"1,2,4"`` → ``(1, 2, 4)``; each a power of two in [1, 8] (``ValueError`` naming ``name``)."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers such as 1,2,4, got {text!r}") from None
    if not sizes or any(s < 1 or s > 8 or s & (s - 1) for s in sizes):
        raise ValueError(f"{name}: expected powers of two in [1, 8], got {text!r}")
    return sizes


def layouts_for(tps: Sequence[int], dps: Sequence[int]) -> list[dict[str, Any]]:
    """Every ``(tp, dp)`` layout, plus the per-layer choice ``auto`` at the largest TP > 1 (and DP 1)."""
    out = [{"tp": t, "dp": d, "row_scheme": "full_k"} for t in tps for d in dps]
    if max(tps) > 1:
        out.append({"tp": max(tps), "dp": 1, "row_scheme": "auto"})
    return out


def _name(lay: dict[str, Any]) -> str:
    return f"tp{lay['tp']}-dp{lay['dp']}" + ("" if lay["row_scheme"] == "full_k" else f" ({lay['row_scheme']})")


def _weight(sid: int, pos: int) -> float:
    return random.Random(sid * 1_000_003 + pos).uniform(-1.0, 1.0)


def _build_model(w: Workload):
    from rl_engine.validation.chain import build_model

    return build_model(w)


def _score_microbatch(model, ops, seq: dict[str, Any]):
    """Log-probs, stage records and loss of one sequence (one micro-batch), packed layout."""
    from rl_engine.engine.executor import Layout, TrainSequence, layout_stream
    from rl_engine.validation.capture import capture

    ts = TrainSequence(seq["sample_id"], tuple(seq["tokens"]), tuple(seq["loss_mask"]))
    ids, pos, cu, tgt, offsets = layout_stream([ts], Layout("packed"), 0)
    sid = ts.sample_id
    keys = [(sid, p) for p in range(len(ts.tokens))]
    with capture() as cap:
        cap.set_rows(keys)
        hidden = model.hidden_train(ids, pos, cu, ops)
    lp, _ = ops.lm_head_logprobs(hidden, model.lm_head_weight, tgt)
    u = torch.zeros_like(lp)
    for p in range(1, len(ts.tokens)):
        if ts.loss_mask[p]:
            u[p - 1] = _weight(sid, p)
    logprobs = {(sid, p): lp[p - 1].detach().clone() for p in range(1, len(ts.tokens)) if ts.loss_mask[p]}
    return logprobs, cap.records, (lp * u).sum()


def _run_layout(model, ops, seqs, red, *, tp_group=None, native_dp=None) -> dict[str, Any]:
    """Score this DP rank's micro-batches, accumulate; returns log-probs and stages by key."""
    from rl_engine.distributed.qwen3 import SHARDED_STAGES

    logprobs: dict = {}
    stages: dict = {}
    for j in red.microbatches():
        lps, records, loss = _score_microbatch(model, ops, seqs[j])
        loss.backward()
        if native_dp is None:
            red.accumulate()
        logprobs.update(lps)
        for rec in records:
            v = rec.value
            if rec.stage in SHARDED_STAGES and tp_group is not None:
                v = tp_group.all_gather(v.contiguous(), dim=-1)
            slot = stages.setdefault((rec.layer, rec.stage), {})
            for i, key in enumerate(rec.rows):
                slot[key] = v[i].clone()
    if native_dp is None:
        red.finish()
    return {"logprobs": logprobs, "stages": stages}


def _rank(world, w: Workload, seqs: list[dict[str, Any]], layouts: list[dict[str, Any]], controls: list[dict[str, Any]]):
    """One rank of the WS2 world: every layout and control it takes part in (rank function of spawn)."""
    from rl_engine.distributed.data_parallel import TreeGradReducer
    from rl_engine.distributed.qwen3 import TensorParallelOps, shard_qwen3, unshard_qwen3
    from rl_engine.engine import ops_for
    from rl_engine.runtime.plan import Plan

    base = ops_for(Plan.parse("R/R"), "train")
    full = _build_model(w)
    G = len(seqs)
    out = []
    for lay in [*layouts, *controls]:
        tp, dp, scheme = lay["tp"], lay["dp"], lay["row_scheme"]
        n = tp * dp
        # every rank takes part in creating the groups (new_group is collective over the world)
        tp_group = world.subgroups([list(range(d * tp, (d + 1) * tp)) for d in range(dp)])
        dp_group = world.subgroups([[d * tp + t for d in range(dp)] for t in range(tp)])
        if world.rank >= n:
            out.append(None)
            continue
        local, layout = shard_qwen3(full, tp, tp_group.rank, row_scheme=scheme)
        local.requires_grad_(True)
        ops = TensorParallelOps(base, local, layout, tp_group)
        native_dp = lay.get("native_dp")
        red = TreeGradReducer(list(local.params.values()), num_microbatches=G, group=dp_group)
        res = _run_layout(local, ops, seqs, red, tp_group=tp_group, native_dp=native_dp)
        if native_dp:
            for q in local.params.values():  # autograd's running sums, then the backend's all-reduce
                q.grad = dp_group.all_reduce_native(q.grad)
        grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in local.params.items()}
        grads = unshard_qwen3(grads, full.spec, layout, tp_group)
        # every DP rank's log-probs and stages; gradients from the first rank of the layout
        res["grads"] = grads if world.rank == 0 else None
        out.append(res)
    return out


def _reference(w: Workload, seqs: list[dict[str, Any]], *, native_dp: bool = False) -> dict[str, Any]:
    """One process, no ``torch.distributed``: the tree over micro-batches, or (``native_dp``)
    autograd's running sum over them — the native DP = 1 the native DP control is held against."""
    from rl_engine.distributed.data_parallel import TreeGradReducer
    from rl_engine.engine import ops_for
    from rl_engine.runtime.plan import Plan

    model = _build_model(w).requires_grad_(True)
    red = TreeGradReducer(list(model.params.values()), num_microbatches=len(seqs))
    res = _run_layout(model, ops_for(Plan.parse("R/R"), "train"), seqs, red, native_dp=native_dp or None)
    res["grads"] = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in model.params.items()}
    return res


def _rollout(w: Workload) -> list[dict[str, Any]]:
    """The workload's prompts sampled by the single-process rollout (plan R/R); one entry per
    sample: tokens, loss mask (response tokens) and the rollout's log-prob bits per response token."""
    from rl_engine.engine import ops_for
    from rl_engine.runtime.plan import Plan
    from rl_engine.validation.chain import requests_for, rollout

    model = _build_model(w)
    reqs = requests_for(w, model.spec.vocab_size)
    samples, _ = rollout(model, ops_for(Plan.parse("R/R"), "rollout"), w, reqs)
    out = []
    for sid in sorted(samples):
        s = samples[sid]
        if s.kept and s.filtered_tokens():
            raise ValueError("workload: WS2 scores the full distribution; sample with top_k = 0 and top_p = 1")
        toks = list(s.tokens)
        out.append({"sample_id": sid, "tokens": toks, "loss_mask": [0] * len(s.prompt) + [1] * len(s.response),
                    "rollout_logprobs": {(sid, len(s.prompt) + i): lp.detach().clone() for i, lp in enumerate(s.logprobs)}})
    return out


def _compare_logprobs(got: dict, ref: dict) -> dict[str, Any]:
    keys = sorted(ref)
    missing = [k for k in keys if k not in got]
    if missing:
        return {"compared": 0, "mismatched": len(keys), "max_abs_diff": float("inf"), "missing": len(missing)}
    a = torch.stack([got[k] for k in keys])
    b = torch.stack([ref[k] for k in keys])
    d = same_bits(a, b)
    return {"compared": len(keys), "mismatched": d.mismatched, "max_abs_diff": 0.0 if d.equal else d.max_abs_diff}


def _stage_order(key: tuple[int, str]) -> tuple[int, int]:
    layer, stage = key
    if stage == "embedding":
        return (-1, 0)
    if stage == "final_norm":
        return (1 << 20, 0)
    return (layer, LAYER_ORDER.index(stage) if stage in LAYER_ORDER else len(LAYER_ORDER))


def _compare_stages(got: dict, ref: dict) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    rows, first = [], None
    for key in sorted(ref, key=_stage_order):
        r, g = ref[key], got.get(key, {})
        toks = sorted(r)
        if any(t not in g for t in toks):
            rows.append({"layer": key[0], "stage": key[1], "tokens": len(toks), "equal": False, "max_abs_diff": float("inf")})
            first = first or {"layer": key[0], "stage": key[1], "reason": "stage or token missing"}
            continue
        a = torch.stack([g[t] for t in toks])
        b = torch.stack([r[t] for t in toks])
        d = same_bits(a, b)
        rows.append({"layer": key[0], "stage": key[1], "tokens": len(toks), "equal": d.equal,
                     "max_abs_diff": 0.0 if d.equal else d.max_abs_diff})
        if not d.equal and first is None:
            ti, feat = d.first_index[0], (d.first_index[1] if len(d.first_index) > 1 else 0)
            sid, position = toks[ti]
            first = {"layer": key[0], "stage": key[1], "sample": sid, "position": position, "feature": feat,
                     "reference": float(b[ti].reshape(-1)[feat]), "layout": float(a[ti].reshape(-1)[feat])}
    return rows, first


def _compare_grads(got: dict, ref: dict) -> dict[str, Any]:
    bad = [k for k in sorted(ref) if k not in got or not same_bits(got[k], ref[k])]
    return {"parameters": len(ref), "mismatched": bad, "passed": not bad}


def run_ws2(lw: LoadedWorkload, *, tp: Sequence[int] = (1, 2, 4), dp: Sequence[int] = (1, 2), device: str = "cpu",
            progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the WS2 suite of workload ``lw`` at the TP sizes ``tp`` and DP sizes ``dp``.

    Raises:
        ValueError: a device other than the CPU (gloo), a layout larger than
            :data:`~rl_engine.distributed.launch.MAX_LOCAL_WORLD` ranks, a model that does not
            shard at a requested TP, or micro-batches that do not split over a requested DP.
    """
    from rl_engine.distributed.algorithms.tree import check_blocks
    from rl_engine.distributed.launch import MAX_LOCAL_WORLD, spawn
    from rl_engine.distributed.qwen3 import shard_qwen3

    if device != "cpu":
        raise ValueError(f"device: the WS2 suite runs its ranks on gloo (cpu); got {device!r}")
    w = lw.workload
    tps, dps = tuple(sorted(set(tp))), tuple(sorted(set(dp)))
    layouts = layouts_for(tps, dps)
    controls = []
    if max(tps) > 1:
        controls.append({"tp": max(tps), "dp": 1, "row_scheme": "native", "control": "tp"})
    if max(dps) > 1:
        controls.append({"tp": 1, "dp": max(dps), "row_scheme": "full_k", "native_dp": True, "control": "dp"})
    world = max(lay["tp"] * lay["dp"] for lay in [*layouts, *controls])
    if world > MAX_LOCAL_WORLD:
        raise ValueError(f"tp, dp: the largest layout needs {world} ranks; at most {MAX_LOCAL_WORLD} run on one host")
    model = _build_model(w)
    for t in tps:
        shard_qwen3(model, t, 0)  # raises with the dimension that does not divide
    if progress:
        progress("ws2 rollout", 0, 4)
    seqs = _rollout(w)
    for d in dps:
        check_blocks(len(seqs), d, name=f"dp={d} (micro-batches: one per sample, {len(seqs)} samples)")
    if progress:
        progress("ws2 reference (one process)", 1, 4)
    ref = _reference(w, seqs)
    rollout_lp = {k: v for s in seqs for k, v in s["rollout_logprobs"].items()}
    if progress:
        progress(f"ws2 layouts ({world} ranks)", 2, 4)
    ranks = spawn(_rank, world, w, [{k: v for k, v in s.items() if k != "rollout_logprobs"} for s in seqs], layouts, controls)
    if progress:
        progress("ws2 compare", 3, 4)

    def gather(i: int) -> dict[str, Any]:
        lp, st = {}, {}
        for r in ranks:
            res = r[i]
            if res is None:
                continue
            lp.update(res["logprobs"])
            for key, slot in res["stages"].items():
                st.setdefault(key, {}).update(slot)
        return {"logprobs": lp, "stages": st, "grads": ranks[0][i]["grads"]}

    results = []
    for i, lay in enumerate(layouts):
        got = gather(i)
        stages, first = _compare_stages(got["stages"], ref["stages"])
        lpr = _compare_logprobs(got["logprobs"], ref["logprobs"])
        vs_rollout = _compare_logprobs(got["logprobs"], rollout_lp)
        grads = _compare_grads(got["grads"], ref["grads"])
        ok = lpr["mismatched"] == 0 and vs_rollout["mismatched"] == 0 and first is None and grads["passed"]
        results.append({"layout": _name(lay), **lay, "logprobs": lpr, "logprobs_vs_rollout": vs_rollout,
                        "stages": stages, "first_divergence": first, "gradients": grads, "passed": ok})
    detected = []
    for j, c in enumerate(controls):
        got = gather(len(layouts) + j)
        stages, first = _compare_stages(got["stages"], ref["stages"])
        grads = _compare_grads(got["grads"], ref["grads"])
        if c["control"] == "tp":
            name = f"native row-parallel K-shard all-reduce (TP={c['tp']})"
            hit = first is not None
            detail = (f"first divergence: layer {first['layer']} {first['stage']}" if first else "no divergence found")
        else:  # held against the native reduction in one process (autograd's running sum)
            grads = _compare_grads(got["grads"], _reference(w, seqs, native_dp=True)["grads"])
            name = f"native DP gradient all-reduce (DP={c['dp']})"
            hit = not grads["passed"]
            detail = f"{len(grads['mismatched'])} of {grads['parameters']} gradients differ from native DP = 1"
        detected.append({"name": name, "detected": hit, "detail": detail, "first_divergence": first})
    for c in ("tp", "dp"):
        if not any(x["control"] == c for x in controls):
            detected.append({"name": f"native {'row-parallel' if c == 'tp' else 'DP'} reduction", "detected": None,
                             "detail": f"n.a.: every requested {c.upper()} size is 1", "first_divergence": None})
    ref_vs_rollout = _compare_logprobs(ref["logprobs"], rollout_lp)
    passed = (all(r["passed"] for r in results) and ref_vs_rollout["mismatched"] == 0
              and all(c["detected"] is not False for c in detected))
    if progress:
        progress("ws2 done", 4, 4)
    return {"suite": "ws2", "tp": list(tps), "dp": list(dps), "world": world, "model": w.model.model_dump(),
            "samples": len(seqs), "microbatches": len(seqs),
            "reference_vs_rollout": ref_vs_rollout, "layouts": results, "negative_controls": detected,
            "passed": passed}
