"""CPU invariant operators vs the native torch call, through the shared harness.

For every operator below whose contract is shipped (``rl_engine.contracts.all_contracts()``), it
times the public entry point (``rl_engine.ops.<family>.<op>``: argument checks, dispatch and the
invariant CPU implementation) against the native, non-invariant torch call computing the same
math, interleaved round-robin in one process. The entry point is timed twice: as users call it
(the default ``nan_policy("auto")``, which on the CPU scans its floating activation inputs for
NaN and inf) and under ``nan_policy("propagate")`` (no scan), which separates the cost of
validation from the cost of the invariant arithmetic. Rows name the policy in
``config["nan_policy"]`` (``"auto"``; a row named ``"raise"``, which scans host tensors alike,
is read the same way by ``benchmarks/common/tables.py``). Each (config, variant) is one JSON row; rl-kernel rows carry
``ratio_vs_baseline`` = their median / the native median of the same interleaved run.

The foundation's bar for ``gemm.linear`` is ≤ 2× ``F.linear`` at M ≥ 64; this script reports
it and never gates anything.

Usage::

    python benchmarks/operators/bench_cpu_ops.py --out reports/cpu/bench_cpu_ops.json
    python benchmarks/operators/bench_cpu_ops.py --quick --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from benchmarks.common.harness import (
    device_info,
    machine_load,
    make_row,
    measure_interleaved,
    peak_memory,
    versions,
    write_report,
)

BENCHMARK = "bench_cpu_ops"


@dataclass
class Case:
    """One configuration: the rl-kernel call and the native baseline on the same inputs."""

    op: str
    config: dict[str, Any]
    ours: Callable[[], Any]
    native: Callable[[], Any]
    native_name: str
    # keeps the inputs alive for the closures (and documents what they are)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # further reference points timed in the same interleaved run: name -> callable
    others: dict[str, Callable[[], Any]] = field(default_factory=dict)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ---- operator case builders ------------------------------------------------------------------
# Each builder yields Cases; it is used only when the operator's contract is shipped.


def tiled_blas_linear(x: torch.Tensor, w: torch.Tensor, tile_m: int = 64, tile_n: int = 1024) -> torch.Tensor:
    """``x @ w.T`` as one fixed BLAS call shape per tile (zero-padded ``[64, K] @ [K, 1024]``).

    The CPU GEMM design that exact sums replace: row and column invariant within one process,
    but MKL/oneDNN pick the K order of that call by thread count and instruction set, so its
    bits change between hosts (tests/ops/test_cpu_bits_threads_isa.py). Timed as the reference
    point of what thread/ISA invariance costs.
    """
    M, K = x.shape
    N = w.shape[0]
    out = x.new_empty((M, N))
    for j in range(0, N, tile_n):
        wb = w[j : j + tile_n]
        n = wb.shape[0]
        if n < tile_n:
            wb = torch.cat([wb, wb.new_zeros((tile_n - n, K))])
        wt = wb.t()
        for i in range(0, M, tile_m):
            xb = x[i : i + tile_m]
            m = xb.shape[0]
            if m < tile_m:
                xb = torch.cat([xb, xb.new_zeros((tile_m - m, K))])
            out[i : i + m, j : j + n] = (xb @ wt)[:m, :n]
    return out


def linear_cases(quick: bool, dtypes: list[torch.dtype]) -> Iterator[Case]:
    from rl_engine.ops import gemm

    ms = (64,) if quick else (64, 256, 1024)
    kns = ((1024, 1024),) if quick else tuple(itertools.product((1024, 4096), (1024, 4096)))
    for dtype in dtypes:
        for m in ms:
            for k, n in kns:
                gen = torch.Generator().manual_seed(m * 31 + k * 7 + n)
                x = _randn(m, k, dtype=dtype, gen=gen)
                w = _randn(n, k, dtype=dtype, gen=gen, scale=k**-0.5)
                yield Case(
                    op="gemm.linear",
                    config={"M": m, "K": k, "N": n, "dtype": str(dtype).removeprefix("torch."), "bias": False},
                    ours=lambda x=x, w=w: gemm.linear(x, w),
                    native=lambda x=x, w=w: F.linear(x, w),
                    native_name="torch.nn.functional.linear",
                    inputs={"x": x, "weight": w},
                    others={"fixed BLAS tiles 64x1024 (not threads/isa invariant)": lambda x=x, w=w: tiled_blas_linear(x, w)},
                )


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tokens(quick: bool) -> tuple[int, ...]:
    return (64,) if quick else (64, 1024)


def rms_norm_cases(quick: bool, dtypes: list[torch.dtype]) -> Iterator[Case]:
    from rl_engine.ops import norm

    for dtype in dtypes:
        for t in _tokens(quick):
            for h in ((1024,) if quick else (1024, 4096)):
                gen = torch.Generator().manual_seed(t + h)
                x = _randn(t, h, dtype=dtype, gen=gen)
                w = (1 + _randn(h, dtype=torch.float32, gen=gen, scale=0.1)).to(dtype)
                yield Case(
                    op="norm.rms_norm", config={"T": t, "H": h, "dtype": _dt(dtype)},
                    ours=lambda x=x, w=w: norm.rms_norm(x, w, 1e-6),
                    native=lambda x=x, w=w, h=h: F.rms_norm(x, (h,), w, 1e-6),
                    native_name="torch.nn.functional.rms_norm", inputs={"x": x, "weight": w},
                )


def silu_and_mul_cases(quick: bool, dtypes: list[torch.dtype]) -> Iterator[Case]:
    from rl_engine.ops import activation

    def native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    for dtype in dtypes:
        for t in _tokens(quick):
            for d in ((1024,) if quick else (1024, 4096)):
                x = _randn(t, 2 * d, dtype=dtype, gen=torch.Generator().manual_seed(t + d))
                yield Case(
                    op="activation.silu_and_mul", config={"T": t, "d": d, "dtype": _dt(dtype)},
                    ours=lambda x=x: activation.silu_and_mul(x), native=lambda x=x: native(x),
                    native_name="F.silu(x[..., :d]) * x[..., d:]", inputs={"x": x},
                )


def apply_rope_cases(quick: bool, dtypes: list[torch.dtype]) -> Iterator[Case]:
    from rl_engine.ops import rope

    heads, head_dim, theta = 32, 128, 1_000_000.0
    for dtype in dtypes:
        for t in _tokens(quick):
            x = _randn(t, heads, head_dim, dtype=dtype, gen=torch.Generator().manual_seed(t))
            pos = torch.arange(t, dtype=torch.int64)
            # the native baseline gets its cos/sin precomputed outside the timed call (HF style
            # rotate_half with tables in x.dtype): a lower bound on what an engine pays
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
            ang = torch.cat([pos.double()[:, None] * inv[None, :]] * 2, dim=-1)
            cos, sin = ang.cos().to(dtype)[:, None, :], ang.sin().to(dtype)[:, None, :]

            def native(x=x, cos=cos, sin=sin) -> torch.Tensor:
                half = x.shape[-1] // 2
                rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
                return x * cos + rot * sin

            yield Case(
                op="rope.apply_rope", config={"T": t, "heads": heads, "head_dim": head_dim, "dtype": _dt(dtype)},
                ours=lambda x=x, pos=pos: rope.apply_rope(x, pos, theta=theta), native=native,
                native_name="x*cos + rotate_half(x)*sin (tables precomputed)", inputs={"x": x, "positions": pos},
            )


def embedding_cases(quick: bool, dtypes: list[torch.dtype]) -> Iterator[Case]:
    from rl_engine.ops import embedding

    vocab = 32768
    for dtype in dtypes:
        for t in _tokens(quick):
            for h in ((1024,) if quick else (1024, 4096)):
                gen = torch.Generator().manual_seed(t + h)
                w = _randn(vocab, h, dtype=dtype, gen=gen)
                ids = torch.randint(0, vocab, (t,), generator=gen)
                yield Case(
                    op="embedding.embedding", config={"T": t, "V": vocab, "H": h, "dtype": _dt(dtype)},
                    ours=lambda ids=ids, w=w: embedding.embedding(ids, w),
                    native=lambda ids=ids, w=w: F.embedding(ids, w),
                    native_name="torch.nn.functional.embedding", inputs={"ids": ids, "weight": w},
                )


def log_softmax_cases(quick: bool, dtypes: list[torch.dtype]) -> Iterator[Case]:
    from rl_engine.ops import logprob

    shapes = ((64, 32768),) if quick else ((64, 32768), (64, 151936), (1024, 32768))
    for dtype in dtypes:
        for t, v in shapes:
            logits = _randn(t, v, dtype=dtype, gen=torch.Generator().manual_seed(t + v), scale=3.0)
            yield Case(
                op="logprob.log_softmax", config={"T": t, "V": v, "dtype": _dt(dtype)},
                ours=lambda z=logits: logprob.log_softmax(z),
                native=lambda z=logits: torch.log_softmax(z, dim=-1, dtype=torch.float32),
                native_name="torch.log_softmax(dtype=float32)", inputs={"logits": logits},
            )


BUILDERS: dict[str, Callable[[bool, list[torch.dtype]], Iterator[Case]]] = {
    "gemm.linear": linear_cases,
    "norm.rms_norm": rms_norm_cases,
    "activation.silu_and_mul": silu_and_mul_cases,
    "rope.apply_rope": apply_rope_cases,
    "embedding.embedding": embedding_cases,
    "logprob.log_softmax": log_softmax_cases,
}


def _repeats_for(case: Case, budget_s: float, lo: int, hi: int) -> int:
    """Enough repeats to spend about ``budget_s`` on the case (both callables), within [lo, hi]."""
    case.ours()  # the first call loads the operator family's backend: not part of the estimate
    case.native()
    t0 = time.perf_counter()
    case.ours()
    case.native()
    per_round = max(time.perf_counter() - t0, 1e-6)
    return int(min(hi, max(lo, budget_s / per_round)))


def run(quick: bool, ops_filter: list[str] | None, dtypes: list[torch.dtype]) -> tuple[list[dict[str, Any]], list[str]]:
    from rl_engine import contracts

    shipped = contracts.all_contracts()
    dev = device_info("cpu")
    vers = versions()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    warmup = 1 if quick else 3
    for op, builder in BUILDERS.items():
        if ops_filter and op not in ops_filter:
            continue
        if op not in shipped:
            notes.append(f"{op}: skipped (no contract shipped in this checkout)")
            continue
        try:
            cases = list(builder(quick, dtypes))
        except Exception as exc:  # an operator whose entry point changed: report, keep going
            notes.append(f"{op}: ERROR building cases: {type(exc).__name__}: {exc}")
            continue
        for case in cases:
            variants = {"auto": case.ours, "propagate": _without_nan_scan(case.ours), "native": case.native, **case.others}
            try:
                repeats = 3 if quick else _repeats_for(case, budget_s=4.0, lo=7, hi=41)
                stats = measure_interleaved(variants, warmup=warmup, repeats=repeats)
                impl = _selected_impl(op, case)
                mems = {name: peak_memory(fn) for name, fn in variants.items()}
            except Exception as exc:
                notes.append(f"{op} {case.config}: ERROR: {type(exc).__name__}: {exc}")
                continue
            common = dict(benchmark=BENCHMARK, op=op, warmup=warmup, device=dev, versions=vers)
            ratios = {}
            for policy in ("auto", "propagate"):
                ratios[policy] = stats[policy].median / stats["native"].median
                rows.append(
                    make_row(
                        implementation=impl, config={**case.config, "nan_policy": policy}, stats=stats[policy],
                        baseline=case.native_name, peak_memory_bytes=mems[policy][0],
                        peak_memory_method=mems[policy][1], extra={"ratio_vs_baseline": ratios[policy]}, **common,
                    )
                )
            rows.append(
                make_row(
                    implementation=case.native_name, config=dict(case.config), stats=stats["native"],
                    peak_memory_bytes=mems["native"][0], peak_memory_method=mems["native"][1], **common,
                )
            )
            for name in case.others:
                rows.append(
                    make_row(
                        implementation=name, config=dict(case.config), stats=stats[name], baseline=case.native_name,
                        peak_memory_bytes=mems[name][0], peak_memory_method=mems[name][1],
                        extra={"ratio_vs_baseline": stats[name].median / stats["native"].median}, **common,
                    )
                )
            cfg = " ".join(f"{k}={v}" for k, v in case.config.items())
            print(
                f"{op:<22} {cfg:<44} native {stats['native'].median:9.3f} ms | rl_engine "
                f"{stats['auto'].median:9.3f} ms ({ratios['auto']:4.2f}x), without NaN scan "
                f"{stats['propagate'].median:9.3f} ms ({ratios['propagate']:4.2f}x)",
                flush=True,
            )
    return rows, notes


def _without_nan_scan(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` under ``nan_policy("propagate")``: the entry point skips its NaN scan of the inputs."""
    from rl_engine.utils.checks import nan_policy

    def call() -> Any:
        with nan_policy("propagate"):
            return fn()

    return call


def _selected_impl(op: str, case: Case) -> str:
    """The implementation id the public call dispatches to (read from provenance)."""
    from rl_engine.runtime import provenance

    with provenance.record() as calls:
        case.ours()
    return calls[0].impl_id if calls else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="one small config per op, 3 repeats (a smoke run)")
    parser.add_argument("--ops", nargs="*", help=f"only these operator ids (known: {', '.join(BUILDERS)})")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.ops:
        unknown = [o for o in args.ops if o not in BUILDERS]
        if unknown:
            parser.error(f"--ops: unknown operator ids {unknown}; known: {list(BUILDERS)}")
    dtypes = [getattr(torch, d) for d in args.dtypes]
    load_start = machine_load()
    t0 = time.perf_counter()
    rows, notes = run(args.quick, args.ops, dtypes)
    meta = {"load_start": load_start, "load_end": machine_load(), "seconds": round(time.perf_counter() - t0, 1),
            "notes": notes}
    for note in notes:
        print(note, file=sys.stderr)
    if args.out:
        cmd = "python benchmarks/operators/bench_cpu_ops.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path = write_report(rows, args.out, command=cmd.strip(), meta=meta)
        print(f"wrote {len(rows)} rows to {path}")
    return 1 if any("ERROR" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
