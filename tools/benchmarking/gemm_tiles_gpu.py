"""Measure ``gemm.linear`` tile candidates at the matrix's shapes of one M and write that M's rows.

For each M of ``--ms`` every GEMM point of the benchmark matrix at that M
(``benchmarks/operators/bench_matrix_gpu.py``: each preset's qkv / o_proj / gate_up / down,
Llama-3-8B's MLP and LM head, the ragged shapes; ``--presets`` narrows them) runs, in bf16,
cuBLAS, the configuration the tile table selects at the run (the *incumbent*) and every candidate of
:func:`candidates` through ``kernels.forward``:

* **bits**: a candidate whose output differs from the incumbent's on raw bits, or that fails to
  compile, is rejected at that shape with the reason;
* **time**: per-call µs under a CUDA graph of calls over rotating inputs (more bytes than L2), the
  median of ``--repeats`` samples, every implementation sampled in turn
  (``bench_gemm_gpu.time_interleaved``) so that clock drift hits all alike.

**Selection** (:func:`choose_bands`, pure): the shapes, sorted by N, are cut into at most
``--max-bands`` bands of consecutive N (shapes with equal N share a band), each band served by
one configuration; the cut minimises the sum over shapes of ``time / cuBLAS time``. A
configuration may serve a band only if at every shape of the band it is accepted and at most
``--tolerance`` slower than that shape's incumbent (no row trades one shape's time for
another's), and a band holds at least ``--min-band-shapes`` shapes, so no row is a rule that one
shape exercises. When the best cut does not lower the summed ratio by ``--min-gain``, the table
keeps its rows for that M.

**Rows**: the chosen bands replace the table's rows bounded by ``max_m = M`` (inserted before the
first row of a larger bound where there were none) for bf16 and fp16 (same operand width and
tensor-core rate; fp32 runs other kernels), each band bounded by its largest N and the last one
unbounded. So the rows serve every M above the next smaller bound up to the measured M.
``--rebuild REPORT`` writes the table again from an earlier run's report, without a GPU
(``--keep OTHER``: another run's M values, same device and commit, join it).

    python3 tools/benchmarking/gemm_tiles_gpu.py --out $OUT/gemm_tiles.json --ms 256,1024 --commit $(git rev-parse --short HEAD)

CUDA only for measuring (exit 1 without it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "operators"))

from rl_engine.backends.triton.gemm.configs import TileConfig as C  # noqa: E402

#: dtypes whose rows a run writes (measured in bf16; fp16 has the same operand width and MMA rate)
DTYPES = ("bfloat16", "float16")
_P = dict(tma=True, persistent=True)
_PW = dict(_P, warp_specialize=True)


def candidates(m: int) -> list[C]:
    """Tiles measured at ``m`` rows: at mid-sized M the output has few tiles (Qwen3-0.6B's o_proj
    at M = 256 is 32 tiles of 64 × 128 on 132 SMs), so narrower and shorter tiles that fill the SMs
    join the compute-bound ones; the persistent ones walk the tiles one program an SM. At M ≤ 256
    the 64-row tiles also run with 8 warps: with one tile an SM, the 4-warp tile keeps 6 % of the
    SM's warp slots busy where cuBLAS keeps 13–15 % (ncu, reports/gpu/h100/matrix_ncu.json). On
    the H100 the 8-warp tiles measure 1.11–1.71× cuBLAS at the matrix's M = 256 shapes (N = 5,003
    aside), the table's 4-warp tiles 1.07–1.45× (docs/operators/gemm-gpu.md)."""
    out = [C(64, 32, 128, 4, 4, tma=True), C(64, 64, 64, 4, 6, tma=True), C(64, 64, 128, 4, 4, tma=True),
           C(64, 128, 64, 4, 4, tma=True), C(64, 128, 128, 4, 3, tma=True), C(128, 64, 64, 4, 4, tma=True),
           C(128, 128, 64, 4, 4, tma=True), C(128, 128, 64, 4, 4, **_P), C(64, 128, 64, 4, 4, **_P),
           C(128, 64, 64, 4, 4, **_P)]
    if m <= 256:
        out += [C(16, 64, 128, 4, 4, tma=True), C(32, 64, 128, 4, 4, tma=True), C(64, 256, 64, 4, 3, tma=True),
                C(64, 128, 64, 8, 4, tma=True), C(64, 128, 128, 8, 3, tma=True), C(64, 256, 64, 8, 3, tma=True),
                C(64, 64, 128, 8, 4, tma=True)]
    else:
        out += [C(128, 128, 64, 4, 5, tma=True), C(128, 256, 64, 8, 3, **_PW), C(128, 128, 64, 8, 4, **_PW)]
    return out


def shapes_at(m: int, presets: Sequence[str] | None = None) -> list[tuple[str, int, int]]:
    """``(case, K, N)`` of the matrix's GEMM points at ``m`` rows (``presets``: those presets' only)."""
    import bench_matrix_gpu as matrix

    pts = matrix.select(matrix.all_points(tiny=False, quick=False, ms=[m]), families=["gemm"], presets_=presets,
                        cases=None)
    return [(p.case, int(p.config["K"]), int(p.config["N"])) for p in pts]


def choose_bands(meas: Sequence[dict], *, tolerance: float = 0.02, max_bands: int = 4, min_shapes: int = 2,
                 min_gain: float = 0.02) -> dict:
    """The band cut of one M's measurements (module docstring).

    ``meas``: one dict a shape with ``N``, ``incumbent`` (its configuration's key), ``cublas_us``
    and ``us`` (configuration key → median µs, ``None`` where rejected). Returns ``{"bands":
    [{"max_n", "config", "cases", "ratio_sum", "incumbent_ratio_sum"}], "ratio_sum",
    "incumbent_ratio_sum", "changed", "reason"}``; ``bands`` is empty when the table keeps its rows."""
    if not meas:
        raise ValueError("meas: expected the measurements of at least one shape, got none")
    if max_bands < 1 or min_shapes < 1 or tolerance < 0 or min_gain < 0:
        raise ValueError(f"expected max_bands >= 1, min_shapes >= 1, tolerance >= 0, min_gain >= 0, got "
                         f"{max_bands}, {min_shapes}, {tolerance}, {min_gain}")
    groups: list[list[dict]] = []
    for row in sorted(meas, key=lambda r: (r["N"], r["case"])):
        if groups and groups[-1][0]["N"] == row["N"]:
            groups[-1].append(row)
        else:
            groups.append([row])
    keys = sorted({k for r in meas for k, v in r["us"].items() if v is not None})
    inc_sum = sum(r["us"][r["incumbent"]] / r["cublas_us"] for r in meas)

    def band_cost(i: int, j: int) -> tuple[float, str | None]:
        rows = [r for g in groups[i:j + 1] for r in g]
        if len(rows) < min_shapes:
            return math.inf, None
        best = (math.inf, None)
        for k in keys:
            us = [r["us"].get(k) for r in rows]
            if any(u is None or u > (1 + tolerance) * r["us"][r["incumbent"]] for u, r in zip(us, rows)):
                continue
            cost = sum(u / r["cublas_us"] for u, r in zip(us, rows))
            best = min(best, (cost, k))
        return best

    G = len(groups)
    cost = {(i, j): band_cost(i, j) for i in range(G) for j in range(i, G)}
    # dp[b][j]: the least cost of groups 0..j cut into b bands, with the cut that reaches it
    dp: list[list[tuple[float, list[tuple[int, int]]]]] = [[(math.inf, [])] * G for _ in range(max_bands + 1)]
    for j in range(G):
        dp[1][j] = (cost[0, j][0], [(0, j)])
    for b in range(2, max_bands + 1):
        for j in range(G):
            for i in range(1, j + 1):
                prev = dp[b - 1][i - 1]
                c = prev[0] + cost[i, j][0]
                if c < dp[b][j][0]:
                    dp[b][j] = (c, prev[1] + [(i, j)])
    # fewest bands among the cuts within 0.1 % of the least cost
    least = min(dp[b][G - 1][0] for b in range(1, max_bands + 1))
    out = {"ratio_sum": least, "incumbent_ratio_sum": inc_sum, "bands": [], "changed": False}
    if math.isinf(least):
        out["reason"] = (f"no cut into at most {max_bands} bands of >= {min_shapes} shapes has a configuration within "
                         f"{tolerance:.0%} of the incumbent at every shape of each band")
        return out
    cut = next(dp[b][G - 1][1] for b in range(1, max_bands + 1) if dp[b][G - 1][0] <= least * 1.001)
    bands = []
    for n, (i, j) in enumerate(cut):
        rows = [r for g in groups[i:j + 1] for r in g]
        c, k = cost[i, j]
        bands.append({"max_n": None if n == len(cut) - 1 else groups[j][0]["N"], "config": k,
                      "cases": [r["case"] for r in rows], "ratio_sum": c,
                      "incumbent_ratio_sum": sum(r["us"][r["incumbent"]] / r["cublas_us"] for r in rows)})
    out["ratio_sum"] = sum(b["ratio_sum"] for b in bands)
    if out["ratio_sum"] > (1 - min_gain) * inc_sum:
        out["reason"] = (f"the best cut sums {out['ratio_sum']:.3f} x cuBLAS against the incumbent's {inc_sum:.3f}: "
                         f"less than the {min_gain:.0%} gain a change needs")
        return out
    out.update(bands=bands, changed=True, reason=None)
    return out


def apply_bands(table: dict, m: int, bands: Sequence[dict], note: str, dtypes: Sequence[str] = DTYPES) -> dict:
    """``table`` (a ``GemmTable`` JSON) with ``dtypes``' rows bounded by ``max_m = m`` replaced by
    one row a band (bounded by the band's ``max_n``, the last unbounded)."""
    if not bands or bands[-1]["max_n"] is not None:
        raise ValueError("bands: expected at least one band, the last unbounded in N (max_n None)")
    forward = [r for r in table["forward"] if not (r["dtype"] in dtypes and r.get("max_m") == m)]
    for dt in dtypes:
        new = [{"dtype": dt, "max_m": m, "max_n": b["max_n"], "config": _config_json(C.from_key(b["config"])),
                "note": f"{note}; time/cuBLAS summed over its {len(b['cases'])} shapes: {b['ratio_sum']:.2f}"}
               for b in bands]
        at = next((i for i, r in enumerate(forward)
                   if r["dtype"] == dt and (r.get("max_m") is None or r["max_m"] > m)), None)
        if at is None:
            raise ValueError(f"table: expected {dt} rows ending with an unbounded one, found none past max_m={m}")
        forward[at:at] = new
    return dict(table, forward=forward)


def _config_json(cfg: C) -> dict:
    from dataclasses import asdict

    d = asdict(cfg)
    return {k: v for k, v in d.items() if not (isinstance(v, bool) and not v)}


def compile_rows(m: int) -> int:
    """The rows a precompile launch uses for ``m``: 256 for a multiple of 16 above 256, ``m``
    itself otherwise. Triton specialises an integer argument only on being 1 or a multiple of 16,
    so the one-program-a-tile kernels compile as ``m`` rows run them, while a worker's operands stay
    small (an LM head's output at M = 16,384 is 4 GiB); a persistent kernel's tile-range arguments
    may specialise otherwise, and the measuring process then compiles that one itself."""
    return 256 if m > 256 and m % 16 == 0 else m


def _compile_worker(jobs: list[tuple[int, int, int, str]]) -> list[str]:
    """Launch each ``(M, K, N, config key)`` once on zeros (a spawned process: fills Triton's
    on-disk cache, which the measuring process then loads instead of compiling); returns errors."""
    from rl_engine.backends.triton.gemm import kernels

    errors = []
    for m, k, n, key in jobs:
        try:
            x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
            kernels.forward(x, w, None, config=C.from_key(key))
        except Exception as exc:  # the measuring process records the failure with the candidate
            errors.append(f"{key} at {m}x{k}x{n}: {type(exc).__name__}")
    torch.cuda.synchronize()
    return errors


def precompile(jobs: list[tuple[int, int, int, str]], workers: int) -> None:
    import multiprocessing as mp

    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        for errs in pool.map(_compile_worker, chunks):
            for e in errs:
                print(f"precompile: {e}", flush=True)


def measure(m: int, case: str, k: int, n: int, cands: Sequence[C], repeats: int) -> dict:
    """One shape: the incumbent, every candidate and cuBLAS, bits then time (module docstring)."""
    import bench_gemm_gpu as bench

    from rl_engine.backends.triton.gemm import kernels
    from rl_engine.backends.triton.gemm.configs import select_forward
    from rl_engine.utils.bits import same_bits

    inc = select_forward(torch.bfloat16, m, n)
    todo = list(dict.fromkeys([inc, *cands]))
    inputs = bench.make_inputs(m, k, n)
    x0, w0 = inputs[0]
    ref = kernels.forward(x0, w0, None, config=inc).clone()
    row = {"case": case, "M": m, "K": k, "N": n, "incumbent": inc.key, "rejected": {}, "us": {}}
    fns = {"cublas": lambda x, w: torch.nn.functional.linear(x, w)}
    for cfg in todo:
        try:
            out = kernels.forward(x0, w0, None, config=cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # out of shared memory or registers for this tile
            row["rejected"][cfg.key] = f"launch failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        cmp = same_bits(out, ref)
        if not cmp.equal:
            row["rejected"][cfg.key] = f"bits differ from the incumbent's ({cmp})"
            continue
        fns[cfg.key] = lambda x, w, cfg=cfg: kernels.forward(x, w, None, config=cfg)
    calls, reps = bench._iters(m, k, n)
    # each graph keeps its calls' outputs alive: at large M x N (an LM head at M = 16384 is 4 GiB a
    # call) the candidates are timed a few at a time, cuBLAS in every group, so that the graphs fit in
    # half the free memory; a group's times are scaled by its cuBLAS time to the first group's
    per_fn = calls * m * n * x0.element_size()
    group = max(1, int(0.5 * torch.cuda.mem_get_info()[0] // per_fn) - 1)
    names = [key for key in fns if key != "cublas"]
    row["us"], row["groups"] = {}, 0
    for i in range(0, len(names), group):
        ts = bench.time_interleaved({"cublas": fns["cublas"], **{key: fns[key] for key in names[i:i + group]}},
                                    inputs, mode="graph", n=calls, reps=max(repeats, reps))
        cublas = statistics.median(ts.pop("cublas"))
        row.setdefault("cublas_us", cublas)
        row["us"].update({key: statistics.median(v) * row["cublas_us"] / cublas for key, v in ts.items()})
        row["groups"] += 1
        del ts
        torch.cuda.empty_cache()
    row["us"].update({key: None for key in row["rejected"]})
    row["calls_per_sample"] = calls
    return row


def write(report: dict, table_path: Path, out: Path) -> None:
    """The report, and the table with every M's chosen bands (validated, then loaded back)."""
    from rl_engine.backends.triton.gemm import configs

    table = report["base_table"]  # the table the run measured against (main stores it; rebuild reads it back)
    for m_key, res in sorted(report["choices"].items(), key=lambda kv: int(kv[0])):
        if res["changed"]:
            note = (f"M <= {m_key} (measured at M = {m_key} on the {report['device']['name']}, "
                    f"{report['source']['commit']}: tools/benchmarking/gemm_tiles_gpu.py)")
            table = apply_bands(table, int(m_key), res["bands"], note)
    if any(res["changed"] for res in report["choices"].values()):
        import bench_matrix_gpu as matrix

        src = dict(table["source"])
        src["mid_m_tiles"] = (f"rows max_m in {sorted(int(k) for k, r in report['choices'].items() if r['changed'])}: "
                              f"{report['source']['command']} on the {report['device']['name']} at "
                              f"{report['source']['commit']} (reports/gpu/{matrix.platform_key(report['device']['name'])}"
                              f"/gemm_tiles.json)")
        table = dict(table, source=src)
    configs.GemmTable.model_validate(table)
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    configs.load_table(table_path)
    out.write_text(json.dumps(report, indent=1) + "\n")


def rebuild(report_path: Path, table_path: Path | None, args) -> int:
    """Choose and write the rows of an earlier run's report again (its measurements, no GPU)."""
    from rl_engine.backends.triton.gemm import configs

    rep = json.loads(report_path.read_text())
    for extra in args.keep or ():  # another run's M values, measured at the same commit on the same device
        other = json.loads(Path(extra).read_text())
        if (other["device"]["name"], other["source"]["commit"]) != (rep["device"]["name"], rep["source"]["commit"]):
            raise SystemExit(f"--keep {extra}: expected a run on the {rep['device']['name']} at "
                             f"{rep['source']['commit']}, got {other['device']['name']} at {other['source']['commit']}")
        added = {m: rows for m, rows in other["measurements"].items() if m not in rep["measurements"] and rows}
        rep["measurements"].update(added)
        rep["source"].setdefault("kept", []).append(f"{other['source']['command']}: M = {', '.join(added)}")
    rep["choices"] = {m: choose_bands(rows, tolerance=args.tolerance, max_bands=args.max_bands,
                                      min_shapes=args.min_band_shapes, min_gain=args.min_gain)
                      for m, rows in rep["measurements"].items() if rows}
    if args.commit:
        rep["source"]["commit"] = args.commit
    path = table_path or configs.table_path(rep["arch"])
    write(rep, path, Path(report_path) if args.out is None else Path(args.out))
    for m, res in rep["choices"].items():
        print(f"M={m}: " + (", ".join(f"N<={b['max_n']}: {b['config']}" for b in res["bands"]) or f"kept ({res['reason']})"))
    print(f"wrote {path}")
    return 0


def _m_values(text: str) -> list[int]:
    """``--ms``: positive M values, comma-separated."""
    values = [v for v in text.split(",") if v]
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive M values, comma-separated, got {text!r}")
    return [int(v) for v in values]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON of every measurement and choice (required unless --rebuild)")
    ap.add_argument("--commit", default=None, help="the measured tree's commit (required to measure: the device's "
                                                    "copy of the tree may carry another checkout's git history)")
    ap.add_argument("--rebuild", type=Path, default=None, metavar="REPORT",
                    help="choose and write the rows from an earlier run's report (no GPU, nothing measured)")
    ap.add_argument("--keep", action="append", default=None, metavar="REPORT",
                    help="with --rebuild: another run's report (same device and commit) whose M values join (repeatable)")
    ap.add_argument("--table", default=None, help="tile table to write (default: the package's tile_tables/<arch>.json)")
    ap.add_argument("--ms", type=_m_values, default=[256, 1024],
                    help="M values, comma-separated (each writes rows bounded by it)")
    ap.add_argument("--presets", default=None, help="the matrix's GEMM presets to measure, comma-separated (default all)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tolerance", type=float, default=0.02, help="slowest a band's configuration may be against a "
                                                                   "shape's incumbent (fraction)")
    ap.add_argument("--max-bands", type=int, default=4)
    ap.add_argument("--min-band-shapes", type=int, default=2)
    ap.add_argument("--min-gain", type=float, default=0.02, help="least fall of the summed time/cuBLAS ratio a change needs")
    ap.add_argument("--compile-workers", type=int, default=8, help="processes compiling the candidates first (0: none)")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop measuring after this long (finished M values are kept)")
    args = ap.parse_args(argv)
    for name in ("max_bands", "min_band_shapes", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive count, got {getattr(args, name)}")
    if args.compile_workers < 0:
        ap.error(f"--compile-workers: expected a count >= 0, got {args.compile_workers}")
    if args.tolerance < 0 or args.min_gain < 0:
        ap.error(f"--tolerance, --min-gain: expected fractions >= 0, got {args.tolerance}, {args.min_gain}")
    if args.rebuild is not None:
        return rebuild(args.rebuild, Path(args.table) if args.table else None, args)
    ms = args.ms
    if args.out is None:
        ap.error("--out: required (unless --rebuild)")
    if not args.commit:
        ap.error("--commit: required, the commit of the measured tree (git rev-parse --short HEAD where you commit)")
    presets = [p for p in args.presets.split(",") if p] if args.presets else None
    shapes = {m: shapes_at(m, presets) for m in ms}
    empty = [m for m, s in shapes.items() if not s]
    if empty:
        ap.error(f"--ms/--presets: no matrix GEMM shape at M = {empty} for presets {presets}")
    if not torch.cuda.is_available():
        print("gemm_tiles_gpu: needs a CUDA device", file=sys.stderr)
        return 1

    from benchmarks.common.harness import device_info, portable_command, versions
    from rl_engine.backends.triton.gemm import configs
    from rl_engine.backends.triton.gemm.kernels import arch_of

    arch = arch_of(torch.device("cuda"))
    path = Path(args.table) if args.table else configs.table_path(arch)
    t0 = time.perf_counter()
    if args.compile_workers:
        jobs = sorted({(compile_rows(m), k, n, c.key) for m in ms for _, k, n in shapes[m] for c in candidates(m)})
        precompile(jobs, args.compile_workers)
        print(f"precompiled {len(jobs)} launches in {args.compile_workers} processes: {time.perf_counter() - t0:.0f} s",
              flush=True)
    report = {"schema_version": 1, "family": "gemm_tiles", "arch": arch, "device": device_info("cuda"),
              "versions": versions(),
              "source": {"command": portable_command("tools/benchmarking/gemm_tiles_gpu.py", argv or sys.argv[1:],
                                                     ("--out", "--max-seconds", "--table")),
                         "commit": args.commit,
                         "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
              "selection": {"tolerance": args.tolerance, "max_bands": args.max_bands,
                            "min_band_shapes": args.min_band_shapes, "min_gain": args.min_gain},
              "measurements": {}, "choices": {}, "base_table": json.loads(configs.table_path(arch).read_text())}
    for m in ms:
        rows = []
        for case, k, n in shapes[m]:
            if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
                print(f"stopped at --max-seconds {args.max_seconds}: M = {m} unfinished, its rows unchanged", flush=True)
                write(report, path, Path(args.out))
                return 0
            row = measure(m, case, k, n, candidates(m), args.repeats)
            rows.append(row)
            live = {key: v for key, v in row["us"].items() if v is not None}
            best = min(live, key=live.get)
            print(f"M={m:5d} {case:44s} cuBLAS {row['cublas_us']:8.1f} us  incumbent "
                  f"{row['us'][row['incumbent']] / row['cublas_us']:.2f}x  best {best} "
                  f"{live[best] / row['cublas_us']:.2f}x  rejected {len(row['rejected'])}", flush=True)
            torch.cuda.empty_cache()
        report["measurements"][str(m)] = rows
        res = choose_bands(rows, tolerance=args.tolerance, max_bands=args.max_bands, min_shapes=args.min_band_shapes,
                           min_gain=args.min_gain)
        report["choices"][str(m)] = res
        print(f"M={m}: " + (", ".join(f"N<={b['max_n']}: {b['config']}" for b in res["bands"])
                            + f"; summed ratio {res['incumbent_ratio_sum']:.2f} -> {res['ratio_sum']:.2f}"
                            if res["changed"] else f"rows kept ({res['reason']})"), flush=True)
        write(report, path, Path(args.out))  # after every M: a time limit keeps what finished
    print(f"wrote {path} and {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
