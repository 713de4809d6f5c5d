"""Measure the tile candidates of the MoE grouped GEMMs on the GPU and write the tile table.

For every token count (``--tokens``) the layer of ``benchmarks/operators/bench_moe_gpu.py``
(Qwen3-30B-A3B dimensions: hidden 2048, 128 experts, top-8, expert intermediate 768; bf16; the
benchmark's weights, routing by ``moe.route`` of the router GEMM) runs each of the six GEMM roles
of ``rl_engine/backends/triton/moe/tiles.py`` through its launcher (``kernels._grouped`` /
``kernels._wgrad``) with the reference configuration ``tiles.DEFAULT`` and with every candidate:

* **bits**: a candidate whose output differs from the reference's on raw bits (or that fails to
  compile: too much shared memory) is rejected and recorded with the reason;
* **time**: device time per launch — CUDA events around three launches queued behind a CUDA
  sleep, so the host's launch cost is not timed — the median of ``--repeats`` samples after a
  warm-up launch, candidates interleaved round-robin so that clock drift hits all alike.
  Compilation comes first, in ``--compile-workers`` processes at once (each fills Triton's
  on-disk cache), and is never timed.

The fastest accepted candidate per (role, token count) becomes a row of the table, bounded by
that count's mean slots per expert (``T·K / E``); consecutive rows with the same configuration
merge. Beyond the largest measured count a call takes the reference configuration (the table
does not extrapolate), so a run over fewer token counts ships only what it measured.
``--rebuild REPORT`` writes the table again from an earlier run's report, without a GPU;
``--keep REPORT`` adds an earlier run's token counts that this run does not measure (a run over
the large counts extends the table measured at the small ones). After every token count ``--table`` writes it (default: the package's
``tile_tables/<arch>.json``, which ``tiles.select`` reads); ``--out`` gets every measurement.

    python3 tools/benchmarking/moe_tiles_gpu.py --out $OUT/moe_tiles.json --commit $(git rev-parse --short HEAD)

CUDA only (exit 1 without it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import device_info, versions  # noqa: E402
from benchmarks.operators import bench_moe_gpu as bench  # noqa: E402

#: hidden, experts, experts per token, expert intermediate size (Qwen3-30B-A3B)
DIMS = (2048, 128, 8, 768)
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)

_GEMM = ((64, 64, 32, 4, 3), (16, 64, 64, 4, 4), (16, 128, 128, 4, 3), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3),
         (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 256, 64, 8, 3))
_TRANSPOSED = ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3))
#: input-gradient tiles measured with masked_loads too
_MASKED = ((64, 64, 32, 4, 3), (16, 64, 64, 4, 4), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3),
           (64, 256, 64, 8, 3), (128, 256, 64, 8, 3))
#: (tile, warps, stages, sorted_operands, masked_loads)
_WGRAD = ((64, 64, 32, 4, 3, False, False), (64, 64, 32, 4, 3, True, False), (128, 128, 32, 8, 3, False, False),
          (128, 128, 32, 8, 3, True, False), (128, 128, 64, 8, 3, False, False), (128, 128, 64, 8, 3, True, False),
          (128, 256, 64, 8, 3, True, False), (64, 128, 64, 4, 4, True, False), (64, 64, 32, 4, 3, True, True),
          (128, 128, 32, 8, 3, True, True), (128, 128, 64, 8, 3, True, True), (128, 256, 64, 8, 3, True, True))


def candidates(role: str) -> list:
    """The configurations measured for ``role`` (the reference first)."""
    from rl_engine.backends.triton.moe.tiles import DEFAULT, GemmConfig

    if role.startswith("dw_"):
        out = [GemmConfig(bm, bn, bk, w, s, sorted_operands=so, masked_loads=ml) for bm, bn, bk, w, s, so, ml in _WGRAD]
    else:
        out = [GemmConfig(*c) for c in _GEMM]
        if role in ("dx", "dact"):
            out += [GemmConfig(*c, w_transposed=True) for c in _TRANSPOSED]
            out += [GemmConfig(*c, masked_loads=True) for c in _MASKED]
    assert out[0] == DEFAULT, "the reference configuration is measured first"
    return out


def role_calls(T: int, dtype: torch.dtype, data: bool = True, weights: tuple | None = None) -> dict:
    """``role -> fn(cfg) -> output`` at ``T`` tokens: each launches that role's GEMM once
    (``data=False``: zeros instead of the benchmark's data, for compiling only; ``weights``: the
    benchmark's ``(w_router, w_gate_up, w_down)`` drawn once, reused across token counts)."""
    from rl_engine.backends.triton.moe import kernels as km
    from rl_engine.ops import moe
    from rl_engine.ops.gemm import linear

    H, E, K, I = DIMS
    S = T * K
    if data:
        wr, wgu, wd = weights if weights is not None else bench.weights(H, E, I, dtype, "cuda")[0]
        g = torch.Generator().manual_seed(T)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()
    else:
        def rand(*shape, scale=1.0):
            return torch.zeros(shape, dtype=dtype, device="cuda")

        wr, wgu, wd = rand(E, H), rand(E, 2 * I, H), rand(E, H, I)
    x = rand(T, H)
    with torch.no_grad():
        w, ids = moe.route(linear(x, wr), K, True)
    perm = km._perm(ids, E)
    act, dh, grad = rand(S, I, scale=0.25), rand(S, 2 * I, scale=0.25), rand(T, H, scale=0.25)
    w_flat = w.reshape(-1).contiguous()

    def grouped(a, rows, wt, n, kd, out_dtype, **kw):
        return lambda cfg: km._grouped(a, rows, wt, n, kd, torch.empty((S, n), dtype=out_dtype, device="cuda"),
                                       perm, cfg, **kw)

    def wgrad(left, l_rows, right, r_rows, like, **kw):
        return lambda cfg: km._wgrad(left, l_rows, right, r_rows, torch.empty_like(like), perm, cfg, **kw)

    return {
        "gate_up": grouped(x, perm.tokens, wgu, 2 * I, H, dtype),
        "down": grouped(act, perm.order, wd, H, I, torch.float32),
        "dx": grouped(dh, perm.order, wgu, H, 2 * I, torch.float32, transposed=True),
        "dact": grouped(grad, perm.tokens, wd, I, H, dtype, transposed=True, scale=w_flat),
        "dw_gate_up": wgrad(dh, perm.order, x, perm.tokens, wgu),
        "dw_down": wgrad(grad, perm.tokens, act, perm.order, wd, scale=w_flat),
    }


def _time(fn, cfg, calls: int = 3) -> float:
    """Device ms per launch: ``calls`` launches between two events, queued behind a CUDA sleep so
    that the host's launch cost (larger than the kernel at small token counts) is not timed."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # ~5 ms: longer than the host takes to queue the launches
    start.record()
    for _ in range(calls):
        fn(cfg)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _compile_worker(jobs: list[tuple[str, tuple]]) -> list[str]:
    """Launch each ``(role, config fields)`` once at 16 tokens (a spawned process: fills Triton's
    on-disk cache, which the measuring process then loads instead of compiling); returns errors."""
    from rl_engine.backends.triton.moe.tiles import GemmConfig

    calls = role_calls(16, torch.bfloat16, data=False)
    errors = []
    for role, fields in jobs:
        try:
            calls[role](GemmConfig(*fields))
        except Exception as exc:  # the measuring process records the failure with the candidate
            errors.append(f"{role} {fields}: {type(exc).__name__}")
    torch.cuda.synchronize()
    return errors


def precompile(roles: list[str], workers: int) -> None:
    """Compile every candidate of ``roles`` in ``workers`` processes at once (Triton compiles in the
    launching thread, one kernel at a time: about 3 s each on the H200 host)."""
    import dataclasses
    import multiprocessing as mp

    jobs = [(role, dataclasses.astuple(cfg)) for role in roles for cfg in candidates(role)]
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        for errs in pool.map(_compile_worker, chunks):
            for e in errs:
                print(f"precompile: {e}", flush=True)


def measure(role: str, fn, repeats: int) -> list[dict]:
    """Rows ``config, accepted, reason, ms`` of every candidate of ``role``."""
    from rl_engine.utils.bits import same_bits

    cands = candidates(role)
    ref = fn(cands[0]).clone()
    rows, live = [], []
    for cfg in cands:
        row = {"config": cfg.key, "accepted": False, "reason": None, "ms": None, "samples": []}
        try:
            out = fn(cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # compilation: out of shared memory or registers for this tile
            row["reason"] = f"launch failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        else:
            cmp = same_bits(out, ref)
            if cmp.equal:
                row["accepted"] = True
                live.append((cfg, row))
            else:
                row["reason"] = f"bits differ from the reference configuration ({cmp})"
        rows.append((cfg, row))
    for _ in range(repeats):  # round-robin
        for cfg, row in live:
            row["samples"].append(_time(fn, cfg))
    for _, row in live:
        row["ms"] = statistics.median(row["samples"])
        row["samples"] = [round(s, 4) for s in row["samples"]]
    return [dict(row, cfg=cfg) for cfg, row in rows]


def table(results: dict, arch: str, source: dict) -> dict:
    """The tile table (``tiles.TileTable``) from ``results[role][T] = rows``."""
    from dataclasses import asdict

    from rl_engine.backends.triton.moe.tiles import DEFAULT

    H, E, K, I = DIMS
    rows = []
    for role, by_t in results.items():
        picks = []
        for T in sorted(by_t):
            ok = [r for r in by_t[T] if r["accepted"]]
            best = min(ok, key=lambda r: r["ms"])
            ref = by_t[T][0]
            picks.append((T * K / E, best["cfg"], best["ms"], ref["ms"]))
        merged: list[list] = []
        for p in picks:
            if merged and merged[-1][1] == p[1]:
                merged[-1] = list(p)  # the same configuration up to this load: one row, the larger bound
            else:
                merged.append(list(p))
        for bound, cfg, ms, ref_ms in merged:
            if cfg == DEFAULT and bound == merged[-1][0]:
                continue  # the last measured loads chose the reference: what a call past the rows gets anyway
            rows.append({"role": role, "dtype": "bfloat16", "max_slots_per_expert": bound,
                         "config": asdict(cfg), "ms": round(ms, 4), "default_ms": round(ref_ms, 4)})
    return {"schema_version": 1, "arch": arch, "source": source, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON of every measurement (required unless --rebuild)")
    ap.add_argument("--keep", type=Path, default=None, metavar="REPORT",
                    help="an earlier run's report: its token counts that this run does not measure join the table")
    ap.add_argument("--commit", default=None,
                    help="the measured tree's commit (required to measure: the device's copy of the tree may carry "
                         "another checkout's git history; with --rebuild it replaces the report's)")
    ap.add_argument("--rebuild", type=Path, default=None, metavar="REPORT",
                    help="write the table from an earlier run's --out report (no GPU, nothing measured)")
    ap.add_argument("--table", default=None, help="tile table to write (default: the package's tile_tables/<arch>.json)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--roles", default=",".join(("gate_up", "down", "dx", "dact", "dw_gate_up", "dw_down")))
    ap.add_argument("--compile-workers", type=int, default=8, help="processes compiling the candidates first (0: none)")
    args = ap.parse_args(argv)
    from rl_engine.backends.triton.moe import tiles

    if args.rebuild is not None:
        return rebuild(args.rebuild, Path(args.table) if args.table else None, args.commit)
    if args.out is None:
        ap.error("--out: required (unless --rebuild)")
    if not args.commit:
        ap.error("--commit: required, the commit of the measured tree (git rev-parse --short HEAD where you commit)")

    roles = [r for r in args.roles.split(",") if r]
    if not roles or set(roles) - set(tiles.ROLES):
        ap.error(f"--roles: expected some of {', '.join(tiles.ROLES)}, got {args.roles!r}")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        ap.error(f"--tokens: expected positive token counts, comma-separated, got {args.tokens!r}")
    if args.repeats < 1:
        ap.error(f"--repeats: expected a positive count, got {args.repeats}")
    if not torch.cuda.is_available():
        print("moe_tiles_gpu: needs a CUDA device", file=sys.stderr)
        return 1
    if args.compile_workers < 0:
        ap.error(f"--compile-workers: expected a count >= 0, got {args.compile_workers}")
    arch = tiles.arch_of(torch.device("cuda"))
    path = Path(args.table) if args.table else tiles.table_path(arch)
    t0 = time.perf_counter()
    if args.compile_workers:
        precompile(roles, args.compile_workers)
        print(f"precompiled {sum(len(candidates(r)) for r in roles)} candidates in {args.compile_workers} processes: "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    source = {"command": "python3 tools/benchmarking/moe_tiles_gpu.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "commit": args.commit,
              "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": str(versions().get("triton"))}
    results: dict[str, dict[int, list]] = {r: {} for r in roles}
    if args.keep is not None:  # the earlier run's other token counts (and roles), kept as measured
        kept = json.loads(args.keep.read_text())
        for role, by_t in _measurements(kept).items():
            results.setdefault(role, {}).update({T: rows for T, rows in by_t.items() if T not in tokens})
        source["kept"] = f"{kept['source'].get('commit')} {kept['source'].get('timestamp')}: token counts not measured here"
    H, E, _, I = DIMS
    weights = bench.weights(H, E, I, torch.bfloat16, "cuda")[0]  # drawn once: 600 M numbers on the CPU
    for T in tokens:
        calls = role_calls(T, torch.bfloat16, weights=weights)
        for role in roles:
            results[role][T] = measure(role, calls[role], args.repeats)
            best = min((r for r in results[role][T] if r["accepted"]), key=lambda r: r["ms"])
            ref = results[role][T][0]
            rejected = sum(not r["accepted"] for r in results[role][T])
            print(f"T={T:6d} {role:11s} reference {ref['ms']:.4f} ms  best {best['config']} {best['ms']:.4f} ms "
                  f"({ref['ms'] / best['ms']:.2f}x)  rejected {rejected}", flush=True)
        del calls
        torch.cuda.empty_cache()
        write(results, arch, source, path, Path(args.out))  # after every token count: a time limit keeps them
        print(f"T={T}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"wrote {path} and {args.out}")
    return 0


def _measurements(rep: dict) -> dict[str, dict[int, list]]:
    """A report's measurements with each candidate's configuration rebuilt from its key."""
    from rl_engine.backends.triton.moe import tiles

    return {role: {int(T): [dict(r, cfg=tiles.GemmConfig.from_key(r["config"])) for r in rows]
                   for T, rows in by_t.items()} for role, by_t in rep["measurements"].items()}


def rebuild(report: Path, table_path: Path | None, commit: str | None = None) -> int:
    """Write the tile table of an earlier run's report (its measurements, source and architecture)."""
    from rl_engine.backends.triton.moe import tiles

    rep = json.loads(report.read_text())
    arch = rep.get("arch") or Path(rep["table"]).stem
    results = _measurements(rep)
    path = table_path or tiles.table_path(arch)
    tab = table(results, arch, dict(rep["source"], commit=commit) if commit else rep["source"])
    tiles.TileTable.model_validate(tab)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tab, indent=1) + "\n")
    tiles.load_table(path)
    print(f"wrote {path} ({len(tab['rows'])} rows) from {report}")
    return 0


def write(results: dict, arch: str, source: dict, path: Path, out: Path) -> None:
    """The tile table (validated, then loaded back) and the report of every measurement."""
    from rl_engine.backends.triton.moe import tiles

    tab = table(results, arch, source)
    tiles.TileTable.model_validate(tab)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tab, indent=1) + "\n")
    tiles.load_table(path)
    report = {"schema_version": 1, "family": "moe_tiles", "arch": arch, "device": device_info("cuda"),
              "versions": versions(),
              "dims": dict(zip(("hidden", "experts", "top_k", "intermediate"), DIMS)), "source": source,
              "table": str(path), "measurements": {role: {str(T): [{k: v for k, v in r.items() if k != "cfg"}
                                                                    for r in rows] for T, rows in by_t.items()}
                                                    for role, by_t in results.items()}}
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
