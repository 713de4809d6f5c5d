"""Invariant CPU mixture-of-experts block vs Hugging Face's eager ``Qwen3MoeSparseMoeBlock``.

One sparse MoE block (router GEMM, top-k routing, experts, combine) on ``T`` tokens:

* rl-kernel: ``gemm.linear`` (router) → ``moe.route`` → ``moe.experts`` (the exact-sum CPU
  backend);
* baseline: transformers' ``Qwen3MoeSparseMoeBlock`` with ``experts_implementation="eager"``
  (per expert ``F.linear`` on the tokens it received, ``index_add_`` in the model dtype) on the same
  weights.

Forward, and forward + backward (gradients of the input, router and expert weights). The two
run round-robin in one process (``measure_interleaved``); each row records median/p20/p80 of the
repeats after warm-up, peak memory, machine, load and versions, and the rl-kernel rows carry
``ratio_vs_baseline``. Nothing is gated.

Usage::

    python benchmarks/operators/bench_moe_cpu.py --out reports/cpu/bench_moe_cpu.json
    python benchmarks/operators/bench_moe_cpu.py --quick --out /tmp/moe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.common.harness import (
    device_info,
    machine_load,
    make_row,
    measure_interleaved,
    peak_memory,
    versions,
    write_report,
)

BENCHMARK = "bench_moe_cpu"
IMPL = "cpu.exact_sum"
BASELINE = "transformers.Qwen3MoeSparseMoeBlock(eager)"
#: (hidden, experts, top-k, expert intermediate): a small block and a wider one
SHAPES = ((256, 16, 4, 128), (1024, 64, 8, 256))


def _blocks(H: int, E: int, K: int, I: int, dtype: torch.dtype, seed: int = 0):
    """``(hf block, (router, gate_up, down) for rl-kernel)`` with the same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                         norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=g) / H**0.5)
        block.experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) / H**0.5)
        block.experts.down_proj.copy_(torch.randn(E, H, I, generator=g) / I**0.5)
    block = block.to(dtype)
    return block, (block.gate.weight.detach().clone(), block.experts.gate_up_proj.detach().clone(),
                   block.experts.down_proj.detach().clone())


def _ours(x, wr, wgu, wd, K):
    from rl_engine.ops import moe
    from rl_engine.ops.gemm import linear

    w, ids = moe.route(linear(x, wr), K, True)
    return moe.experts(x, wgu, wd, w, ids)


def cases(quick: bool):
    tokens = (1, 64) if quick else (1, 16, 128, 512)
    dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    shapes = SHAPES[:1] if quick else SHAPES
    for H, E, K, I in shapes:
        for dtype in dtypes:
            block, (wr, wgu, wd) = _blocks(H, E, K, I, dtype)
            for T in tokens:
                x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
                cfg = {"tokens": T, "hidden": H, "experts": E, "top_k": K, "moe_intermediate": I,
                       "dtype": str(dtype).split(".")[-1]}
                yield (dict(cfg, backward=False), lambda x=x, a=(wr, wgu, wd), K=K: _ours(x, *a, K),
                       lambda x=x, b=block: b(x[None]))
                leaves = [t.clone().requires_grad_() for t in (x, wr, wgu, wd)]
                xb = x[None].clone().requires_grad_()

                def ours_fb(leaves=leaves, K=K):
                    for t in leaves:
                        t.grad = None
                    _ours(*leaves, K).sum().backward()

                def hf_fb(xb=xb, b=block):
                    b.zero_grad(set_to_none=True)
                    xb.grad = None
                    b(xb).sum().backward()

                yield dict(cfg, backward=True), ours_fb, hf_fb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON report to write")
    ap.add_argument("--quick", action="store_true", help="a few small configurations (smoke run)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        ap.error("--warmup/--repeats: expected warmup >= 0 and repeats >= 1")

    dev, ver = device_info("cpu"), versions()
    rows: list[dict[str, Any]] = []
    for cfg, ours, hf in cases(args.quick):
        stats = measure_interleaved({"ours": ours, "hf": hf}, warmup=args.warmup, repeats=args.repeats)
        for name, fn, base in (("hf", hf, None), ("ours", ours, BASELINE)):
            mem, method = peak_memory(fn)
            extra = {"machine_load": machine_load()}
            if base is not None:
                extra["ratio_vs_baseline"] = stats["ours"].median / stats["hf"].median
            rows.append(make_row(benchmark=BENCHMARK, op="moe.block", implementation=IMPL if base else BASELINE,
                                 baseline=base, config=cfg, stats=stats[name], warmup=args.warmup, device=dev,
                                 versions=ver, peak_memory_bytes=mem, peak_memory_method=method, extra=extra))
        r = rows[-1]
        print(f"moe.block {cfg}: rl-kernel {r['median']:.2f} ms, HF eager {rows[-2]['median']:.2f} ms, "
              f"x{r['ratio_vs_baseline']:.2f}", flush=True)
    write_report(rows, args.out, meta={"threads": torch.get_num_threads()})
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
