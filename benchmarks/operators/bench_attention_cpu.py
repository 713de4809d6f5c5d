"""Invariant CPU attention vs PyTorch SDPA: prefill (train path, forward and forward+backward)
and decode (rollout path, one step against a KV cache), through the shared harness.

* prefill: ``rl_engine.ops.attention.varlen_attention`` on one sequence of ``T`` tokens vs
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``;
* decode: one ``cached_attention`` step of ``B`` sequences with ``context`` cached tokens each
  (contiguous cache) vs SDPA of the ``B`` new queries over the same keys. Each timed step
  appends its token, so the context grows by one per call (warm-up + repeats ≪ context).

The candidates run round-robin in one process (``measure_interleaved``), each row records the
median/p20/p80 of the repeats after warm-up, peak memory, machine, load and versions, and
rl-kernel rows carry ``ratio_vs_baseline``. Nothing is gated.

Usage::

    python benchmarks/operators/bench_attention_cpu.py --out reports/cpu/bench_attention_cpu.json
    python benchmarks/operators/bench_attention_cpu.py --quick --out /tmp/attn.json
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
    device_info,
    machine_load,
    make_row,
    measure_interleaved,
    peak_memory,
    versions,
    write_report,
)

BENCHMARK = "bench_attention_cpu"
IMPL = "cpu.blocked_online_softmax"


def _qkv(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hq, d, generator=g).to(dtype), torch.randn(T, hkv, d, generator=g).to(dtype),
            torch.randn(T, hkv, d, generator=g).to(dtype))


def prefill_cases(quick: bool):
    from rl_engine.ops.attention import varlen_attention

    lengths = (512,) if quick else (512, 2048)
    dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    for T in lengths:
        for dtype in dtypes:
            for hq, hkv, d in ((8, 2, 64), (16, 4, 128)):
                if quick and d == 128:
                    continue
                q, k, v = _qkv(T, hq, hkv, d, dtype)
                cu = torch.tensor([0, T], dtype=torch.int32)
                qt, kt, vt = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
                cfg = {"phase": "prefill", "T": T, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype).split(".")[-1]}
                yield ("attention.varlen_attention", dict(cfg, backward=False),
                       lambda q=q, k=k, v=v, cu=cu: varlen_attention(q, k, v, cu),
                       lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True))
                if T <= 512:
                    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                    qtg, ktg, vtg = (x.clone().requires_grad_() for x in (qt, kt, vt))

                    def ours_fb(qg=qg, kg=kg, vg=vg, cu=cu):
                        varlen_attention(qg, kg, vg, cu).sum().backward()

                    def sdpa_fb(qt=qtg, kt=ktg, vt=vtg):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).sum().backward()

                    yield ("attention.varlen_attention", dict(cfg, backward=True), ours_fb, sdpa_fb)


def decode_cases(quick: bool):
    from rl_engine.ops.attention import ContiguousKVCache, cached_attention

    contexts = (512,) if quick else (512, 2048)
    batches = (1, 8) if quick else (1, 8, 32)
    for ctx in contexts:
        for B in batches:
            for dtype in ((torch.float32,) if quick else (torch.float32, torch.bfloat16)):
                hq, hkv, d = 8, 2, 64
                q, k, v = _qkv(B * ctx, hq, hkv, d, dtype)
                cache = ContiguousKVCache(B, ctx + 512, hkv, d, dtype=dtype)
                cached_attention(q, k, v, cache, list(range(B)), torch.arange(0, B * ctx + 1, ctx))
                qn, kn, vn = _qkv(B, hq, hkv, d, dtype, seed=1)
                cu = torch.arange(B + 1)
                kt = k.view(B, ctx, hkv, d).transpose(1, 2).contiguous()
                vt = v.view(B, ctx, hkv, d).transpose(1, 2).contiguous()
                qt = qn.view(B, 1, hq, d).transpose(1, 2).contiguous()
                cfg = {"phase": "decode", "batch": B, "context": ctx, "heads": hq, "kv_heads": hkv, "head_dim": d,
                       "dtype": str(dtype).split(".")[-1]}
                yield ("attention.cached_attention", cfg,
                       lambda qn=qn, kn=kn, vn=vn, cache=cache, B=B, cu=cu: cached_attention(qn, kn, vn, cache, list(range(B)), cu),
                       lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report to write")
    ap.add_argument("--quick", action="store_true", help="a few small configurations (smoke run)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)

    dev, ver = device_info("cpu"), versions()
    rows: list[dict[str, Any]] = []
    for op, cfg, ours, sdpa in [*prefill_cases(args.quick), *decode_cases(args.quick)]:
        stats = measure_interleaved({"ours": ours, "sdpa": sdpa}, warmup=args.warmup, repeats=args.repeats)
        for name, fn, base in (("sdpa", sdpa, None), ("ours", ours, "torch.sdpa")):
            mem, method = peak_memory(fn)
            extra = {"machine_load": machine_load()}
            if base is not None:
                extra["ratio_vs_baseline"] = stats["ours"].median / stats["sdpa"].median
            rows.append(make_row(benchmark=BENCHMARK, op=op, implementation=IMPL if base else "torch.sdpa",
                                 baseline=base, config=cfg, stats=stats[name], warmup=args.warmup, device=dev,
                                 versions=ver, peak_memory_bytes=mem, peak_memory_method=method, extra=extra))
        r = rows[-1]
        print(f"{op:28s} {cfg}: rl-kernel {r['median']:.2f} ms, SDPA {rows[-2]['median']:.2f} ms, "
              f"x{r['ratio_vs_baseline']:.2f}", flush=True)
    write_report(rows, args.out, meta={"threads": torch.get_num_threads()})
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
