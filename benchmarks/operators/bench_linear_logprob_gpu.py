"""Fused LM-head log-prob on the GPU: rl-kernel vs the naive path vs Liger-Kernel.

Per ``(T, H, V)`` (bf16; default T ∈ {1024, 8192}, H = 4096, V = 151936) and per pass
(``forward``: scoring under ``torch.no_grad``, what RL's old/reference log-probs run;
``forward_backward``: forward + backward of ``Σ g·logprob (+ Σ g'·entropy)`` with grads to
``hidden`` and ``weight``), these candidates are timed round-robin in one process
(:func:`benchmarks.common.harness.measure_interleaved`, host-synchronised wall time per call,
median/p20/p80 of ``--repeats`` samples after ``--warmup`` untimed calls):

* ``rlk.fused``            ``rl_engine.ops.logprob.linear_token_logprobs`` (Triton, raw-bit equal
  to the unfused path; never holds ``[T, V]``);
* ``rlk.fused+entropy``    the same with ``return_entropy=True``;
* ``naive``                cuBLAS ``F.linear`` → ``torch.log_softmax(logits.float())`` → ``gather``
  (the baseline of every row: ``ratio_vs_baseline``);
* ``naive+entropy``        the same plus ``-(p · log p).sum(-1)``;
* ``rlk.unfused+entropy``  the path the fused op is raw-bit equal to: Triton ``gemm.linear`` →
  ``token_logprobs`` + ``entropy`` (holds the ``[T, V]`` logits; same dx/dW kernels);
* ``rlk.fused[token_chunk=..,vocab_chunk=..]`` (``--sweep``) other chunkings of the fused op;
* ``liger.flce``           Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss(reduction="none")``
  (per-token cross-entropy = −log-prob). If Liger cannot be imported or run, its row carries
  ``"error"`` with the reason instead of timings.

Peak memory: ``torch.cuda.max_memory_allocated()`` during one call minus what was allocated
before it (the inputs), statistics reset before each candidate; outputs (and gradients) are
included — ``outputs_bytes`` says how much of it they are.

Usage::

    python benchmarks/operators/bench_linear_logprob_gpu.py --out bench_linear_logprob_gpu.json
    python benchmarks/operators/bench_linear_logprob_gpu.py --quick --out /tmp/bench_lp_gpu.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from benchmarks.common.harness import device_info, make_row, measure_interleaved, versions, write_report

BENCHMARK = "bench_linear_logprob_gpu"
OP = "logprob.linear_token_logprobs"
BASELINE = "naive"
#: ``--sweep``: (token_chunk, vocab_chunk) of extra fused rows (None: the default). An explicit
#: token_chunk / vocab_chunk is used by the forward and by both backward passes.
SWEEP_FORWARD = ((8192, 2048), (8192, 8192), (4096, 8192), (2048, 16384), (1024, 32768), (None, 65536))
SWEEP_BACKWARD = ((None, 2048), (None, 8192), (128, None), (512, None))


def liger_version() -> tuple[Any, str | None]:
    """``(LigerFusedLinearCrossEntropyLoss class or None, version or the import error)``."""
    try:
        import liger_kernel
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001 - any import failure is recorded, not raised
        return None, f"import failed: {type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import version

        ver = version("liger-kernel")
    except Exception:  # noqa: BLE001
        ver = getattr(liger_kernel, "__version__", "unknown")
    return LigerFusedLinearCrossEntropyLoss, ver


def _inputs(T: int, H: int, V: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=g) * (3.0 / H**0.5)).to(torch.bfloat16)
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    up = torch.randn(T, device="cuda", generator=g)
    return h, w, t, up


def candidates(h, w, t, up, *, backward: bool, token_chunk, vocab_chunk, liger_cls, sweep=()) -> dict[str, Callable[[], Any]]:
    """Callables running one forward (``backward=False``, under no_grad) or forward + backward."""
    from rl_engine.ops import logprob

    def fused(hh, ww, ent):
        out = logprob.linear_token_logprobs(hh, ww, t, 1.0, ent, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
        return out if ent else (out, None)

    def naive(hh, ww, ent):
        ls = torch.log_softmax(F.linear(hh, ww).float(), -1)
        lp = ls.gather(1, t[:, None]).squeeze(1)
        return lp, (-(ls.exp() * ls).sum(-1) if ent else None)

    def unfused(hh, ww, ent):  # what the fused op is raw-bit equal to (holds the [T, V] logits)
        from rl_engine.ops import gemm

        z = gemm.linear(hh, ww)
        return logprob.token_logprobs(z, t), (logprob.entropy(z) if ent else None)

    def liger(hh, ww, ent):
        ce = liger_cls(reduction="none")(ww, hh, t)
        return -ce, None

    impls: dict[str, Callable] = {
        "rlk.fused": lambda hh, ww: fused(hh, ww, False),
        "rlk.fused+entropy": lambda hh, ww: fused(hh, ww, True),
        "naive": lambda hh, ww: naive(hh, ww, False),
        "naive+entropy": lambda hh, ww: naive(hh, ww, True),
        "rlk.unfused+entropy": lambda hh, ww: unfused(hh, ww, True),
    }
    if liger_cls is not None:
        impls["liger.flce"] = lambda hh, ww: liger(hh, ww, False)
    for tc, vc in sweep:  # other chunkings of the fused op (same bits; memory/speed trade-off)
        impls[f"rlk.fused[token_chunk={tc},vocab_chunk={vc}]"] = (
            lambda hh, ww, tc=tc, vc=vc: (logprob.linear_token_logprobs(hh, ww, t, 1.0, False, token_chunk=tc, vocab_chunk=vc), None)
        )

    def make(fn):
        if not backward:
            def run():
                with torch.no_grad():
                    return fn(h, w)
            return run

        def run_bwd():
            hh = h.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            lp, ent = fn(hh, ww)
            loss = (lp * up).sum() if ent is None else (lp * up).sum() + (ent * up).sum()
            loss.backward()
            return hh.grad, ww.grad

        return run_bwd

    return {name: make(fn) for name, fn in impls.items()}


def extra_peak(fn: Callable[[], Any]) -> tuple[int, int]:
    """``(peak bytes above the level before the call, bytes of what the call returned)``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    flat = out if isinstance(out, tuple) else (out,)
    out_bytes = 0
    for o in flat:
        for x in (o if isinstance(o, tuple) else (o,)):
            if isinstance(x, torch.Tensor):
                out_bytes += x.numel() * x.element_size()
    del out
    return peak, out_bytes


def run(args) -> list[dict]:
    import triton

    liger_cls, liger_info = liger_version()
    dev = device_info("cuda")
    vers = {**versions(), "liger_kernel": liger_info if liger_cls is not None else None, "cuda": torch.version.cuda}
    rows: list[dict] = []
    passes = ("forward", "forward_backward")
    for T in args.tokens:
        h, w, t, up = _inputs(T, args.hidden, args.vocab)
        inputs_bytes = sum(x.numel() * x.element_size() for x in (h, w, t, up))
        for pname in passes:
            sweep = ()
            if args.sweep:
                sweep = SWEEP_FORWARD if pname == "forward" else SWEEP_BACKWARD
            fns = candidates(h, w, t, up, backward=pname == "forward_backward", token_chunk=args.token_chunk,
                             vocab_chunk=args.vocab_chunk, liger_cls=liger_cls, sweep=sweep)
            errors: dict[str, str] = {}
            for name in list(fns):  # one trial call each: compile, and catch a candidate that fails
                try:
                    fns[name]()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - recorded in the row
                    errors[name] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    del fns[name]
                    torch.cuda.empty_cache()
            stats = measure_interleaved(fns, warmup=args.warmup, repeats=args.repeats, device="cuda")
            config = {"T": T, "H": args.hidden, "V": args.vocab, "dtype": "bfloat16", "pass": pname,
                      "token_chunk": args.token_chunk, "vocab_chunk": args.vocab_chunk}
            base_med = stats[BASELINE].median if BASELINE in stats else None
            for name, st in stats.items():
                peak, out_bytes = extra_peak(fns[name])
                extra = {"outputs_bytes": out_bytes, "inputs_bytes": inputs_bytes,
                         "extra_peak_minus_outputs_bytes": peak - out_bytes,
                         "timing": "host-synchronised wall time per call (measure_interleaved)"}
                if base_med:
                    extra["ratio_vs_baseline"] = st.median / base_med
                rows.append(make_row(benchmark=BENCHMARK, op=OP, implementation=name, config=config, stats=st,
                                     warmup=args.warmup, device=dev, versions={**vers, "triton": triton.__version__},
                                     peak_memory_bytes=peak, peak_memory_method="torch.cuda.max_memory_allocated",
                                     baseline=BASELINE, extra=extra))
                print(f"T={T} {pname:16s} {name:18s} {st.median:9.3f} ms  x{extra.get('ratio_vs_baseline', float('nan')):.2f}"
                      f"  extra peak {peak / 2**20:9.1f} MiB (outputs {out_bytes / 2**20:.1f})", flush=True)
            for name, err in errors.items():
                rows.append({"benchmark": BENCHMARK, "op": OP, "implementation": name, "config": config,
                             "device": dev, "versions": vers, "error": err})
            if liger_cls is None:
                rows.append({"benchmark": BENCHMARK, "op": OP, "implementation": "liger.flce", "config": config,
                             "device": dev, "versions": vers, "error": liger_info})
            del fns
            torch.cuda.empty_cache()
        del h, w, t, up
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--quick", action="store_true", help="T = 1024 only, fewer repeats")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--token-chunk", type=int, default=None)
    p.add_argument("--vocab-chunk", type=int, default=None)
    p.add_argument("--sweep", action="store_true", help="extra fused rows with other chunkings")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.warmup = [1024], 4, 1
    if not torch.cuda.is_available():
        print("bench_linear_logprob_gpu: no CUDA device", file=sys.stderr)
        return 2
    rows = run(args)
    write_report(rows, args.out, meta={"quick": args.quick})
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
