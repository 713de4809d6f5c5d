"""Where does a batch-1 decode step's time go? An ablation of the split walk on the GPU.

The batch-1 decode step is bound by each program's walk over its KV split's 16 blocks (about
1 µs per 64-key block on the H200), and neither the key loads nor the score products set that
cost (a walk reading precomputed scores instead is slower). This probe times a minimal split walk (``rlk_probe_decode``, *not* a
shipped kernel) with one part of the per-block work switched off at a time, at the shape of a
Qwen3-8B batch-1 step (8 kv heads × G = 4 query heads, D = 128, bf16, a 16-row tile of which 4
rows are the query), grid (kv heads, KV splits, value slices), each program writing its split's
``(m, l, acc)`` (no combine):

* ``full``      the shipped per-block arithmetic: ``s = q·kᵀ``, row max, ``P = 2^fma(s, c, −m)``,
                the fixed pairwise row sum (``rlk_attn_rowsum``), ``acc = acc·α + P·V``;
* ``sum``       ``full`` with ``tl.sum`` for the row sum (not the contract: its association
                follows the register layout);
* ``no_tree``   ``full`` without the row sum (``l`` gets the row max: the sum's cost alone);
* ``no_softmax`` ``P = s`` cast to bf16 (no max, no exponentials, no row sum): QK and PV chained;
* ``qk_only``   scores and their row max only (no ``P·V``);
* ``pv_only``   ``P`` = ones (no scores): the value loads and the PV chain.

each with 1, 2 and 4 warps, 1 or 4 value slices, beside the shipped one-pass step
(``launch.cached_forward(decode_only=True)``, its own split kernel and combine) and SDPA, at 4096
and 32768 keys. CUDA-graph replays (``benchmarks.common.harness.cuda_graph_ms``), median of the
samples; a variant that does not compile is recorded with its error.

    python3 tools/benchmarking/decode_ablation_gpu.py --out /tmp/decode_ablation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import cuda_graph_ms, device_info, summarize, versions  # noqa: E402
from rl_engine.backends.triton.attention.device import rlk_attn_rowsum  # noqa: E402

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
MODES = {"full": 0, "sum": 1, "no_tree": 2, "no_softmax": 3, "qk_only": 4, "pv_only": 5}


@triton.jit
def rlk_probe_decode(q_ptr, k_ptr, v_ptr, ws_ptr, qk_scale, NS, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                     DV: tl.constexpr, SB: tl.constexpr, MODE: tl.constexpr):
    """Program (kv head, split, value slice): the split's 16 blocks of 64 keys, in order, for the
    16-row tile whose first G rows are the query heads of the kv head (batch 1, every key
    visible: no masks). Writes ``m``, ``l`` and the ``DV`` accumulator columns to ``ws``."""
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    vs = tl.program_id(2)
    r = tl.arange(0, 16)
    offs_d = tl.arange(0, D)
    offs_v = vs * DV + tl.arange(0, DV)
    q = tl.load(q_ptr + (kvh * G + r)[:, None] * D + offs_d[None, :], mask=(r < G)[:, None], other=0.0)
    m = tl.full([16], float("-inf"), tl.float32)
    l = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, DV], tl.float32)
    for b in range(sp * SB, sp * SB + SB):
        rows = (b * 64 + tl.arange(0, 64)).to(tl.int64) * HKV + kvh
        v = tl.load(v_ptr + rows[:, None] * D + offs_v[None, :])
        if MODE == 5:
            acc = tl.dot(tl.full([16, 64], 1.0, v.dtype), v, acc)
        else:
            kt = tl.load(k_ptr + rows[None, :] * D + offs_d[:, None])
            s = tl.dot(q, kt)
            if MODE == 3:
                acc = tl.dot(s.to(v.dtype), v, acc)
            else:
                mn = tl.maximum(m, tl.max(s, axis=1) * qk_scale + 0.0)
                alpha = tl.exp2(m - mn)
                if MODE == 4:
                    l = tl.fma(l, alpha, mn)
                else:
                    p = tl.exp2(tl.fma(s, qk_scale, -mn[:, None]))
                    if MODE == 0:
                        rs = rlk_attn_rowsum(p, 16, 64, 6)
                    elif MODE == 1:
                        rs = tl.sum(p, axis=1)
                    else:
                        rs = mn
                    l = tl.fma(l, alpha, rs)
                    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m = mn
    slot = (kvh * NS + sp) * 16 + r
    first = (r < G) & (tl.full([16], vs, tl.int32) == 0)  # one slice stores the row state
    tl.store(ws_ptr + slot * (D + 2), m, mask=first)
    tl.store(ws_ptr + slot * (D + 2) + 1, l, mask=first)
    tl.store(ws_ptr + slot[:, None] * (D + 2) + 2 + offs_v[None, :], acc, mask=(r < G)[:, None])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--contexts", default="4096,32768")
    args = ap.parse_args(argv)
    from rl_engine.backends.triton.attention import launch as L
    from rl_engine.backends.triton.attention.configs import score_scale

    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        g = torch.Generator(device="cuda").manual_seed(ctx)
        k, v = (torch.randn((ctx, HKV, D), device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        q = torch.randn((1, HQ, D), device="cuda", generator=g).to(torch.bfloat16)
        ns = ctx // 1024
        ws = torch.empty((HKV * ns * 16 * (D + 2),), device="cuda", dtype=torch.float32)
        ks, vs_ = (t.view(1, ctx, HKV, D).transpose(1, 2).contiguous() for t in (k, v))
        qs = q.view(1, 1, HQ, D).transpose(1, 2).contiguous()
        zero = torch.zeros(1, dtype=torch.int64, device="cuda")
        impls = {
            "torch.sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs_, enable_gqa=True),
            "rlk.cached_forward (shipped step)": lambda: L.cached_forward(q, k, v, zero[:, None], ctx, zero, zero + ctx - 1,
                                                                          D**-0.5, None, decode_only=True),
        }
        for mode, code in MODES.items():
            for warps in (1, 2, 4):
                for vsl in (1, 4):
                    def fn(code=code, warps=warps, vsl=vsl):
                        rlk_probe_decode[(HKV, ns, vsl)](q, k, v, ws, score_scale(D**-0.5), ns, HKV=HKV, G=G, D=D,
                                                         DV=D // vsl, SB=16, MODE=code, num_warps=warps, num_stages=3,
                                                         enable_fp_fusion=False)
                        return ws
                    impls[f"probe:{mode}@w{warps}_v{vsl}"] = fn
        for name, fn in impls.items():
            try:
                fn()
                st = summarize(cuda_graph_ms(fn, calls=args.calls, repeats=args.repeats, warmup=2))
                row = {"context": ctx, "impl": name, "p50_us": round(st.median * 1e3, 2), "p20_us": round(st.p20 * 1e3, 2),
                       "p80_us": round(st.p80 * 1e3, 2), "us_per_block": round(st.median * 1e3 / 16, 3)}
            except Exception as exc:  # a variant that fails to compile is a finding, not a crash
                row = {"context": ctx, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"tool": "decode_ablation_gpu", "device": device_info("cuda"),
                                          "versions": versions(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
