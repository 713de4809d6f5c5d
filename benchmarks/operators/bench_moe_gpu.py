"""Mixture-of-experts layer on the GPU through the public API, eager and CUDA graphs, against a
non-invariant grouped GEMM.

One routed-expert layer at Qwen3-30B-A3B dimensions (hidden 2048, 128 experts, 8 per token,
expert intermediate 768; ``--hidden/--experts/--top-k/--intermediate`` change them) on ``T``
tokens (``--tokens``, default 1 … 16,384), bf16:

* rl-kernel: ``gemm.linear`` (router) → ``moe.route`` → ``moe.experts`` (``triton.grouped``);
* baseline: ``F.linear`` router, fp32 softmax + ``torch.topk``, then the experts through
  ``torch._grouped_mm`` on the tokens sorted by expert (when this torch has it), else a per-expert
  cuBLAS loop (``F.linear`` per expert: host-synchronising, so its graph rows are skipped).

``--kinds fwd,fwd_bwd``: forward, and forward + backward (input, router and expert weights). Each
configuration runs eagerly (``measure_interleaved``: candidates round-robin) and replayed from CUDA
graphs (``cuda_graphs_interleaved_ms``), rows with median/p20/p80, peak memory, device and
versions; rl-kernel rows carry ``ratio_vs_baseline`` from the same run. Nothing is gated.

``--device cpu --tiny`` runs the same code paths on the CPU with tiny sizes (eager only: the
rl-kernel side then runs the CPU backend): a dry run of the script, not a measurement.

Usage::

    python benchmarks/operators/bench_moe_gpu.py --out reports/gpu/h200/moe.json
    python benchmarks/operators/bench_moe_gpu.py --device cpu --tiny --out /tmp/moe_dry.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from benchmarks.common.harness import (
    cuda_graphs_interleaved_ms,
    device_info,
    machine_load,
    make_row,
    measure_interleaved,
    peak_memory,
    summarize,
    versions,
    write_report,
)

BENCHMARK = "bench_moe_gpu"
IMPL = "triton.grouped"
KINDS = ("fwd", "fwd_bwd")
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{name}: expected positive integers, comma-separated, got {text!r}")
    return vals


def baseline_name() -> str:
    return "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "cublas.per_expert_loop"


def _baseline_experts(x, wgu, wd, w, ids):
    """Experts of the baseline: tokens sorted by expert, gate/up and down GEMMs, weighted sum."""
    from rl_engine.utils.routing import expert_permutation

    perm = expert_permutation(ids, wgu.shape[0])  # the slots sorted by expert (capturable: no host read)
    order, tok = perm.order, perm.tokens
    xs = x[tok]
    if hasattr(torch, "_grouped_mm"):
        offs = perm.offsets[1:].to(torch.int32)
        h = torch._grouped_mm(xs, wgu.transpose(1, 2), offs=offs)
        d = h.shape[-1] // 2
        y = torch._grouped_mm(F.silu(h[:, :d]) * h[:, d:], wd.transpose(1, 2), offs=offs)
    else:  # one cuBLAS call per expert (host-synchronising: reads the counts)
        counts = perm.counts.tolist()
        ys, s = [], 0
        for e, n in enumerate(counts):
            if n:
                h = F.linear(xs[s:s + n], wgu[e])
                d = h.shape[-1] // 2
                ys.append(F.linear(F.silu(h[:, :d]) * h[:, d:], wd[e]))
            s += n
        y = torch.cat(ys)
    out = torch.zeros_like(x)
    return out.index_add_(0, tok, y * w.reshape(-1)[order, None].to(y.dtype))


def _layers(x, wr, wgu, wd, K):
    from rl_engine.ops import moe
    from rl_engine.ops.gemm import linear

    def ours(x=x, wr=wr, wgu=wgu, wd=wd):
        w, ids = moe.route(linear(x, wr), K, True)
        return moe.experts(x, wgu, wd, w, ids)

    def base(x=x, wr=wr, wgu=wgu, wd=wd):
        p = torch.softmax(F.linear(x, wr), dim=-1, dtype=torch.float32)
        w, ids = torch.topk(p, K, dim=-1)
        return _baseline_experts(x, wgu, wd, w / w.sum(-1, keepdim=True), ids)

    return ours, base


def _fwd_bwd(fn, leaves):
    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).sum().backward()
    return run


def weights(H: int, E: int, I: int, dtype: torch.dtype, device: str):
    """``((w_router [E, H], w_gate_up [E, 2I, H], w_down [E, H, I]), generator)``: the layer's
    weights drawn from a CPU generator seeded 0, scaled by ``1/sqrt(fan-in)``; the generator then
    draws the inputs, so every tool built on this benchmark times the same data."""
    g = torch.Generator().manual_seed(0)
    wr = (torch.randn(E, H, generator=g) / H**0.5).to(dtype).to(device)
    wgu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype).to(device)
    wd = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype).to(device)
    return (wr, wgu, wd), g


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report to write")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (hidden 64, 8 experts, 2 per token, I 32; tokens 1,16)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1..16384)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--kinds", default="fwd,fwd_bwd", help="fwd, fwd_bwd")
    ap.add_argument("--modes", default=None, help="eager, graph (default both on cuda, eager on cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    try:
        tokens = _ints(args.tokens, "--tokens") if args.tokens else ((1, 16) if args.tiny else DEFAULT_TOKENS)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: expected a subset of {','.join(KINDS)}, got {args.kinds!r}")
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        ap.error(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    on_gpu = args.device != "cpu"
    modes = tuple(m for m in (args.modes or ("eager,graph" if on_gpu else "eager")).split(",") if m)
    if not modes or set(modes) - {"eager", "graph"} or ("graph" in modes and not on_gpu):
        ap.error(f"--modes: expected eager and/or graph (graph needs --device cuda), got {args.modes!r}")
    H, E, K, I = (64, 8, 2, 32) if args.tiny else (args.hidden, args.experts, args.top_k, args.intermediate)
    if min(H, E, K, I) < 1 or K > E:
        ap.error("--hidden/--experts/--top-k/--intermediate: expected positive sizes with top-k <= experts")
    if on_gpu and not torch.cuda.is_available():
        print("bench_moe_gpu: no CUDA device visible (use --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dev, ver = device_info(args.device), versions()
    base_name = baseline_name()
    graph_base = base_name == "torch._grouped_mm"
    (wr, wgu, wd), g = weights(H, E, I, dtype, args.device)
    rows: list[dict[str, Any]] = []
    for T in tokens:
        x = torch.randn(T, H, generator=g).to(dtype).to(args.device)
        ours, base = _layers(x, wr, wgu, wd, K)
        for kind in kinds:
            if kind == "fwd":
                fns = {"ours": ours, "base": base}
            else:
                lo = [t.clone().requires_grad_() for t in (x, wr, wgu, wd)]
                lb = [t.clone().requires_grad_() for t in (x, wr, wgu, wd)]
                ours_l, base_l = _layers(*lo, K), _layers(*lb, K)
                fns = {"ours": _fwd_bwd(lambda *a, f=ours_l[0]: f(*a), lo), "base": _fwd_bwd(lambda *a, f=base_l[1]: f(*a), lb)}
            for mode in modes:
                if mode == "graph":
                    names = ["ours", "base"] if graph_base else ["ours"]
                    ms = cuda_graphs_interleaved_ms({n: fns[n] for n in names}, calls=4, repeats=args.repeats)
                    stats = {n: summarize(s) for n, s in ms.items()}
                else:
                    stats = measure_interleaved(fns, warmup=args.warmup, repeats=args.repeats, device=args.device)
                cfg = {"tokens": T, "hidden": H, "experts": E, "top_k": K, "moe_intermediate": I,
                       "dtype": str(dtype).split(".")[-1], "kind": kind, "mode": mode}
                for name in ("base", "ours"):
                    if name not in stats:
                        continue
                    mem, method = peak_memory(fns[name], device=args.device)
                    extra = {"machine_load": machine_load()}
                    if name == "ours" and "base" in stats:
                        extra["ratio_vs_baseline"] = stats["ours"].median / stats["base"].median
                    rows.append(make_row(benchmark=BENCHMARK, op="moe.layer",
                                         implementation=IMPL if name == "ours" else base_name,
                                         baseline=base_name if name == "ours" and "base" in stats else None,
                                         config=cfg, stats=stats[name], warmup=args.warmup, device=dev, versions=ver,
                                         peak_memory_bytes=mem, peak_memory_method=method, extra=extra))
                r = rows[-1]
                ratio = f" x{r['ratio_vs_baseline']:.2f}" if "ratio_vs_baseline" in r else ""
                print(f"moe.layer T={T} {kind} {mode}: rl-kernel {r['median']:.3f} ms{ratio}", flush=True)
        # rewritten after every token count: a time limit keeps the finished rows
        write_report(rows, args.out, meta={"baseline": base_name, "dry_run_on_cpu": not on_gpu})
    write_report(rows, args.out, meta={"baseline": base_name, "dry_run_on_cpu": not on_gpu})
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
