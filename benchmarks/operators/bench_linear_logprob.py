"""Fused LM-head log-prob (``logprob.linear_token_logprobs``) vs the naive path, on CPU.

Per configuration ``(T, H, V, dtype, pass)`` three candidates are timed round-robin in one
process (:func:`benchmarks.common.harness.measure_interleaved`: median/p20/p80 of ``--repeats``
calls after ``--warmup`` untimed calls) and their peak memory is measured in a separate call
(the torch profiler's allocation events summed in time order, outputs included):

* ``fused``: ``rl_engine.ops.logprob.linear_token_logprobs`` (never holds ``[T, V]``);
* ``unfused``: ``rl_engine.ops.logprob.token_logprobs(rl_engine.ops.gemm.linear(h, W))`` — the
  path the fused one is raw-bit equal to;
* ``naive`` (the baseline): ``torch.log_softmax((h @ W.T).float(), -1).gather(...)`` — materialised
  ``[T, V]`` fp32 logits and log-softmax, torch's native (non-invariant) kernels.

``--pass forward`` times scoring (no autograd, what computing old/reference log-probs runs);
``--pass backward`` times forward + backward of ``sum(logprobs · g)`` with grads to ``h`` and
``W``. Rows carry ``ratio_vs_baseline`` (median / naive median of the same interleaved run) and
``memory_ratio_vs_baseline``.

Usage::

    python benchmarks/operators/bench_linear_logprob.py --out reports/cpu/bench_linear_logprob.json
    python benchmarks/operators/bench_linear_logprob.py --quick --out /tmp/bench_lp.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.common.harness import device_info, make_row, measure_interleaved, peak_memory, versions, write_report

BENCHMARK = "bench_linear_logprob"
OP = "logprob.linear_token_logprobs"


def _inputs(T: int, H: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    return h, w, t


def candidates(h, w, t, *, backward: bool, token_chunk: int | None, vocab_chunk: int | None) -> dict[str, Callable[[], Any]]:
    from rl_engine.ops import gemm, logprob

    def fused(hh, ww):
        return logprob.linear_token_logprobs(hh, ww, t, token_chunk=token_chunk, vocab_chunk=vocab_chunk)

    def unfused(hh, ww):
        return logprob.token_logprobs(gemm.linear(hh, ww), t)

    def naive(hh, ww):
        return torch.log_softmax((hh @ ww.T).float(), dim=-1).gather(1, t[:, None]).squeeze(1)

    g = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))

    def run(fn):
        if not backward:
            def call():
                with torch.no_grad():
                    return fn(h, w)
            return call

        def call_bwd():
            hh = h.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            (fn(hh, ww) * g).sum().backward()
            return hh.grad, ww.grad
        return call_bwd

    return {"fused": run(fused), "unfused": run(unfused), "naive": run(naive)}


IMPL_NAMES = {
    "fused": "rl_engine.ops.logprob.linear_token_logprobs (cpu.canonical_lse)",
    "unfused": "rl_engine.ops.logprob.token_logprobs(rl_engine.ops.gemm.linear)",
    "naive": "torch.log_softmax((h @ W.T).float()).gather",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--quick", action="store_true", help="one small configuration, few repeats")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    ap.add_argument("--pass", dest="passes", choices=["forward", "backward", "both"], default="both")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--token-chunk", type=int, default=None)
    ap.add_argument("--vocab-chunk", type=int, default=None)
    args = ap.parse_args(argv)

    configs = [(512, 1024, 32000)] if args.quick else [(1024, 1024, 32000), (4096, 1024, 32000)]
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    passes = ["forward", "backward"] if args.passes == "both" else [args.passes]
    warmup = args.warmup if args.warmup is not None else 1
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)

    dev, vers = device_info("cpu"), versions()
    rows = []
    for (T, H, V) in configs:
        for dname in dtypes:
            dtype = getattr(torch, dname)
            h, w, t = _inputs(T, H, V, dtype)
            for p in passes:
                fns = candidates(h, w, t, backward=(p == "backward"), token_chunk=args.token_chunk, vocab_chunk=args.vocab_chunk)
                stats = measure_interleaved(fns, warmup=warmup, repeats=repeats)
                mem = {name: peak_memory(fn) for name, fn in fns.items()}
                base_ms = stats["naive"].median
                base_mem = mem["naive"][0]
                config = {
                    "T": T, "H": H, "V": V, "dtype": dname, "pass": p,
                    "token_chunk": args.token_chunk, "vocab_chunk": args.vocab_chunk,
                    "naive_analytic_bytes": 2 * T * V * 4,
                }
                for name in fns:
                    extra: dict[str, Any] = {}
                    if name != "naive":
                        extra["ratio_vs_baseline"] = stats[name].median / base_ms
                        if mem[name][0] is not None and base_mem:
                            extra["memory_ratio_vs_baseline"] = mem[name][0] / base_mem
                    rows.append(
                        make_row(
                            benchmark=BENCHMARK, op=OP, implementation=IMPL_NAMES[name],
                            baseline=None if name == "naive" else IMPL_NAMES["naive"],
                            config=config, stats=stats[name], warmup=warmup, device=dev, versions=vers,
                            peak_memory_bytes=mem[name][0], peak_memory_method=mem[name][1], extra=extra,
                        )
                    )
                    mb = mem[name][0] / 2**20 if mem[name][0] is not None else float("nan")
                    print(f"T={T} H={H} V={V} {dname} {p:8s} {name:8s} {stats[name].median:9.1f} ms  peak {mb:8.1f} MiB", flush=True)
    out = write_report(rows, args.out)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
