"""Where the device time of the MoE expert layer goes, kernel by kernel, on the GPU.

The layer of ``benchmarks/operators/bench_moe_gpu.py`` (its ``weights``, ``_layers`` and
``_fwd_bwd``): Qwen3-30B-A3B dimensions (hidden 2048, 128 experts, top-8, expert intermediate
768), bf16, router GEMM → ``moe.route`` → ``moe.experts`` through the public API (``ours``,
``triton.grouped``) against an F.linear router, fp32 softmax + ``torch.topk`` and
``torch._grouped_mm`` experts (``base``). Per token count (``--tokens``, default 1024,16384) and
case (``ours_fwd``, ``ours_fwd_bwd``, ``base_fwd``, ``base_fwd_bwd``), after ``--warmup`` calls
(compilation excluded):

* wall time per iteration: CUDA events around each of ``--iters`` eager calls, the median;
* ``--iters`` more calls under ``torch.profiler`` (CPU + CUDA), synchronised around each: every
  device event (kernels, memcpy, memset) summed per name — calls and device µs per iteration,
  share of the case's device time — and the total device µs per iteration (wall minus device:
  host time and launch gaps);
* achieved TFLOP/s of ``rlk_moe_grouped_gemm`` and ``rlk_moe_wgrad`` from the useful FLOPs
  (``2·rows·K·N``; padded tile rows not counted), per kernel and per role (gate_up, down, dx,
  dact, dW_gate_up, dW_down; ``scaled``: the routing weight scales the operand). While ``ours``
  is profiled, the launchers ``_grouped`` / ``_wgrad`` of ``rl_engine/backends/triton/moe/kernels.py``
  are wrapped to record each launch's shape; on one stream the i-th device launch of a kernel is
  its i-th host launch. Where the counts differ, no TFLOP/s (a note instead). The router GEMM and
  the baseline's kernels get none.

JSON to ``--out`` (rows: device, versions, tokens, case, kernel table, roles, totals); stdout: the
top ``--top`` kernels per case. CUDA only (exit 1 without it). For Nsight Compute, ``--single``
runs one warmed-up forward+backward of ``ours`` per token count between ``cudaProfilerStart`` and
``cudaProfilerStop`` (not an NVTX range: the backward launches from the autograd thread) and
prints the GEMM launches in order to stderr; ``--ncu-command`` prints the ncu command line over it (``--ncu-metrics``
overrides the metrics); ``--ncu-summary CSV`` prints ncu's ``--csv`` output launch by launch.
``--host-profile CALLS`` adds each case's ``cProfile`` of that many eager calls (``cprofile``: where
the host time of the eager rows goes, function by function).

    python3 tools/benchmarking/moe_profile_gpu.py --out $OUT/bench_moe_profile.json
    eval "$(python3 tools/benchmarking/moe_profile_gpu.py --ncu-command)" > /tmp/moe_ncu.csv
    python3 tools/benchmarking/moe_profile_gpu.py --ncu-summary /tmp/moe_ncu.csv
"""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
import statistics
import sys
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import cprofile_text, device_info, versions  # noqa: E402
from benchmarks.common.ncu import NCU_METRICS, read_launches  # noqa: E402
from benchmarks.operators import bench_moe_gpu as bench  # noqa: E402

#: hidden, experts, experts per token, expert intermediate size (Qwen3-30B-A3B)
DIMS = (2048, 128, 8, 768)
CASES = ("ours_fwd", "ours_fwd_bwd", "base_fwd", "base_fwd_bwd")
GEMM_KERNELS = ("rlk_moe_grouped_gemm", "rlk_moe_wgrad")
@contextmanager
def recording_launches(H: int, I: int):
    """Wrap the MoE GEMM launchers; yield the list of ``(kernel, role, useful FLOPs or None)``
    appended per launch, in host launch order (the autograd thread's launches included)."""
    from rl_engine.backends.triton.moe import kernels as km

    roles = {(2 * I, H): "gate_up", (H, I): "down", (H, 2 * I): "dx", (I, H): "dact"}
    wroles = {(2 * I, H): "dW_gate_up", (H, I): "dW_down"}
    log: list[tuple[str, str, float | None]] = []
    orig_g, orig_w = km._grouped, km._wgrad
    sig_g, sig_w = inspect.signature(orig_g), inspect.signature(orig_w)

    def grouped(*args, **kwargs):
        try:
            b = sig_g.bind(*args, **kwargs).arguments
            rows, n, kd = b["a_rows"].numel(), b["n"], b["kd"]
            if rows:  # the launcher returns without a launch when there are no slots
                tag = (" scaled" if b.get("scale") is not None else "") + f" [{b['cfg'].key}]"
                log.append((GEMM_KERNELS[0], f"{roles.get((n, kd), 'gemm')} N={n} K={kd}{tag}", 2.0 * rows * n * kd))
        except (TypeError, KeyError, AttributeError):
            log.append((GEMM_KERNELS[0], "?", None))
        return orig_g(*args, **kwargs)

    def wgrad(*args, **kwargs):
        try:
            b = sig_w.bind(*args, **kwargs).arguments
            _, n1, n2 = b["dw"].shape
            tag = (" scaled" if b.get("scale") is not None else "") + f" [{b['cfg'].key}]"
            log.append((GEMM_KERNELS[1], f"{wroles.get((n1, n2), 'wgrad')} {n1}x{n2}{tag}",
                        2.0 * b["l_rows"].numel() * n1 * n2))
        except (TypeError, KeyError, AttributeError, ValueError):
            log.append((GEMM_KERNELS[1], "?", None))
        return orig_w(*args, **kwargs)

    km._grouped, km._wgrad = grouped, wgrad
    try:
        yield log
    finally:
        km._grouped, km._wgrad = orig_g, orig_w


def device_events(prof) -> list[tuple[str, float, float]]:
    """``(name, start µs, duration µs)`` of every device event of ``prof``, in start order."""
    evs = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
           if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return sorted(evs, key=lambda ev: ev[1])


def kernel_table(events, iters: int) -> tuple[list[dict], float]:
    """Rows ``kernel, calls_per_iter, device_us_per_iter, share`` (slowest first) and the device
    µs per iteration."""
    agg: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, _, us in events:
        agg[name][0] += 1
        agg[name][1] += us
    total = sum(t for _, t in agg.values())
    rows = [{"kernel": n, "calls_per_iter": c / iters, "device_us_per_iter": round(t / iters, 2),
             "share": round(t / total, 4) if total else 0.0} for n, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r["device_us_per_iter"]), total / iters


def attribute(events, launches, iters: int, table: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Match the i-th device launch of each GEMM kernel with its i-th recorded host launch: rows
    per (kernel, role) with TFLOP/s, ``tflops`` set on the kernel table's rows, and a note per
    kernel that could not be matched (its TFLOP/s left out)."""
    roles: dict[tuple[str, str], list] = {}
    notes: dict[str, str] = {}
    for k in GEMM_KERNELS:
        evs = [ev for ev in events if ev[0].startswith(k)]
        calls = [c for c in launches if c[0] == k]
        if not evs and not calls:
            continue
        if len(evs) != len(calls) or any(c[2] is None for c in calls):
            notes[k] = f"{len(evs)} device launches, {len(calls)} recorded host launches: not attributed"
            continue
        for (_, _, us), (_, role, flops) in zip(evs, calls):
            r = roles.setdefault((k, role), [0, 0.0, 0.0])
            r[0], r[1], r[2] = r[0] + 1, r[1] + us, r[2] + flops
        names = {ev[0] for ev in evs}
        flops, us = sum(c[2] for c in calls), sum(ev[2] for ev in evs)
        for row in table:
            if row["kernel"] in names and len(names) == 1 and us > 0:
                row["tflops"] = round(flops / us / 1e6, 2)
    rows = [{"kernel": k, "role": role, "calls_per_iter": c / iters, "device_us_per_iter": round(t / iters, 2),
             "gflop_per_iter": round(f / iters / 1e9, 3), "tflops": round(f / t / 1e6, 2) if t > 0 else None}
            for (k, role), (c, t, f) in roles.items()]
    return sorted(rows, key=lambda r: -r["device_us_per_iter"]), notes


def case_fns(x, weights, K: int, names) -> dict:
    """Callables of the named cases, built as bench_moe_gpu builds them (fwd_bwd: fresh leaves)."""
    ours, base = bench._layers(x, *weights, K)
    out = {}
    for name in names:
        if name.endswith("fwd_bwd"):
            leaves = [t.clone().requires_grad_() for t in (x, *weights)]
            out[name] = bench._fwd_bwd(bench._layers(*leaves, K)[0 if name.startswith("ours") else 1], leaves)
        else:
            out[name] = ours if name.startswith("ours") else base
    return out


def wall_us(fn, iters: int) -> list[float]:
    """Wall µs of each of ``iters`` calls (CUDA events, synchronised around each)."""
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def profile_case(fn, ours: bool, iters: int, warmup: int) -> dict:
    """Warm up, time ``iters`` calls, then profile ``iters`` more (launch roles recorded for ours)."""
    H, _, _, I = DIMS
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    wall = wall_us(fn, iters)
    with recording_launches(H, I) if ours else nullcontext([]) as log:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                torch.cuda.synchronize()
                fn()
                torch.cuda.synchronize()
    events = device_events(prof)
    table, device_us = kernel_table(events, iters)
    roles, notes = attribute(events, log, iters, table) if ours else ([], {})
    return {"device_us_per_iter": round(device_us, 2), "wall_us_median": round(statistics.median(wall), 2),
            "wall_us": [round(w, 2) for w in wall], "kernels": table, "gemm_roles": roles, "attribution_notes": notes}


def print_row(row: dict, top: int) -> None:
    if row.get("cprofile"):
        print(f"== cProfile T={row['tokens']} {row['case']}\n{row['cprofile'][:2500]}")
    print(f"T={row['tokens']} {row['case']} ({row['implementation']}): device {row['device_us_per_iter'] / 1e3:.3f} "
          f"ms/iter, wall {row['wall_us_median'] / 1e3:.3f} ms (median of {row['iters']}), "
          f"{len(row['kernels'])} kernels")
    for r in row["kernels"][:top]:
        tf = f"  {r['tflops']:.1f} TFLOP/s" if "tflops" in r else ""
        print(f"  {100 * r['share']:5.1f}% {r['device_us_per_iter']:11.1f} us x{r['calls_per_iter']:<5g} "
              f"{r['kernel'][:110]}{tf}")
    for r in row["gemm_roles"]:
        print(f"      {r['kernel']} {r['role']}: {r['device_us_per_iter']:.1f} us x{r['calls_per_iter']:g}, "
              f"{r['tflops']} TFLOP/s")
    for k, note in row["attribution_notes"].items():
        print(f"      {k}: {note}")
    sys.stdout.flush()


def ncu_summary(path: str) -> int:
    """Print ncu's ``--csv`` output (a row per launch and metric) as one block per launch."""
    launches = read_launches(path)
    if not launches:
        print(f"{path}: no ncu CSV rows")
        return 1
    for launch in launches:
        print(f"#{launch['id']} {launch['kernel']} grid {launch['grid']}")
        items = [f"{k}={v}" for k, v in launch["metrics"].items()]
        for i in range(0, len(items), 4):
            print("    " + "  ".join(items[i:i + 4]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON report to write (required unless --single, --ncu-command, --ncu-summary)")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1024,16384)")
    ap.add_argument("--iters", type=int, default=5, help="profiled and timed iterations per case")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=8, help="kernels printed per case")
    ap.add_argument("--single", action="store_true",
                    help="one warmed-up forward+backward of ours per token count, between cudaProfilerStart and "
                         "cudaProfilerStop (for ncu)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="also cProfile CALLS eager calls of each case (host time by function; the device kept ahead)")
    ap.add_argument("--ncu-command", action="store_true", help="print the ncu command line over --single and exit")
    ap.add_argument("--ncu-metrics", default=",".join(NCU_METRICS), help="metrics of --ncu-command")
    ap.add_argument("--ncu-summary", metavar="CSV", help="print an ncu --csv output one launch at a time and exit")
    args = ap.parse_args(argv)
    if args.ncu_summary:
        return ncu_summary(args.ncu_summary)
    try:
        tokens = bench._ints(args.tokens, "--tokens") if args.tokens else (1024, 16384)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    H, E, K, I = DIMS
    if args.iters < 1 or args.warmup < 0 or args.top < 0 or args.host_profile < 0:
        ap.error("--iters must be positive, --warmup, --top and --host-profile non-negative")
    if args.ncu_command:
        script = Path(__file__).resolve()
        if Path.cwd() in script.parents:  # the repository root (as gpu_all_run.sh runs it): a relative path
            script = script.relative_to(Path.cwd())
        cmd = ["ncu", "--target-processes", "all", "--profile-from-start", "off", "--clock-control", "none",
               "--kernel-name", "regex:rlk_moe", "--csv", "--print-units", "base", "--metrics", args.ncu_metrics,
               sys.executable, str(script), "--single", "--tokens", args.tokens or "16384"]
        print(shlex.join(cmd))
        return 0
    if not args.single and not args.out:
        ap.error("--out is required (or --single / --ncu-command / --ncu-summary)")
    if not torch.cuda.is_available():
        print("moe_profile_gpu: no CUDA device visible; this tool profiles the GPU kernels only", file=sys.stderr)
        return 1
    weights, g = bench.weights(H, E, I, torch.bfloat16, "cuda")
    dev, ver = device_info("cuda"), versions()
    base_impl = bench.baseline_name()
    rows: list[dict] = []
    for T in tokens:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        if args.single:
            fn = case_fns(x, weights, K, ["ours_fwd_bwd"])["ours_fwd_bwd"]
            for _ in range(max(args.warmup, 1)):
                fn()
            torch.cuda.synchronize()
            with recording_launches(H, I) as log:
                torch.cuda.profiler.start()
                fn()
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            for i, (k, role, _) in enumerate(log):
                print(f"T={T} GEMM launch {i}: {k} {role}", file=sys.stderr)
            continue
        for case, fn in case_fns(x, weights, K, CASES).items():
            row = {"device": dev["name"], "torch": ver["torch"], "triton": ver["triton"], "tokens": T, "case": case,
                   "implementation": bench.IMPL if case.startswith("ours") else base_impl, "hidden": H, "experts": E,
                   "top_k": K, "moe_intermediate": I, "dtype": "bfloat16", "iters": args.iters}
            rows.append({**row, **profile_case(fn, case.startswith("ours"), args.iters, args.warmup)})
            if args.host_profile:
                rows[-1]["cprofile"] = cprofile_text(fn, args.host_profile, top=25, warmup=2, device="cuda",
                                                     ahead_s_per_call=2e-3)  # the GPU kept ahead
            print_row(rows[-1], args.top)
        del x, fn
        torch.cuda.empty_cache()
        # rewritten after every token count: a time limit keeps the finished rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "moe_profile_gpu", "device": dev, "versions": ver,
                                              "baseline": base_impl, "rows": rows}, indent=1))
    if not args.single:
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
