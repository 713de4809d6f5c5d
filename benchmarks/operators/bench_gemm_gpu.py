"""GEMM on the GPU: rl-kernel's Triton ``gemm.linear`` vs ``torch.nn.functional.linear`` (cuBLAS).

Qwen3-8B projection shapes (K → N): qkv 4096→6144, gate_up 4096→24576, down 12288→4096,
lm_head 4096→151936, at M ∈ {1, 16, 64, 256, 1024, 4096, 16384}, bf16. Both implementations are
timed in the same process, interleaved per shape, with the same method:

* ``graph``: the call is captured ``n`` times in a CUDA graph (rotating over enough input
  copies that weights + activations exceed 3× the L2, so no run reads from a warm cache) and
  the graph is replayed; per-call time = replay time / n. This is device time, free of Python
  launch overhead (rl-kernel's dispatch adds host time; see ``eager``).
* ``eager``: the same calls launched from Python in a loop (what a caller without graphs sees).

The implementations' samples are taken in turn (A B A B …, ``time_interleaved``), so clock or
temperature drift during the long large-M runs hits both alike. Each timing is repeated; rows carry p20/p50/p80 in µs, TFLOP/s at p50 and, for ours,
``time_ratio`` = ours p50 / cuBLAS p50 (≤ 1 is faster) and ``throughput_ratio`` = its inverse.

Usage::

    python benchmarks/operators/bench_gemm_gpu.py --out bench_gemm_gpu.json
    # + rows rlk.triton.tile_gemm.one_launch: ours without the tail split (configs.tail_split)
    python benchmarks/operators/bench_gemm_gpu.py --out gemm.json --modes graph --one-launch
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES: dict[str, tuple[int, int]] = {  # name: (K, N)
    "qkv": (4096, 6144),
    "gate_up": (4096, 24576),
    "down": (12288, 4096),
    "lm_head": (4096, 151936),
}
MS = (1, 16, 64, 256, 1024, 4096, 16384)
L2_BYTES = 60 * 2**20


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"sm{props.major}{props.minor}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def make_inputs(m: int, k: int, n: int, dtype=torch.bfloat16, seed=0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Enough (x, w) copies that one pass over them exceeds 3× L2 (at most 8 copies)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = (m * k + n * k) * torch.finfo(dtype).bits // 8
    copies = max(1, min(8, math.ceil(3 * L2_BYTES / per)))
    out = []
    for _ in range(copies):
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
        out.append((x, w))
    return out


def percentiles(ts: Sequence[float]) -> dict[str, float]:
    q = statistics.quantiles(ts, n=10, method="inclusive")
    return {"p20_us": q[1], "p50_us": statistics.median(ts), "p80_us": q[7]}


def make_runner(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inputs, *, mode: str, n: int) -> Callable[[], None]:
    """Warm ``fn`` up (compiles, cuBLAS heuristics, allocator), then return a callable that makes
    ``n`` calls over the rotating ``inputs``: one graph replay (``graph``) or a Python loop."""
    for x, w in inputs:
        fn(x, w)
    torch.cuda.synchronize()
    if mode == "graph":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for x, w in inputs:
                fn(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                x, w = inputs[i % len(inputs)]
                fn(x, w)
        run = graph.replay
        run()
    else:

        def run():
            for i in range(n):
                x, w = inputs[i % len(inputs)]
                fn(x, w)

    torch.cuda.synchronize()
    return run


def sample_us(run: Callable[[], None], n: int) -> float:
    """One timed sample: per-call µs of ``run`` (which makes ``n`` calls)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    run()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / n


def time_calls(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inputs, *, mode: str, n: int, reps: int) -> list[float]:
    """Per-call µs of ``fn`` over rotating ``inputs``, ``reps`` samples of ``n`` calls each."""
    run = make_runner(fn, inputs, mode=mode, n=n)
    return [sample_us(run, n) for _ in range(reps)]


def time_interleaved(fns: dict[str, Callable], inputs, *, mode: str, n: int, reps: int) -> dict[str, list[float]]:
    """Like :func:`time_calls` for several implementations, samples taken in turn (A B A B …):
    a drift of the GPU's clock or temperature over the run (long large-M GEMMs) hits every
    implementation alike instead of whichever runs last."""
    runs = {name: make_runner(fn, inputs, mode=mode, n=n) for name, fn in fns.items()}
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, run in runs.items():
            out[name].append(sample_us(run, n))
    return out


def _iters(m: int, k: int, n_out: int) -> tuple[int, int]:
    flop = 2 * m * k * n_out
    if flop > 2e12:
        return 2, 5
    if flop > 2e11:
        return 5, 7
    return 20, 9


def implementations(public: bool = False, one_launch: bool = False) -> dict[str, Callable]:
    """cuBLAS and ours; ``public``: also the public op (eager only); ``one_launch``: also ours with
    a persistent launch's last wave kept in the one launch (``kernels.forward(tail=False)``, the
    ablation of ``configs.tail_split``; same bits)."""
    from rl_engine.backends.triton.gemm import linear_triton

    impls: dict[str, Callable] = {"cublas.F.linear": lambda x, w: F.linear(x, w), "rlk.triton.tile_gemm": lambda x, w: linear_triton(x, w, None)}
    if one_launch:
        from rl_engine.backends.triton.gemm import kernels

        impls["rlk.triton.tile_gemm.one_launch"] = lambda x, w: kernels.forward(x, w, None, tail=False)
    if public:
        from rl_engine.ops import gemm
        from rl_engine.utils.checks import nan_policy

        def pub(x, w):
            with nan_policy("propagate"):
                return gemm.linear(x, w)

        impls["rlk.ops.gemm.linear"] = pub
    return impls


def run(shapes: Sequence[str], ms: Sequence[int], modes: Sequence[str], public: bool, one_launch: bool = False) -> list[dict]:
    env = environment()
    rows: list[dict] = []
    impls = implementations(public, one_launch)
    for name in shapes:
        k, n_out = SHAPES[name]
        for m in ms:
            inputs = make_inputs(m, k, n_out)
            n_calls, reps = _iters(m, k, n_out)
            for mode in modes:
                # rlk.ops.gemm.linear under a graph is the same kernels as rlk.triton.tile_gemm
                fns = {impl: fn for impl, fn in impls.items() if not (impl == "rlk.ops.gemm.linear" and mode == "graph")}
                res = {impl: percentiles(ts) for impl, ts in time_interleaved(fns, inputs, mode=mode, n=n_calls, reps=reps).items()}
                base = res["cublas.F.linear"]["p50_us"]
                for impl, p in res.items():
                    row = {
                        **env,
                        "bench": "gemm_gpu",
                        "shape": name,
                        "M": m,
                        "K": k,
                        "N": n_out,
                        "dtype": "bfloat16",
                        "mode": mode,
                        "impl": impl,
                        **{kk: round(v, 3) for kk, v in p.items()},
                        "tflops": round(2 * m * k * n_out / (p["p50_us"] * 1e-6) / 1e12, 2),
                        "baseline": "cublas.F.linear",
                        "time_ratio": round(p["p50_us"] / base, 4),
                        "throughput_ratio": round(base / p["p50_us"], 4),
                    }
                    rows.append(row)
                    print(f"{name:8s} M={m:6d} {mode:5s} {impl:22s} p50 {p['p50_us']:10.1f} us  {row['tflops']:7.1f} TFLOP/s  x{row['time_ratio']:.3f}", flush=True)
            del inputs
            torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Targets: ≥ 0.95× cuBLAS throughput at M ≥ 1024; ≤ 1.0× cuBLAS time at M ≤ 64 (graph mode)."""
    out = []
    for r in rows:
        if r["impl"] != "rlk.triton.tile_gemm" or r["mode"] != "graph":
            continue
        if r["M"] >= 1024:
            target, ok = "throughput >= 0.95x cuBLAS", r["throughput_ratio"] >= 0.95
        elif r["M"] <= 64:
            target, ok = "time <= 1.0x cuBLAS", r["time_ratio"] <= 1.0
        else:
            target, ok = "(no target)", None
        out.append({"shape": r["shape"], "M": r["M"], "time_ratio": r["time_ratio"], "throughput_ratio": r["throughput_ratio"], "target": target, "met": ok})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ms", nargs="*", type=int, default=list(MS))
    ap.add_argument("--modes", nargs="*", default=["graph", "eager"], choices=["graph", "eager"])
    ap.add_argument("--public", action="store_true", help="also time the public rl_engine.ops.gemm.linear (eager)")
    ap.add_argument("--one-launch", action="store_true",
                    help="also time ours without the tail split (rows rlk.triton.tile_gemm.one_launch)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    rows = run(args.shapes, args.ms, args.modes, args.public, args.one_launch)
    summary = summarize(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print("\nshape     M      time_ratio  thr_ratio  target                        met")
    for s in summary:
        print(f"{s['shape']:8s} {s['M']:6d}  {s['time_ratio']:9.3f}  {s['throughput_ratio']:9.3f}  {s['target']:28s}  {s['met']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
