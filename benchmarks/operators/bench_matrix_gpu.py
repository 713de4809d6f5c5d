"""Benchmark matrix through the public API: GEMM, attention (training prefill and rollout decode)
and the fused LM head, each against its fastest non-invariant baseline in the same run.

Every point calls what users call — ``rl_engine.ops.gemm.linear``,
``rl_engine.ops.attention.varlen_attention`` (forward, and forward + backward),
``cached_attention_step`` over a :class:`~rl_engine.ops.attention.ContiguousKVCache`,
``paged_attention_step`` over an engine-owned cache of 16-token pages, and
``rl_engine.ops.logprob.linear_token_logprobs`` — under the default NaN policy, and times it
against its baselines round-robin in one process:

======================  =====================================================================
family                  baselines (the row's ``baseline`` is the fastest one timed at the point)
======================  =====================================================================
``gemm``                ``torch.F.linear`` (cuBLAS on CUDA)
``attention``           ``torch.sdpa`` (causal ``F.scaled_dot_product_attention`` with
                        ``enable_gqa``; one batched call per sequence length of the mix, on
                        ``[b, H, S, D]`` copies made outside the timing: the layout it is
                        fastest in) and ``flash_attn.varlen`` when ``flash_attn`` imports
``decode``              the whole step, as ours does it: the new token's key and value
                        written into the cache, then attention over it. Contiguous:
                        ``torch.append+sdpa`` (two in-place copies into ``[B, H, ctx, D]``
                        caches, then SDPA); paged: ``torch.append+gather+sdpa`` (two
                        ``index_copy_`` into the pages, the step's pages gathered, then SDPA);
                        ``flash_attn.with_kvcache`` (append and attention in one kernel) when
                        ``flash_attn`` imports and takes the layout
``lmhead``              ``naive`` (``F.linear`` → ``log_softmax`` in fp32 → ``gather``), and
                        for forward + backward ``liger.flce`` (Liger-Kernel's fused linear
                        cross-entropy, ``reduction="none"``) when ``liger_kernel`` imports
======================  =====================================================================

Axes (``--list`` prints the points): the GEMM shapes of every Qwen3 dense preset (qkv,
o_proj, gate_up, down), Llama-3-8B's MLP and LM head widths (vocabulary 128,256) and ragged
shapes (N and K not multiples of 16), at M ∈ {1, 16, 64, 256, 1024, 4096, 16384}; attention heads
of the Qwen3 presets and Qwen3-30B-A3B (GQA ratios 2, 4, 5, 8), one MHA (ratio 1) and head_dim 64
and 256, over prefill mixes 4×4096, 1×16384 and a ragged mix of 16,384 tokens, forward and
forward + backward; decode of batch ∈ {1, 8, 32, 128} × context ∈ {1k, 8k, 32k}, contiguous and
16-token pages; the fused LM head at T ∈ {1024, 4096, 16384}, forward and forward + backward with
peak memory. ``--quick`` is a subset (78 points) that runs in about three minutes on an H200.

Timing: modes ``graph`` (each candidate captured ``calls`` times in a CUDA graph, the graphs
replayed round-robin: :func:`benchmarks.common.harness.cuda_graphs_interleaved_ms`; device time)
and ``eager`` (host-synchronised loops of ``calls`` calls, round-robin:
:func:`~benchmarks.common.harness.measure_interleaved`; what a caller without graphs sees, host
checks included). Warm-up calls (compilation included) are excluded; rows report the median,
p20 and p80 of ``--repeats`` samples, per call. GEMM inputs rotate over enough clones of ``x`` and
``w`` that one pass exceeds three L2 sizes (the clones hold the same values, so every call
returns the same bits). A candidate that synchronises with the host cannot be captured; its graph
row carries ``error`` with the reason (found by one call under
``torch.cuda.set_sync_debug_mode("error")``).

Each row is a harness row (:func:`~benchmarks.common.harness.make_row`) plus ``family``,
``case``, ``preset``, ``mode``, ``role`` (``ours`` or ``baseline``), ``ratio_vs_baseline``
(median / the baseline's), ``throughput_ratio`` (its inverse), ``metric``, ``achieved``,
``target``, ``target_goal``, ``target_limit``, ``met``, ``within_limit`` and ``bits``: the first
16 hex digits of the sha256 of the raw bytes of the candidate's output (its gradients appended
for forward + backward), taken from the call the timing made last (for ``graph``, the replayed
graph's output). Two trees are compared on bits and time by
``tools/benchmarking/matrix_gate_gpu.py``.

Targets (``TARGETS``): GEMM time ≤ 1.05× cuBLAS (none above 1.10×; ragged shapes ≤ 1.25×);
training-path attention, forward and forward + backward, ≥ 0.90× the baseline's throughput
(none below 0.85×); decode ≥ 0.90×; fused LM head forward ≤ 0.8× the naive time, forward +
backward ≤ 0.9× Liger's time at no more than Liger's peak memory.

Usage::

    python benchmarks/operators/bench_matrix_gpu.py --quick --out bench_matrix_gpu.json
    python benchmarks/operators/bench_matrix_gpu.py --families gemm --presets qwen3-8b,ragged --ms 1,4096 --out g.json
    python benchmarks/operators/bench_matrix_gpu.py --families decode --max-seconds 500 --out d.json
    python benchmarks/operators/bench_matrix_gpu.py --device cpu --tiny --out /tmp/m.json   # dry run, seconds
    python benchmarks/operators/bench_matrix_gpu.py --list --quick                          # the points only
    # one missed point under Nsight Compute: one call of ours and of each baseline, each kernel
    # named "<case> | <side>" (tools/benchmarking/matrix_ncu.py runs the record's misses this way)
    ncu --profile-from-start off --nvtx --print-nvtx-rename kernel --set full -o miss \
        python benchmarks/operators/bench_matrix_gpu.py --profile --cases 'qwen3-8b.down K=12288 N=4096 M=64'

The report (``--out``) is rewritten after every point (``meta.partial`` until the run ends), so a
run cut by ``--max-seconds`` — which starts no point once the budget is spent — or by a time limit
keeps the points it finished. Copied to ``reports/gpu/<platform>/matrix.json`` it is the matrix
of record that ``benchmarks/common/gpu_docs.py`` renders.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import hashlib
import itertools
import math
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: the repository root holds the harness
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common.harness import (SCHEMA_VERSION, Stats, cuda_graphs_interleaved_ms, device_info,  # noqa: E402
                                      machine_load, make_row, measure_interleaved, peak_memory, summarize,
                                      versions)

BENCHMARK = "bench_matrix_gpu"
#: keys every matrix row has beside the harness's ``ROW_KEYS`` (tests/benchmarks freeze them)
MATRIX_KEYS = ("family", "case", "preset", "mode", "role", "ratio_vs_baseline", "throughput_ratio", "metric",
               "achieved", "target", "target_goal", "target_limit", "met", "within_limit", "bits", "error",
               "served_by", "calls", "timing", "unavailable", "not_capturable", "call")
FAMILIES = ("gemm", "attention", "decode", "lmhead")
MODES = ("graph", "eager")
MS = (1, 16, 64, 256, 1024, 4096, 16384)
DECODE_BATCH = (1, 8, 32, 128)
DECODE_CTX = (1024, 8192, 32768)
LMHEAD_TOKENS = (1024, 4096, 16384)
L2_BYTES = 60 * 2**20  # H100/H200: 50 / 60 MiB
PAGE = 16
#: prefill mixes: sequence lengths of one packed batch (16,384 tokens each); the ragged one has
#: no length that is a multiple of 16
PREFILL_MIXES: dict[str, tuple[int, ...]] = {
    "4x4096": (4096,) * 4,
    "1x16384": (16384,),
    "ragged6": (3001, 517, 1999, 6007, 77, 4783),
}
#: Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): not an rl_engine preset
LLAMA3_8B = {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 128256}
#: ragged GEMM shapes (K, N): N and K not multiples of 16 (K = 3000 still keeps 16-byte rows in bf16)
RAGGED_GEMM = {"ragged.k3000_n5003": (3000, 5003), "ragged.k4096_n5003": (4096, 5003),
               "ragged.k3000_n4096": (3000, 4096)}
#: attention heads beyond the presets': (Hq, Hkv, D)
EXTRA_HEADS = {"mha16": (16, 16, 128), "d64": (32, 8, 64), "d256": (16, 4, 256)}

# --quick: a subset that runs in about three minutes on an H200 (both modes, compilation included)
QUICK = {
    "gemm_presets": ("qwen3-0.6b", "qwen3-8b", "qwen3-32b", "llama-3-8b", "ragged"), "ms": (1, 64, 4096),
    "attention_heads": ("qwen3-8b", "qwen3-30b-a3b"), "mixes": ("4x4096", "ragged6"),
    "decode_heads": ("qwen3-8b",), "decode_batch": (1, 32, 128), "decode_ctx": (1024, 32768),
    "lmhead_models": ("qwen3-8b", "llama-3-8b"), "lmhead_tokens": (4096,),
}


@dataclass(frozen=True)
class Target:
    """A point's target: ``metric`` (``time_ratio``: lower is better, ``throughput_ratio``:
    higher is better) against ``goal``; ``limit``: the bound no point of the family may cross;
    ``memory``: also at most the baseline's peak memory."""

    metric: str
    goal: float
    limit: float
    text: str
    memory: bool = False

    def met(self, value: float) -> bool:
        return value <= self.goal if self.metric == "time_ratio" else value >= self.goal

    def within_limit(self, value: float) -> bool:
        return value <= self.limit if self.metric == "time_ratio" else value >= self.limit


TARGETS: dict[str, Target] = {
    "gemm": Target("time_ratio", 1.05, 1.10, "time <= 1.05x cuBLAS (none above 1.10x)"),
    "gemm_ragged": Target("time_ratio", 1.25, 1.25, "time <= 1.25x cuBLAS (ragged N, K)"),
    "attention": Target("throughput_ratio", 0.90, 0.85, "throughput >= 0.90x baseline (none below 0.85x)"),
    "decode": Target("throughput_ratio", 0.90, 0.90, "throughput >= 0.90x baseline"),
    "lmhead_forward": Target("time_ratio", 0.80, 0.80, "time <= 0.8x naive"),
    "lmhead_forward_backward": Target("time_ratio", 0.90, 0.90, "time <= 0.9x Liger, peak memory <= Liger's",
                                      memory=True),
}


@dataclass
class Env:
    """What every point is built with."""

    device: str
    dtype: torch.dtype
    tiny: bool
    repeats: int
    warmup: int


@dataclass
class Built:
    """A point's callables: ``ours`` (one public-API call) and its ``baselines``; ``unavailable``:
    baselines that could not be set up, with the reason; ``calls``: calls per timed sample."""

    ours: tuple[str, Callable[[], Any]]
    baselines: dict[str, Callable[[], Any]]
    unavailable: dict[str, str] = field(default_factory=dict)
    calls: int = 1
    work: dict[str, float] = field(default_factory=dict)  # {"flop": ...} or {"bytes": ...}
    note: str | None = None


@dataclass(frozen=True)
class Point:
    family: str
    case: str
    preset: str
    op: str
    impl: str  # ours: the public entry point timed
    config: Mapping[str, Any]
    target_key: str
    build: Callable[[Env], Built]
    target_baseline: str | None = None  # None: the fastest baseline timed at the point


# ----------------------------------------------------------------------------- inputs


def _seed(case: str) -> int:
    """The same inputs for the same point, whatever else runs (filters, order, tree)."""
    return zlib.crc32(case.encode())


def _gen(env: Env, case: str) -> torch.Generator:
    return torch.Generator(device=env.device).manual_seed(_seed(case))


def _randn(shape, g: torch.Generator, env: Env, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = torch.randn(shape, generator=g, device=env.device)
    if scale != 1.0:
        t = t * scale
    return t.to(dtype or env.dtype)


def _rotating(fn: Callable[..., Any], inputs: Sequence[tuple]) -> Callable[[], Any]:
    """``fn(*inputs[i])`` with ``i`` cycling over the copies, one per call."""
    counter = itertools.count()
    n = len(inputs)
    return lambda: fn(*inputs[next(counter) % n])


def _calls(env: Env, seconds: float) -> int:
    """Calls per timed sample: enough for about a millisecond of work (one on the CPU)."""
    if env.device == "cpu" or env.tiny:
        return 1
    return max(1, min(20, round(1e-3 / max(seconds, 1e-7))))


def _flash_attn():
    """``(module, None)`` or ``(None, reason)``."""
    try:
        import flash_attn
    except Exception as exc:  # noqa: BLE001 - any import failure is recorded, not raised
        return None, f"flash_attn not importable: {type(exc).__name__}: {exc}"
    return flash_attn, None


def _liger():
    """``(LigerFusedLinearCrossEntropyLoss, None)`` or ``(None, reason)``."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001
        return None, f"liger_kernel not importable: {type(exc).__name__}: {exc}"
    return LigerFusedLinearCrossEntropyLoss, None


def _package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


# ----------------------------------------------------------------------------- GEMM


def _gemm_build(case: str, M: int, K: int, N: int) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from rl_engine.ops import gemm

        g = _gen(env, case)
        x = _randn((M, K), g, env)
        w = _randn((N, K), g, env, scale=K**-0.5)
        per = (M * K + N * K) * x.element_size()
        copies = 1 if env.device == "cpu" else max(1, min(8, math.ceil(3 * L2_BYTES / per)))
        inputs = [(x, w)] + [(x.clone(), w.clone()) for _ in range(copies - 1)]
        flop = 2.0 * M * K * N
        return Built(ours=("rlk.ops.gemm.linear", _rotating(gemm.linear, inputs)),
                     baselines={"torch.F.linear": _rotating(F.linear, inputs)},
                     calls=_calls(env, flop / 600e12 + (per + M * N * 2) / 4e12), work={"flop": flop},
                     note=f"inputs rotate over {copies} copies")

    return build


def _gemm_shapes(spec) -> dict[str, tuple[int, int]]:
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o_proj": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def gemm_points(presets: Mapping[str, Any], ms: Sequence[int], tiny: bool) -> list[Point]:
    shapes: dict[str, tuple[str, int, int]] = {}  # label -> (preset tag, K, N)
    if tiny:
        spec = presets["tiny"]
        shapes.update({f"tiny.{n}": ("tiny", k, nn) for n, (k, nn) in _gemm_shapes(spec).items()})
        shapes["ragged.k30_n53"] = ("ragged", 30, 53)
    else:
        for name, spec in presets.items():
            if name.startswith("qwen3-") and not name.startswith("qwen3-30b"):
                shapes.update({f"{name}.{p}": (name, k, n) for p, (k, n) in _gemm_shapes(spec).items()})
        ll = LLAMA3_8B
        shapes.update({"llama-3-8b.gate_up": ("llama-3-8b", ll["hidden"], 2 * ll["inter"]),
                       "llama-3-8b.down": ("llama-3-8b", ll["inter"], ll["hidden"]),
                       "llama-3-8b.lm_head": ("llama-3-8b", ll["hidden"], ll["vocab"])})
        shapes.update({label: ("ragged", k, n) for label, (k, n) in RAGGED_GEMM.items()})
    seen: dict[tuple[int, int], str] = {}
    points = []
    for label, (tag, K, N) in shapes.items():
        if (K, N) in seen:  # the same shape under another name (e.g. Llama-3-8B's qkv = Qwen3-8B's)
            continue
        seen[(K, N)] = label
        for M in ms:
            case = f"{label} K={K} N={N} M={M}"
            points.append(Point("gemm", case, tag, "gemm.linear", "rlk.ops.gemm.linear", {"shape": label, "M": M, "K": K, "N": N},
                                "gemm_ragged" if tag == "ragged" else "gemm", _gemm_build(case, M, K, N),
                                target_baseline="torch.F.linear"))
    return points


# ----------------------------------------------------------------------------- attention (training prefill)


def _attention_build(case: str, lens: Sequence[int], Hq: int, Hkv: int, D: int, backward: bool) -> Callable[[Env], Built]:
    """Forward + backward candidates return their outputs detached: an output kept for the bits
    digest must not keep its autograd graph (and the leaves' gradient accumulators, made on
    the default stream) alive into a CUDA-graph capture on another stream."""

    def build(env: Env) -> Built:
        from rl_engine.ops import attention

        g = _gen(env, case)
        T = sum(lens)
        q, k, v = _randn((T, Hq, D), g, env), _randn((T, Hkv, D), g, env), _randn((T, Hkv, D), g, env)
        up = _randn((T, Hq, D), g, env)
        offsets = [0, *itertools.accumulate(lens)]
        cu_host = torch.tensor(offsets, dtype=torch.int32)
        cu = cu_host
        call = "cu_seqlens in host memory"
        try:  # the capturable form (docs/design/host-path.md); a tree that refuses it gets device offsets
            with torch.no_grad():
                attention.varlen_attention(q[:1], k[:1], v[:1], torch.tensor([0, 1], dtype=torch.int32))
        except ValueError as exc:
            cu = cu_host.to(env.device)
            call = f"cu_seqlens on the device (host offsets refused: {str(exc).splitlines()[0][:160]})"
        leaves = [t.detach().requires_grad_() for t in (q, k, v)] if backward else [q, k, v]

        def ours():
            if not backward:
                with torch.no_grad():
                    return attention.varlen_attention(q, k, v, cu)
            out = attention.varlen_attention(*leaves, cu)
            return (out.detach(), *torch.autograd.grad(out, leaves, up))

        # SDPA: one batched call per distinct length, on [b, H, S, D] copies made here
        groups: dict[int, list[int]] = {}
        for i, S in enumerate(lens):
            groups.setdefault(S, []).append(i)

        def grouped(t: torch.Tensor, S: int, idx: list[int]) -> torch.Tensor:
            return torch.stack([t[offsets[i]:offsets[i] + S] for i in idx]).transpose(1, 2).contiguous()

        sd = [(S, *(grouped(t, S, idx) for t in (q, k, v, up))) for S, idx in groups.items()]
        sd_leaves = [[t.detach().requires_grad_() for t in (qs, ks, vs)] for _, qs, ks, vs, _ in sd]

        def sdpa():
            if not backward:
                with torch.no_grad():
                    return [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=Hq != Hkv)
                            for _, qs, ks, vs, _ in sd]
            outs = [F.scaled_dot_product_attention(*lv, is_causal=True, enable_gqa=Hq != Hkv) for lv in sd_leaves]
            grads = torch.autograd.grad(outs, [t for lv in sd_leaves for t in lv], [u for *_, u in sd])
            return (*(o.detach() for o in outs), *grads)

        baselines = {"torch.sdpa": sdpa}
        unavailable = {}
        fa, why = _flash_attn()
        if fa is not None and env.device != "cpu":
            cu32 = cu_host.to(env.device)
            fa_leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def flash():
                if not backward:
                    with torch.no_grad():
                        return fa.flash_attn_varlen_func(q, k, v, cu32, cu32, max(lens), max(lens), causal=True)
                out = fa.flash_attn_varlen_func(*fa_leaves, cu32, cu32, max(lens), max(lens), causal=True)
                return (out.detach(), *torch.autograd.grad(out, fa_leaves, up))

            baselines["flash_attn.varlen"] = flash
        else:
            unavailable["flash_attn.varlen"] = why or "flash_attn needs CUDA"
        flop = sum(4.0 * Hq * D * S * (S + 1) / 2 for S in lens) * (2.5 if backward else 1.0)
        return Built(ours=("rlk.ops.attention.varlen_attention", ours), baselines=baselines, unavailable=unavailable,
                     calls=_calls(env, flop / 400e12), work={"flop": flop}, note=call)

    return build


def attention_points(heads: Mapping[str, tuple[int, int, int]], mixes: Mapping[str, Sequence[int]]) -> list[Point]:
    points = []
    for tag, (Hq, Hkv, D) in heads.items():
        for mix, lens in mixes.items():
            for pname in ("forward", "forward_backward"):
                case = f"{tag} Hq={Hq} Hkv={Hkv} D={D} {mix} {pname}"
                cfg = {"heads": tag, "Hq": Hq, "Hkv": Hkv, "D": D, "mix": mix, "lens": list(lens), "pass": pname}
                points.append(Point("attention", case, tag, "attention.varlen_attention",
                                    "rlk.ops.attention.varlen_attention", cfg, "attention",
                                    _attention_build(case, lens, Hq, Hkv, D, pname == "forward_backward")))
    return points


# ----------------------------------------------------------------------------- decode (rollout)


def _decode_build(case: str, B: int, ctx: int, Hq: int, Hkv: int, D: int, layout: str) -> Callable[[Env], Built]:
    """One decode step: every sequence holds ``ctx - 1`` cached tokens, the step appends one (at
    position ``ctx - 1``) and attends over ``ctx`` keys. The step's plan is made once (outside
    the timing), as an engine does; the contiguous cache's bookkeeping is restored before each
    call (host only), so every call is the same step."""

    def build(env: Env) -> Built:
        from rl_engine.ops import attention

        g = _gen(env, case)
        q = _randn((B, Hq, D), g, env)
        keys, vals = _randn((B, ctx, Hkv, D), g, env), _randn((B, ctx, Hkv, D), g, env)
        k_new, v_new = keys[:, ctx - 1].contiguous(), vals[:, ctx - 1].contiguous()
        baselines: dict[str, Callable[[], Any]] = {}
        unavailable: dict[str, str] = {}
        fa, why = _flash_attn()
        if fa is None or env.device == "cpu":
            unavailable["flash_attn.with_kvcache"] = why or "flash_attn needs CUDA"
        if layout == "contiguous":
            cache = attention.ContiguousKVCache(B, ctx, Hkv, D, dtype=env.dtype, device=env.device)
            for s in range(B):
                cache.extend(s, keys[s, : ctx - 1], vals[s, : ctx - 1])
            plan = attention.plan_cached_attention(cache, list(range(B)), torch.arange(B + 1, device=env.device))
            snap = cache.snapshot()

            def ours():
                cache.restore(snap)
                return attention.cached_attention_step(q, k_new, v_new, cache, plan)

            name = "rlk.ops.attention.cached_attention_step"
            ks, vs = keys.transpose(1, 2).contiguous(), vals.transpose(1, 2).contiguous()
            qs = q[:, :, None]
            k_step, v_step = k_new[:, :, None], v_new[:, :, None]

            def append_sdpa():
                ks[:, :, ctx - 1:].copy_(k_step)
                vs[:, :, ctx - 1:].copy_(v_step)
                return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=Hq != Hkv)

            baselines["torch.append+sdpa"] = append_sdpa
            fa_cache = (cache.k, cache.v, None)
        else:
            pages = -(-ctx // PAGE)
            num_blocks = B * pages
            perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(_seed(case)))
            table = perm.view(B, pages).to(torch.int32)  # shuffled pages, as a pool hands them out
            pos = torch.arange(ctx)
            rows = (table.to(torch.int64)[:, pos // PAGE] * PAGE + pos % PAGE)  # [B, ctx] storage rows
            k_cache = torch.zeros(num_blocks, PAGE, Hkv, D, dtype=env.dtype, device=env.device)
            v_cache = torch.zeros_like(k_cache)
            rows_dev = rows.to(env.device)
            k_cache.view(-1, Hkv, D)[rows_dev.view(-1)] = keys.reshape(-1, Hkv, D)
            v_cache.view(-1, Hkv, D)[rows_dev.view(-1)] = vals.reshape(-1, Hkv, D)
            plan = attention.plan_paged_attention(rows[:, ctx - 1].contiguous(), table, PAGE,
                                                  torch.arange(B + 1, dtype=torch.int32),
                                                  torch.full((B,), ctx, dtype=torch.int32), num_blocks=num_blocks,
                                                  device=env.device)

            def ours():
                return attention.paged_attention_step(q, k_new, v_new, k_cache, v_cache, plan)

            name = "rlk.ops.attention.paged_attention_step"
            k_rows, v_rows = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
            flat = rows_dev.reshape(-1)
            qs = q[:, :, None]

            slots = rows_dev[:, ctx - 1].contiguous()

            def append_gather_sdpa():
                k_rows.index_copy_(0, slots, k_new)
                v_rows.index_copy_(0, slots, v_new)
                kg = k_rows.index_select(0, flat).view(B, ctx, Hkv, D).transpose(1, 2)
                vg = v_rows.index_select(0, flat).view(B, ctx, Hkv, D).transpose(1, 2)
                return F.scaled_dot_product_attention(qs, kg, vg, enable_gqa=Hq != Hkv)

            baselines["torch.append+gather+sdpa"] = append_gather_sdpa
            fa_cache = (k_cache, v_cache, table.to(env.device))
        del keys, vals
        if fa is not None and env.device != "cpu":
            kc, vc, block_table = fa_cache
            lens = torch.full((B,), ctx - 1, dtype=torch.int32, device=env.device)
            q4, k4, v4 = q[:, None], k_new[:, None], v_new[:, None]

            def flash():
                return fa.flash_attn_with_kvcache(q4, kc, vc, k=k4, v=v4, cache_seqlens=lens, block_table=block_table)

            try:  # flash-attn 2 takes pages of a multiple of 256 tokens only
                flash()
                baselines["flash_attn.with_kvcache"] = flash
            except Exception as exc:  # noqa: BLE001 - recorded as unavailable
                unavailable["flash_attn.with_kvcache"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        kv_bytes = 2.0 * B * ctx * Hkv * D * torch.finfo(env.dtype).bits / 8
        return Built(ours=(name, ours), baselines=baselines, unavailable=unavailable,
                     calls=_calls(env, kv_bytes / 3e12 + 5e-6), work={"bytes": kv_bytes})

    return build


def decode_points(heads: Mapping[str, tuple[int, int, int]], batches: Sequence[int], ctxs: Sequence[int],
                  extra_heads: Mapping[str, tuple[int, int, int]] = {}, extra_at: tuple[int, int] | None = None) -> list[Point]:
    """Every (batch, context, layout) for ``heads``; ``extra_heads`` at one (batch, context)."""
    grid = [(tag, h, B, ctx) for tag, h in heads.items() for B in batches for ctx in ctxs]
    if extra_at is not None:
        grid += [(tag, h, *extra_at) for tag, h in extra_heads.items() if tag not in heads]
    points = []
    for tag, (Hq, Hkv, D), B, ctx in grid:
        for layout in ("contiguous", f"paged{PAGE}"):
            case = f"{tag} Hq={Hq} Hkv={Hkv} D={D} B={B} ctx={ctx} {layout}"
            cfg = {"heads": tag, "Hq": Hq, "Hkv": Hkv, "D": D, "B": B, "context": ctx, "layout": layout}
            impl = ("rlk.ops.attention.cached_attention_step" if layout == "contiguous"
                    else "rlk.ops.attention.paged_attention_step")
            points.append(Point("decode", case, tag, "attention.cached_attention", impl, cfg, "decode",
                                _decode_build(case, B, ctx, Hq, Hkv, D, layout)))
    return points


# ----------------------------------------------------------------------------- fused LM head


def _lmhead_build(case: str, T: int, H: int, V: int, backward: bool) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from rl_engine.ops import logprob

        g = _gen(env, case)
        h = _randn((T, H), g, env)
        w = _randn((V, H), g, env, scale=3.0 / H**0.5)
        t = torch.randint(0, V, (T,), generator=g, device=env.device)
        up = torch.randn(T, generator=g, device=env.device)

        def run(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
            if not backward:
                def fwd():
                    with torch.no_grad():
                        return f(h, w)
                return fwd
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()

            def fwd_bwd():
                lp = f(hh, ww)
                return (lp.detach(), *torch.autograd.grad((lp * up).sum(), (hh, ww)))
            return fwd_bwd

        def naive(hh, ww):
            return torch.log_softmax(F.linear(hh, ww).float(), -1).gather(1, t[:, None]).squeeze(1)

        baselines = {"naive": run(naive)}
        unavailable = {}
        if backward:
            cls, why = _liger()
            if cls is not None and env.device != "cpu":
                flce = cls(reduction="none")
                baselines["liger.flce"] = run(lambda hh, ww: -flce(ww, hh, t))
            else:
                unavailable["liger.flce"] = why or "Liger-Kernel needs CUDA"
        flop = 2.0 * T * H * V * (3.0 if backward else 1.0)
        return Built(ours=("rlk.ops.logprob.linear_token_logprobs",
                           run(lambda hh, ww: logprob.linear_token_logprobs(hh, ww, t))),
                     baselines=baselines, unavailable=unavailable, calls=1, work={"flop": flop})

    return build


def lmhead_points(models: Mapping[str, tuple[int, int]], tokens: Sequence[int]) -> list[Point]:
    points = []
    for tag, (H, V) in models.items():
        for T in tokens:
            for pname in ("forward", "forward_backward"):
                case = f"{tag} H={H} V={V} T={T} {pname}"
                points.append(Point("lmhead", case, tag, "logprob.linear_token_logprobs",
                                    "rlk.ops.logprob.linear_token_logprobs",
                                    {"model": tag, "T": T, "H": H, "V": V, "pass": pname}, f"lmhead_{pname}",
                                    _lmhead_build(case, T, H, V, pname == "forward_backward"),
                                    target_baseline="naive" if pname == "forward" else "liger.flce"))
    return points


# ----------------------------------------------------------------------------- the matrix


def presets() -> dict[str, Any]:
    """rl_engine's Qwen3 dense presets and Qwen3-30B-A3B (the tree under test's own)."""
    from rl_engine.models.qwen3.spec import PRESETS
    from rl_engine.models.qwen3_moe.spec import PRESETS as MOE

    return {**PRESETS, "qwen3-30b-a3b": MOE["qwen3-30b-a3b"]}


def all_points(*, tiny: bool, quick: bool, ms: Sequence[int] | None) -> list[Point]:
    """Every point of the matrix (``--tiny``: tiny shapes; ``--quick``: the quick subset), in run
    order; ``ms`` replaces the GEMM M axis."""
    specs = presets()

    def heads(name: str) -> tuple[int, int, int]:
        s = specs[name]
        return s.num_attention_heads, s.num_key_value_heads, s.head_dim

    if tiny:  # the tiny preset's heads and GEMM shapes; a ragged mix, context and GEMM; a small LM head
        h = {"tiny": heads("tiny")}
        return [*gemm_points(specs, ms or (1, 16), tiny=True),
                *attention_points(h, {"ragged3": (5, 11, 7)}),
                *decode_points(h, (2,), (40,)),
                *lmhead_points({"tiny": (64, 512)}, (4,))]
    # one head configuration per GQA ratio of the presets (0.6b/1.7b: 2, 4b/8b: 4, 14b: 5, 32b and
    # 30b-a3b: 8), MHA, and head_dim 64 / 256
    att_heads = {n: heads(n) for n in ("qwen3-0.6b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b")}
    att_heads.update(EXTRA_HEADS)
    ll = LLAMA3_8B
    lm_models = {"qwen3-8b": (specs["qwen3-8b"].hidden_size, specs["qwen3-8b"].vocab_size),
                 "qwen3-32b": (specs["qwen3-32b"].hidden_size, specs["qwen3-32b"].vocab_size),
                 "llama-3-8b": (ll["hidden"], ll["vocab"])}
    if quick:
        return [*(p for p in gemm_points(specs, ms or QUICK["ms"], tiny=False) if p.preset in QUICK["gemm_presets"]),
                *attention_points({n: att_heads[n] for n in QUICK["attention_heads"]},
                                  {m: PREFILL_MIXES[m] for m in QUICK["mixes"]}),
                *decode_points({n: att_heads[n] for n in QUICK["decode_heads"]}, QUICK["decode_batch"],
                               QUICK["decode_ctx"]),
                *lmhead_points({n: lm_models[n] for n in QUICK["lmhead_models"]}, QUICK["lmhead_tokens"])]
    return [*gemm_points(specs, ms or MS, tiny=False),
            *attention_points(att_heads, PREFILL_MIXES),
            *decode_points({n: att_heads[n] for n in ("qwen3-8b", "qwen3-30b-a3b")}, DECODE_BATCH, DECODE_CTX,
                           extra_heads=att_heads, extra_at=(32, 8192)),
            *lmhead_points(lm_models, LMHEAD_TOKENS)]


def select(points: Sequence[Point], *, families: Sequence[str], presets_: Sequence[str] | None,
           cases: Sequence[str] | None) -> list[Point]:
    """The points of ``families`` whose preset tag is in ``presets_`` (all when None) and whose
    case matches one of the shell-style ``cases`` patterns (all when None)."""
    return [p for p in points if p.family in families and (presets_ is None or p.preset in presets_)
            and (cases is None or any(fnmatch.fnmatchcase(p.case, c) for c in cases))]


# ----------------------------------------------------------------------------- running one point


def bits_digest(out: Any) -> str:
    """First 16 hex digits of the sha256 of the raw bytes of every tensor in ``out`` (nested
    tuples and lists in order)."""
    h = hashlib.sha256()

    def feed(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().contiguous().reshape(-1)
            h.update(t.view(torch.uint8).cpu().numpy().tobytes())
        elif isinstance(o, (tuple, list)):
            for x in o:
                feed(x)

    feed(out)
    return h.hexdigest()[:16]


def _keeping(fn: Callable[[], Any], box: dict[str, Any], name: str) -> Callable[[], Any]:
    """``fn`` that also keeps what it returned last in ``box[name]`` (under a CUDA graph: the
    captured output, which every replay rewrites)."""

    def call():
        out = fn()
        box[name] = out
        return out

    return call


def _loop(fn: Callable[[], Any], n: int) -> Callable[[], Any]:
    def call():
        for _ in range(n):
            out = fn()
        return out

    return call


def _synchronises(fn: Callable[[], Any], device: str) -> str | None:
    """Why ``fn`` cannot be captured in a CUDA graph (it synchronises with the host), or None."""
    if not device.startswith("cuda"):
        return None
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return f"synchronises with the host: {str(exc).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize()
    return None


def _served_by(fn: Callable[[], Any]) -> list[str]:
    """The implementations rl_engine's dispatch selected for one call of ``fn``."""
    from rl_engine.runtime import provenance

    with provenance.record() as recs:
        fn()
    return sorted({f"{r.op}:{r.impl_id}" + (" (fallback)" if r.fallback else "") for r in recs})


@dataclass
class Run:
    env: Env
    modes: Sequence[str]
    device: Mapping[str, Any]
    versions: Mapping[str, Any]


def _row(run: Run, p: Point, mode: str, impl: str, role: str, stats: Stats | None, extra: Mapping[str, Any],
         peak: tuple[int | None, str | None] = (None, None), baseline: str | None = None) -> dict[str, Any]:
    target = TARGETS[p.target_key]
    cfg = {**p.config, "dtype": str(run.env.dtype).removeprefix("torch.")}
    row = make_row(benchmark=BENCHMARK, op=p.op, implementation=impl, config=cfg,
                   stats=stats or Stats(0, 0.0, 0.0, 0.0, 0.0, 0.0), warmup=run.env.warmup, device=run.device,
                   versions=run.versions, peak_memory_bytes=peak[0], peak_memory_method=peak[1], baseline=baseline,
                   extra={**dict.fromkeys(MATRIX_KEYS),
                          "family": p.family, "case": p.case, "preset": p.preset, "mode": mode, "role": role,
                          "metric": target.metric, "target": target.text if role == "ours" else "(baseline)",
                          "target_goal": target.goal if role == "ours" else None,
                          "target_limit": target.limit if role == "ours" else None, **extra})
    if stats is None:
        for k in ("median", "p20", "p50", "p80", "min", "max"):
            row[k] = None
        row["samples"] = 0
    return row


def _judge(row: dict[str, Any], target: Target, base_row: Mapping[str, Any] | None, why_none: str | None) -> None:
    """Fill the ours row's ratios, ``achieved``, ``met`` and ``within_limit`` against ``base_row``."""
    if base_row is None or not base_row.get("median"):
        row["target"] = f"(no target: {why_none or 'no baseline timed'})"
        row["target_goal"] = row["target_limit"] = row["met"] = row["within_limit"] = None
        return
    ratio = row["median"] / base_row["median"]
    row["ratio_vs_baseline"], row["throughput_ratio"] = ratio, 1.0 / ratio
    row["achieved"] = ratio if target.metric == "time_ratio" else 1.0 / ratio
    row["met"] = target.met(row["achieved"])
    row["within_limit"] = target.within_limit(row["achieved"])
    if target.memory:
        ours, theirs = row["peak_memory_bytes"], base_row.get("peak_memory_bytes")
        row["memory_ratio"] = None if ours is None or not theirs else ours / theirs
        fits = ours is not None and theirs is not None and ours <= theirs
        row["met"] = row["met"] and fits
        row["within_limit"] = row["within_limit"] and fits


def run_point(run: Run, p: Point, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every mode of one point: the ours row and one row per baseline timed."""
    env = run.env
    target = TARGETS[p.target_key]
    try:
        built = p.build(env)
        ours_name, ours = built.ours
        served = _served_by(ours)  # also the first call: compilation happens here, untimed
    except Exception as exc:  # noqa: BLE001 - the point's rows carry the reason
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        log(f"  error: {msg}")
        return [_row(run, p, mode, p.impl, "ours", None, {"error": msg}) for mode in run.modes]
    fns = {ours_name: ours, **built.baselines}
    peaks: dict[str, tuple[int | None, str | None]] = {}
    if p.family == "lmhead":  # peak memory of one untimed call each
        for name, fn in fns.items():
            peaks[name] = peak_memory(fn, device=env.device)
    common = {"calls": built.calls, "unavailable": dict(built.unavailable), "call": built.note}
    rows: list[dict[str, Any]] = []
    for mode in run.modes:
        cands = dict(fns)
        refused: dict[str, str] = {}
        if mode == "graph":
            for name in list(cands):
                why = _synchronises(cands[name], env.device)
                if why:
                    refused[name] = why
                    del cands[name]
        if ours_name not in cands:
            rows.append(_row(run, p, mode, ours_name, "ours", None,
                             {**common, "served_by": served, "error": f"not capturable: {refused[ours_name]}"}))
            log(f"  {mode}: not capturable: {refused[ours_name]}")
            continue
        box: dict[str, Any] = {}
        kept = {name: _keeping(fn, box, name) for name, fn in cands.items()}
        try:
            if mode == "graph":
                samples = cuda_graphs_interleaved_ms(kept, calls=built.calls, repeats=env.repeats, warmup=env.warmup)
                stats = {name: summarize(s) for name, s in samples.items()}
                timing = f"CUDA graphs of {built.calls} calls, replayed round-robin"
            else:
                res = measure_interleaved({name: _loop(fn, built.calls) for name, fn in kept.items()},
                                          warmup=env.warmup, repeats=env.repeats, device=env.device)
                stats = {name: st.scaled(1.0 / built.calls) for name, st in res.items()}
                timing = f"eager loops of {built.calls} calls, host-synchronised, round-robin"
            bits = {name: bits_digest(box[name]) for name in cands}
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            rows.append(_row(run, p, mode, ours_name, "ours", None, {**common, "served_by": served, "error": msg}))
            log(f"  {mode}: error: {msg}")
            continue
        finally:
            box.clear()
        names_base = [n for n in stats if n != ours_name]
        if p.target_baseline is not None:
            base_name = p.target_baseline if p.target_baseline in stats else None
            why_none = (built.unavailable.get(p.target_baseline) or refused.get(p.target_baseline)
                        if base_name is None else None)
        else:
            base_name = min(names_base, key=lambda n: stats[n].median) if names_base else None
            why_none = None if base_name else "no baseline could be timed"
        ref = base_name or ("naive" if "naive" in stats else None)  # the ratio's reference when the target's is missing
        extra_mode = {**common, "timing": timing, "not_capturable": refused or None}
        mode_rows = {}
        for name, st in stats.items():
            work = {}
            if "flop" in built.work:
                work["tflops"] = built.work["flop"] / (st.median * 1e-3) / 1e12
            if "bytes" in built.work:
                work["kv_TB_per_s"] = built.work["bytes"] / (st.median * 1e-3) / 1e12
            role = "ours" if name == ours_name else "baseline"
            mode_rows[name] = _row(run, p, mode, name, role, st,
                                   {**extra_mode, **work, "bits": bits[name], "served_by": served if role == "ours" else None},
                                   peaks.get(name, (None, None)), baseline=base_name or ref)
        for name, row in mode_rows.items():
            if ref is not None and name != ours_name:
                row["ratio_vs_baseline"] = row["median"] / mode_rows[ref]["median"]
                row["throughput_ratio"] = 1.0 / row["ratio_vs_baseline"]
        ours_row = mode_rows[ours_name]
        _judge(ours_row, target, mode_rows.get(base_name) if base_name else None, why_none)
        if base_name is None and ref is not None:  # a ratio without a target (the target's baseline is missing)
            ours_row["ratio_vs_baseline"] = ours_row["median"] / mode_rows[ref]["median"]
            ours_row["throughput_ratio"] = 1.0 / ours_row["ratio_vs_baseline"]
        rows += list(mode_rows.values())
        met = {True: "met", False: "MISSED", None: "-"}[ours_row["met"]]
        achieved = "-" if ours_row["achieved"] is None else f"{ours_row['achieved']:.3f}"
        log(f"  {mode:5s} {ours_row['median']:10.4f} ms  {achieved:>6s} {target.metric} vs {base_name}  {met}  "
            f"bits {ours_row['bits']}")
    return rows


def profile_points(env: Env, points: Sequence[Point], log: Callable[[str], None]) -> None:
    """For a profiler: each point's candidates called a few times (compilation, warm-up), then one
    more call of each between ``cudaProfilerStart`` and ``cudaProfilerStop``, inside an NVTX range
    named ``"<case> | ours"`` or ``"<case> | <baseline>"``. ``ncu --profile-from-start off`` then
    profiles exactly one call of ours and of each baseline per point, and ``--nvtx
    --print-nvtx-rename kernel`` names each profiled kernel by its point and side
    (``tools/benchmarking/matrix_ncu.py``)."""
    cuda = env.device.startswith("cuda")

    def once(fn: Callable[[], Any], label: str) -> None:
        for _ in range(2):
            fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            torch.cuda.nvtx.range_push(label)
        fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.cudart().cudaProfilerStop()

    for p in points:
        log(f"{p.family}: {p.case}")
        built = p.build(env)
        once(built.ours[1], f"{p.case} | ours")
        for name, fn in built.baselines.items():
            once(fn, f"{p.case} | {name}")
        del built
        if cuda:
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report


def summary(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per ours row: what the docs page renders (``case``, ``metric``, ``achieved``,
    ``target``, ``met``: a point that could not run misses its target) plus ``family``, ``mode``,
    ``within_limit``, ``goal``, ``ratio_metric``, ``baseline``, ``bits``, ``error``."""
    out = []
    for r in rows:
        if r.get("role") != "ours":
            continue
        metric = {"time_ratio": "time vs", "throughput_ratio": "throughput vs"}[r["metric"]]
        met = r["met"]
        if r.get("error"):
            met = False  # a point that could not run misses its target
        out.append({"case": f"{r['family']}: {r['case']} [{r['mode']}]", "family": r["family"], "mode": r["mode"],
                    "implementation": r["implementation"], "metric": f"{metric} {r.get('baseline') or 'baseline'}",
                    "achieved": r["achieved"], "target": r["target"], "met": met,
                    "within_limit": r["within_limit"], "goal": r["target_goal"], "ratio_metric": r["metric"],
                    "baseline": r.get("baseline"), "bits": r.get("bits"), "error": r.get("error")})
    return out


def _cuda_device() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {"name": props.name, "capability": f"sm{props.major}{props.minor}", "sm_count": props.multi_processor_count,
            "driver": driver, "memory_mib": props.total_memory // 2**20}


def platform_key(name: str) -> str:
    """``reports/gpu/<platform>/``: ``NVIDIA H200`` -> ``h200``."""
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.lower())
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def tree_commit(root: Path) -> tuple[str | None, bool | None]:
    """``(short commit, dirty)`` of the git tree at ``root`` (None where it is not one)."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=20)
        if commit.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=60)
        return commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def report(rows: Sequence[Mapping[str, Any]], *, run: Run, command: str, meta: Mapping[str, Any],
           commit: str | None) -> dict[str, Any]:
    import datetime as _dt

    if run.env.device.startswith("cuda"):
        dev = _cuda_device()
    else:
        info = device_info(run.env.device)
        dev = {"name": info["name"], "capability": info["platform"], "sm_count": 0, "driver": "n/a",
               "threads": info["threads"]}
    vers = {k: v for k, v in run.versions.items() if v is not None}
    plat = platform_key(dev["name"]) if run.env.device.startswith("cuda") else "cpu"
    return {"schema_version": SCHEMA_VERSION, "family": "matrix", "platform": plat,
            "title": "Benchmark matrix through the public API (GEMM, attention prefill and decode, fused LM head) "
                     "against the fastest non-invariant baselines, same process, interleaved",
            "command": command, "commit": commit, "device": dev, "versions": vers,
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "meta": dict(meta), "summary": summary(rows), "rows": [dict(r) for r in rows]}


def _write(path: Path, doc: Mapping[str, Any]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


# ----------------------------------------------------------------------------- command line


def _csv(kind: type, name: str, allowed: Sequence[Any] | None = None):
    def parse(text: str):
        try:
            items = [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected comma-separated {kind.__name__} values, got {text!r}")
        if not items or any(x in ("", None) for x in items):
            raise argparse.ArgumentTypeError(f"{name}: expected comma-separated non-empty values, got {text!r}")
        if kind is int and any(x < 1 for x in items):
            raise argparse.ArgumentTypeError(f"{name}: expected positive integers, got {text!r}")
        if allowed is not None and any(x not in allowed for x in items):
            raise argparse.ArgumentTypeError(f"{name}: expected a subset of {','.join(map(str, allowed))}, got {text!r}")
        return items

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON report (required unless --list)")
    ap.add_argument("--families", type=_csv(str, "--families", FAMILIES), default=list(FAMILIES))
    ap.add_argument("--presets", type=_csv(str, "--presets"), default=None,
                    help="keep the points of these preset tags (qwen3-8b, llama-3-8b, ragged, d256, ...; --list shows them)")
    ap.add_argument("--ms", type=_csv(int, "--ms"), default=None, help="the GEMM M axis (default 1,16,...,16384)")
    ap.add_argument("--cases", type=_csv(str, "--cases"), default=None, help="shell-style patterns on the case labels")
    ap.add_argument("--modes", type=_csv(str, "--modes", MODES), default=None,
                    help="graph,eager (default both on CUDA; eager on the CPU)")
    ap.add_argument("--quick", action="store_true", help="the quick subset (about four minutes on an H200)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run; with --device cpu: seconds)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=None, help="timed samples per candidate (default 9; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; --tiny 1)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no point after this many seconds; the report keeps the points finished")
    ap.add_argument("--impl-root", type=Path, default=None,
                    help="import rl_engine from this source tree (the gate's baseline); the harness stays this tree's")
    ap.add_argument("--commit", default=None, help="the measured tree's commit (default: git rev-parse of its root)")
    ap.add_argument("--list", action="store_true", help="print the selected points and exit")
    ap.add_argument("--profile", action="store_true",
                    help="no timing: one call of ours and of each baseline per selected point between "
                         "cudaProfilerStart/Stop, in the NVTX range '<case> | <side>', for ncu --profile-from-start off")
    args = ap.parse_args(argv)
    if not (args.list or args.profile) and args.out is None:
        ap.error("--out: required (the JSON report), unless --list or --profile")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats: expected a positive count, got {args.repeats}")
    if args.warmup is not None and args.warmup < 0:
        ap.error(f"--warmup: expected a count >= 0, got {args.warmup}")
    if args.max_seconds is not None and args.max_seconds < 0:
        ap.error(f"--max-seconds: expected seconds >= 0, got {args.max_seconds}")
    if args.modes is None:
        args.modes = list(MODES) if args.device == "cuda" else ["eager"]
    if args.device == "cpu" and "graph" in args.modes:
        ap.error("--modes: graph needs --device cuda")
    if args.device == "cpu" and not args.tiny and not args.list:
        ap.error("--device cpu: only with --tiny (the full shapes need a GPU)")
    if args.impl_root is not None:
        if not (args.impl_root / "rl_engine" / "__init__.py").is_file():
            ap.error(f"--impl-root: expected a source tree holding rl_engine/, got {str(args.impl_root)!r}")
        if "rl_engine" in sys.modules:
            ap.error("--impl-root: rl_engine is already imported in this process")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    impl_root = ROOT
    if args.impl_root is not None:
        impl_root = args.impl_root.resolve()
        sys.path.insert(0, str(impl_root))
    points = all_points(tiny=args.tiny, quick=args.quick, ms=args.ms)
    if args.presets is not None:
        known = sorted({p.preset for p in points})
        unknown = [x for x in args.presets if x not in known]
        if unknown:
            print(f"bench_matrix_gpu: --presets: unknown {unknown}; known here: {','.join(known)}", file=sys.stderr)
            return 2
    points = select(points, families=args.families, presets_=args.presets, cases=args.cases)
    if args.list:
        for p in points:
            print(f"{p.family:9s} {p.case}")
        print(f"{len(points)} points")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_matrix_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    env = Env(device=args.device, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16, tiny=args.tiny,
              repeats=args.repeats or (2 if args.tiny else 9), warmup=args.warmup if args.warmup is not None
              else (1 if args.tiny else 2))
    if args.profile:
        profile_points(env, points, lambda s: print(s, flush=True))
        return 0
    import rl_engine

    vers = {**versions(), "cuda": torch.version.cuda, "liger_kernel": _package_version("liger-kernel"),
            "flash_attn": _package_version("flash-attn")}
    run = Run(env=env, modes=args.modes, device=device_info(args.device), versions=vers)
    commit, dirty = (args.commit, None) if args.commit else tree_commit(impl_root)
    command = " ".join(["python", "benchmarks/operators/bench_matrix_gpu.py", *(argv if argv is not None else sys.argv[1:])])
    meta = {"partial": True, "points": len(points), "modes": list(args.modes), "repeats": env.repeats,
            "warmup": env.warmup, "quick": args.quick, "tiny": args.tiny, "max_seconds": args.max_seconds,
            "impl_root": str(impl_root), "rl_engine_file": rl_engine.__file__, "dirty": dirty,
            "machine_load": machine_load(), "stopped": None}
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    done = 0
    for i, p in enumerate(points):
        if args.max_seconds is not None and time.monotonic() - start >= args.max_seconds:
            meta["stopped"] = {"reason": f"--max-seconds {args.max_seconds:g} spent", "points_left": len(points) - i,
                               "next": p.case}
            print(f"stopped: --max-seconds {args.max_seconds:g} spent, {len(points) - i} points left", flush=True)
            break
        t0 = time.monotonic()
        print(f"[{i + 1}/{len(points)}] {p.family}: {p.case}", flush=True)
        rows += run_point(run, p, lambda s: print(s, flush=True))
        done += 1
        if env.device.startswith("cuda"):
            if torch.cuda.memory_allocated() > 2**30:  # a reference cycle holds the point's tensors
                gc.collect()
            torch.cuda.empty_cache()
        meta["elapsed_s"] = round(time.monotonic() - start, 1)
        print(f"  ({time.monotonic() - t0:.1f} s)", flush=True)
        _write(args.out, report(rows, run=run, command=command, meta={**meta, "points_done": done}, commit=commit))
    meta.update(partial=False, points_done=done, elapsed_s=round(time.monotonic() - start, 1))
    doc = report(rows, run=run, command=command, meta=meta, commit=commit)
    _write(args.out, doc)
    judged = [s for s in doc["summary"] if s["met"] is not None]
    misses = [s for s in judged if not s["met"]]
    over = [s for s in judged if s.get("within_limit") is False]
    print(f"\n{done} points, {len(rows)} rows in {meta['elapsed_s']} s; targets met {len(judged) - len(misses)} of "
          f"{len(judged)}; beyond the family limit: {len(over)}")
    for s in misses:
        val = "error" if s["achieved"] is None else f"{s['achieved']:.3f}"
        print(f"  MISSED {s['case']}: {val} ({s['target']}){' ' + s['error'] if s.get('error') else ''}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
