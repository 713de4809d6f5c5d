"""Where an eager (Python-launched) rl-kernel call spends host time, on the GPU machine.

At decode-sized M a GEMM takes ~16 µs on the device, so what the host does per call decides the
eager speed (HF ``generate`` without graphs). This times, per call, at qkv M = 1 (bf16):

* ``cublas``      ``F.linear`` (the baseline);
* ``launch``      the Triton kernel alone, descriptors built once outside the loop;
* ``descriptors`` building the three TMA descriptors only (no launch);
* ``kernels``     ``gemm.kernels.forward`` (config lookup, descriptors, device guard, launch);
* ``custom_op``   ``torch.ops.rlk.linear_triton`` (adds the dispatcher);
* ``public``      ``rl_engine.ops.gemm.linear`` under ``nan_policy("propagate")`` (checks, dispatch);
* ``public_nan``  the same under the default NaN policy (a NaN scan and a host sync per input);

then other decode-step operators at batch 1 (``rms_norm``, ``silu_and_mul``, attention over a
4096-token cache: the launcher (``launch.cached_forward``), public ``cached_attention``, the engine form
``paged_attention`` against a step's ``plan_paged_attention`` + per-layer
``paged_attention_step``; a whole 36-layer decode step of per-layer caches, one
``cached_attention`` per layer against ``plan_cached_attention`` + ``cached_attention_step``)
next to their torch counterparts; and the embedding lookup (``F.embedding``, the public entry point, the
custom op) with the device-side index check of ``embedding`` / ``token_logprobs`` / ``apply_rope``
whole and launch by launch (``aminmax``, the comparisons, ``torch._assert_async``). Each is the median of repeated loops after warm-up, with the GPU kept ahead by a
CUDA sleep so the loop measures the host; calls that synchronise (the NaN scan, the attention
op's ``cu_seqlens`` validation) run without the sleep and report host + device. A ``cProfile``
of each ``--profile`` case (default: the custom-op loop and the public embedding) gives the top functions by own and by
cumulative time. JSON to ``--out``: ``rows`` (``case``, ``p50_us``, ``min_us``, ``host_only``, and
the benchmark harness's ``implementation`` / ``config`` / ``median`` / ``unit``, so
``tools/benchmarking/trees_ab_gpu.py`` tabulates them) and ``cprofile`` (case: text).

    python tools/benchmarking/host_overhead_gpu.py --out $OUT/host_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "operators"))
sys.path.insert(0, str(ROOT))

import bench_gemm_gpu as bench  # noqa: E402

from benchmarks.common.harness import cprofile_text  # noqa: E402


def per_call_us(fn, n: int = 400, reps: int = 7, syncs: bool = False) -> dict:
    """Median µs per call over ``reps`` loops of ``n`` calls. The device is first given a CUDA
    sleep longer than the loop, so the loop times the host alone — except for a call that
    synchronises (``syncs``): it would wait for the sleep, so it runs without one and its time
    is host + device (they are serialised by the sync anyway)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if not syncs:
            torch.cuda._sleep(int(2e9 * n * 1e-5))  # ~10 µs of device time per call queued ahead
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return {"p50_us": round(statistics.median(ts), 2), "min_us": round(min(ts), 2), "host_only": not syncs}


#: every case's name, in the order timed (``--profile`` is checked against these before any device work)
GEMM_CASES = ("cublas", "launch", "descriptors", "kernels", "custom_op", "public", "public_nan", "empty_like")
OTHER_CASES = (
    "rms_norm torch", "rms_norm public", "silu_and_mul torch", "silu_and_mul public", "decode attn sdpa (ctx 4096)",
    "decode attn launch.cached_forward", "decode attn public cached_attention", "decode attn public paged_attention",
    "decode attn plan_paged_attention (once per step)", "decode attn paged_attention_step (per layer)",
    "decode step x36 layers: cached_attention per layer",
    "decode step x36 layers: plan_cached_attention + cached_attention_step",
    "embedding torch", "embedding public", "embedding custom_op", "index check: check_index_range",
    "index check: aminmax", "index check: comparisons", "index check: comparison + _assert_async",
)


def other_ops() -> dict[str, tuple]:
    """Decode-step operators at Qwen3-8B widths, batch 1: (callable, syncs, n) per case."""
    from rl_engine.backends.triton.attention import launch as attention_launch
    from rl_engine.ops.activation import silu_and_mul
    from rl_engine.ops.attention import (ContiguousKVCache, cached_attention, cached_attention_step, paged_attention,
                                         paged_attention_step, plan_cached_attention, plan_paged_attention)
    from rl_engine.ops.norm import rms_norm
    from rl_engine.utils.checks import nan_policy

    h = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(1, 24576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache = ContiguousKVCache(1, 16384, 8, 128, dtype=torch.bfloat16, device="cuda")
    cu1 = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    pre = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    with nan_policy("propagate"):
        cached_attention(torch.randn(4096, 32, 128, device="cuda", dtype=torch.bfloat16), pre, pre, cache, [0],
                         torch.tensor([0, 4096], device="cuda", dtype=torch.int32))
    kc = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    rows = torch.zeros(1, 1, device="cuda", dtype=torch.int64)
    qs = torch.zeros(1, device="cuda", dtype=torch.int64)
    qp = torch.full((1,), 4095, device="cuda", dtype=torch.int64)
    ks = kc.view(1, 4096, 8, 128).transpose(1, 2)
    q4 = q.view(1, 1, 32, 128).transpose(1, 2)

    def propagate(f):
        def g():
            with nan_policy("propagate"):
                return f()
        return g

    # an engine-owned paged cache (16-token pages) holding 4095 tokens; the step appends the 4096th
    pk = torch.randn(257, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    pv = torch.randn(257, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    meta = (torch.tensor([255 * 16 + 15], device="cuda"), torch.arange(257, device="cuda")[None], 16, cu1,
            torch.tensor([4096], device="cuda"))
    plan = plan_paged_attention(*meta, num_blocks=257)

    # our own runtime's form: a 36-layer model, one ContiguousKVCache per layer holding 4096 tokens;
    # a decode step appends one token to every layer (rl_engine.models: planned once per step)
    layers = [ContiguousKVCache(1, 8192, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(36)]
    with nan_policy("propagate"):
        plan0 = plan_cached_attention(layers, [0], torch.tensor([0, 4096], device="cuda", dtype=torch.int32))
        for c in layers:
            cached_attention_step(q.new_empty(4096, 32, 128).normal_(), pre, pre, c, plan0)

    def step_per_layer_calls():
        for c in layers:
            cached_attention(q, kv, kv, c, [0], cu1)

    def step_planned():
        p = plan_cached_attention(layers, [0], cu1)
        for c in layers:
            cached_attention_step(q, kv, kv, c, p)

    # the device-side index check of embedding / token_logprobs / rope, whole and by its launches
    from rl_engine.ops.embedding import embedding
    from rl_engine.utils.checks import check_index_range

    import rl_engine.backends.triton.embedding  # noqa: F401  (registers torch.ops.rlk.embedding_triton)

    table = torch.randn(151936, 4096, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([17], device="cuda")
    lo, hi = torch.aminmax(ids)

    return {
        "rms_norm torch": (lambda: torch.nn.functional.rms_norm(h, (4096,), nw, 1e-6), False, 400),
        "rms_norm public": (propagate(lambda: rms_norm(h, nw, 1e-6)), False, 400),
        "silu_and_mul torch": (lambda: torch.nn.functional.silu(gu[:, :12288]) * gu[:, 12288:], False, 400),
        "silu_and_mul public": (propagate(lambda: silu_and_mul(gu)), False, 400),
        "decode attn sdpa (ctx 4096)": (lambda: torch.nn.functional.scaled_dot_product_attention(q4, ks, ks, enable_gqa=True),
                                        False, 400),
        "decode attn launch.cached_forward": (lambda: attention_launch.cached_forward(q, kc, kc, rows, 4096, qs, qp, 0.088,
                                                                                    None), False, 400),
        "decode attn public cached_attention": (propagate(lambda: cached_attention(q, kv, kv, cache, [0], cu1)), True, 200),
        # the engine form: one call validating its metadata per layer, or a plan per step + a step per layer
        "decode attn public paged_attention": (propagate(lambda: paged_attention(q, kv, kv, pk, pv, *meta)), True, 200),
        "decode attn plan_paged_attention (once per step)": (lambda: plan_paged_attention(*meta, num_blocks=257), True,
                                                             200),
        "decode attn paged_attention_step (per layer)": (propagate(lambda: paged_attention_step(q, kv, kv, pk, pv, plan)),
                                                          False, 400),
        # per decode step of 36 layers (host + device: both forms read cu_seqlens_q on the host)
        "decode step x36 layers: cached_attention per layer": (propagate(step_per_layer_calls), True, 20),
        "decode step x36 layers: plan_cached_attention + cached_attention_step": (propagate(step_planned), True, 20),
        "embedding torch": (lambda: F.embedding(ids, table), False, 400),
        "embedding public": (lambda: embedding(ids, table), False, 400),
        "embedding custom_op": (lambda: torch.ops.rlk.embedding_triton(ids, table), False, 400),
        "index check: check_index_range": (lambda: check_index_range("ids", ids, 151936, what="token ids"), False, 400),
        "index check: aminmax": (lambda: torch.aminmax(ids), False, 400),
        "index check: comparisons": (lambda: (lo >= 0) & (hi < 151936), False, 400),
        "index check: comparison + _assert_async": (lambda: torch._assert_async(lo >= 0, "ids: expected token ids"), False, 400),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--profile", nargs="*", default=["custom_op", "embedding public"], metavar="CASE",
                    help="cases to cProfile after the timings (any case name above; default: custom_op and embedding public)")
    ap.add_argument("--profile-calls", type=int, default=300, help="calls per cProfile (after warm-up)")
    args = ap.parse_args()
    unknown = [c for c in args.profile if c not in GEMM_CASES + OTHER_CASES]
    if unknown:
        ap.error(f"--profile: no case {unknown[0]!r}; cases: {', '.join(GEMM_CASES + OTHER_CASES)}")
    if args.profile_calls < 1:
        ap.error(f"--profile-calls: expected a positive count, got {args.profile_calls}")
    if not torch.cuda.is_available():
        print("host_overhead_gpu: needs a CUDA device (it times eager launches); none is visible", file=sys.stderr)
        return 1
    from triton.tools.tensor_descriptor import TensorDescriptor

    import rl_engine.backends.triton.gemm  # noqa: F401  (registers torch.ops.rlk.linear_triton)
    from rl_engine.backends.triton.gemm import kernels as K
    from rl_engine.ops import gemm
    from rl_engine.utils.checks import nan_policy

    k, n = bench.SHAPES["qkv"]
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    cfg = K.select_forward(x.dtype, args.m, n)
    y = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)

    def descriptors():
        return (TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]), TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
                TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n]))

    da, db, dc = descriptors()
    grid = (-(-args.m // cfg.block_m) * -(-n // cfg.block_n),)

    def launch():
        K.rlk_linear_fwd_tma[grid](da, db, dc, y, args.m, n, k, y.stride(0), HAS_BIAS=False, BLOCK_M=cfg.block_m,
                                   BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STORE_PTR=False,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def public():
        with nan_policy("propagate"):
            return gemm.linear(x, w)

    cases = {
        "cublas": lambda: F.linear(x, w),
        "launch": launch,
        "descriptors": descriptors,
        "kernels": lambda: K.forward(x, w, None),
        "custom_op": lambda: torch.ops.rlk.linear_triton(x, w, None),
        "public": public,
        "public_nan": lambda: gemm.linear(x, w),
        "empty_like": lambda: torch.empty_like(y),
    }
    env = bench.environment()
    rows = []
    for name, fn in cases.items():
        r = {**env, "bench": "host_overhead", "case": name, "M": args.m, "K": k, "N": n, "tile": cfg.key,
             **per_call_us(fn, syncs=name == "public_nan")}
        r.update(implementation=name, config={"M": args.m, "K": k, "N": n}, median=r["p50_us"], unit="us")
        rows.append(r)
        print(f"{name:12s} {r['p50_us']:8.2f} us/call (min {r['min_us']:.2f})", flush=True)
    others = other_ops()
    for name, (fn, syncs, calls) in others.items():
        r = {**env, "bench": "host_overhead", "case": name, **per_call_us(fn, n=calls, syncs=syncs)}
        r.update(implementation=name, config={}, median=r["p50_us"], unit="us")
        rows.append(r)
        print(f"{name:36s} {r['p50_us']:8.2f} us/call (min {r['min_us']:.2f}){'' if r['host_only'] else '  host + device (syncs)'}",
              flush=True)
    every = {**cases, **{name: fn for name, (fn, _, _) in others.items()}}
    assert tuple(every) == GEMM_CASES + OTHER_CASES, "GEMM_CASES / OTHER_CASES must list the cases timed"
    profiles = {}
    for name in args.profile:
        profiles[name] = cprofile_text(every[name], args.profile_calls, device="cuda")
        print(f"== cProfile {name} ({args.profile_calls} calls)\n{profiles[name][:6000]}", flush=True)
    args.out.write_text(json.dumps({"rows": rows, "cprofile": profiles}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
