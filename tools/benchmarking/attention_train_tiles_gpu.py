"""Train-path tile configurations on the GPU at any head dim: raw bits and time, beside SDPA.

For one packed batch (``--mix``, e.g. ``4x4096``; ``--heads Hq,Hkv``; ``--head-dim``; bf16) it runs
``launch.varlen_forward`` (the output only, as a no-grad call runs it) with the shipped selection
and with every ``--configs`` key (``AttnConfig.key`` spelling: ``m64_w4_s2`` = 64-row tile, 4
warps, 2 stages), and ``launch.varlen_backward`` with the shipped backward tile and every
``--bwd-configs`` key; checks each candidate's output (forward) and ``dq, dk, dv`` (backward)
raw-bit against the shipped tile's (integer views); then times them all with SDPA
(``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``, forward and forward +
backward, sequences of equal length only) in CUDA graphs replayed round-robin
(``cuda_graphs_interleaved_ms``). A candidate that does not compile (``OutOfResources``) is
recorded with its error. A tool for choosing the ``prefill`` and ``backward`` table rows of a
head dim; the benchmark of record is ``benchmarks/operators/bench_matrix_gpu.py``.

    python tools/benchmarking/attention_train_tiles_gpu.py --out /tmp/tiles.json --head-dim 256 \\
        --configs m64_w4_s2,m64_w8_s2 --bwd-configs m64_w4_s2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import (  # noqa: E402
    cuda_graphs_interleaved_ms, device_info, portable_command, summarize, versions)
from rl_engine.utils.bits import same_bits  # noqa: E402
from tools.benchmarking.attention_decode_gpu import parse_config  # noqa: E402


def parse_mix(text: str) -> list[int]:
    """``"4x4096"`` -> four sequences of 4096 tokens; ``"1000,3000"`` -> those lengths."""
    if "x" in text:
        n, s = text.split("x", 1)
        return [int(s)] * int(n)
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--heads", default="16,4", help="Hq,Hkv (default 16,4)")
    ap.add_argument("--mix", default="4x4096", help="NxS or comma-separated sequence lengths")
    ap.add_argument("--configs", default="", help="comma-separated forward tile keys besides the shipped one")
    ap.add_argument("--bwd-configs", default="", help="comma-separated backward tile keys besides the shipped one")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3, help="calls per CUDA graph replay")
    ap.add_argument("--commit", default=None, help="the measured tree's commit (the device's copy may carry another "
                                                   "checkout's git history)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if not torch.cuda.is_available():
        print("attention_train_tiles_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    hq, hkv = (int(x) for x in args.heads.split(","))
    d, lens = args.head_dim, parse_mix(args.mix)
    if d not in C.HEAD_DIMS:
        ap.error(f"--head-dim: expected one of {list(C.HEAD_DIMS)}, got {d}")
    fwd = {"shipped": None, **{k: parse_config(k) for k in args.configs.split(",") if k}}
    bwd = {"shipped": None, **{k: parse_config(k) for k in args.bwd_configs.split(",") if k}}
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(d + T)
    q = torch.randn((T, hq, d), device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn((T, hkv, d), device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    grad = torch.randn((T, hq, d), device="cuda", generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    scale = d**-0.5
    shipped_fwd = C.select_prefill(torch.bfloat16, d, arch=None)
    shipped_bwd = C.select_backward(torch.bfloat16, d)
    rows, fns, errors = [], {}, {}
    ref = L.varlen_forward(q, k, v, cu, scale, None, max_seqlen=max(lens), for_backward=False)[0]
    for name, cfg in fwd.items():
        def f(cfg=cfg):
            return L.varlen_forward(q, k, v, cu, scale, None, config=cfg, max_seqlen=max(lens), for_backward=False)[0]
        try:
            ok = bool(same_bits(f(), ref))
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result
            errors[f"fwd {name}"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        rows.append({"pass": "forward", "config": name if cfg else f"shipped ({shipped_fwd.key})", "bits_equal": ok})
        fns[f"fwd {name}"] = f
    out, lse, out32 = L.varlen_forward(q, k, v, cu, scale, None, max_seqlen=max(lens))
    ref_grads = L.varlen_backward(grad, q, k, v, out32, lse, cu, scale, None)
    for name, cfg in bwd.items():
        def b(cfg=cfg):
            return L.varlen_backward(grad, q, k, v, out32, lse, cu, scale, None, config=cfg)
        try:
            ok = all(same_bits(x, y) for x, y in zip(b(), ref_grads))
        except Exception as e:  # noqa: BLE001
            errors[f"bwd {name}"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        rows.append({"pass": "backward", "config": name if cfg else f"shipped ({shipped_bwd.key})", "bits_equal": ok})
        fns[f"bwd {name}"] = b
    if len(set(lens)) == 1:  # SDPA over [B, H, S, D]
        qs, ks, vs = (t.view(len(lens), lens[0], t.shape[1], d).transpose(1, 2) for t in (q, k, v))
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (qs, ks, vs))
        gs = grad.view(len(lens), lens[0], hq, d).transpose(1, 2)
        fns["sdpa forward"] = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                     enable_gqa=True)

        def sdpa_train():
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
            return torch.autograd.grad(o, (qg, kg, vg), gs)

        fns["sdpa forward+backward"] = sdpa_train
    times = cuda_graphs_interleaved_ms(fns, calls=args.calls, repeats=args.repeats)
    med = {n: summarize(s).median for n, s in times.items()}
    for r in rows:
        key = f"{'fwd' if r['pass'] == 'forward' else 'bwd'} {r['config'].split(' ')[0]}"
        r["ms"] = round(med[key], 4)
        base = med.get("sdpa forward") if r["pass"] == "forward" else None
        if base:
            r["sdpa_ratio"] = round(base / med[key], 3)  # throughput vs SDPA
    sdpa = {n: round(m, 4) for n, m in med.items() if n.startswith("sdpa")}
    for r in rows:
        print(f"{r['pass']:9s} {r['config']:24s} {r['ms']:9.3f} ms  bits {'equal' if r['bits_equal'] else 'DIFFER'}"
              + (f"  {r['sdpa_ratio']:.3f} of SDPA" if "sdpa_ratio" in r else ""), flush=True)
    print("sdpa", sdpa, "errors", errors, flush=True)
    report = {"schema_version": 1, "tool": "attention_train_tiles_gpu", "commit": args.commit,
              "command": portable_command("tools/benchmarking/attention_train_tiles_gpu.py", raw),
              "device": device_info("cuda"),
              "versions": versions(), "case": {"head_dim": d, "heads": [hq, hkv], "lens": lens, "dtype": "bfloat16"},
              "shipped": {"forward": shipped_fwd.key, "backward": shipped_bwd.key}, "rows": rows, "sdpa_ms": sdpa,
              "errors": errors}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    bad = [r for r in rows if not r["bits_equal"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
