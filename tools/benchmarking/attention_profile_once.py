"""One packed causal attention forward, run a few times inside an NVTX range, for a profiler.

``ncu --nvtx --nvtx-include "rlk_profile/"`` then profiles only the kernels of the last call
(the earlier calls compile and warm up). Implementations: ``wg`` (the shipped train-path forward,
the Hopper warpgroup kernel where eligible), ``triton`` (``kernels.wg_forward(False)``), ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention`` on the padded ``[B, H, S, D]`` layout).

    ncu --clock-control none --nvtx --nvtx-include "rlk_profile/" --set full -o prof \\
        python tools/benchmarking/attention_profile_once.py --shape 4x4096 --impl wg
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x4096", help="BxS: B sequences of S tokens")
    ap.add_argument("--impl", choices=("wg", "triton", "sdpa"), default="wg")
    ap.add_argument("--train", action="store_true", help="the training forward (fp32 output and lse stored)")
    ap.add_argument("--heads", default="32x8", help="query heads x kv heads (head dim 128)")
    args = ap.parse_args(argv)
    try:
        B, S = (int(x) for x in args.shape.split("x"))
        hq, hkv = (int(x) for x in args.heads.split("x"))
    except ValueError:
        ap.error(f"--shape BxS and --heads HQxHKV with positive integers, got {args.shape!r}, {args.heads!r}")
    if min(B, S, hq, hkv) < 1 or hq % hkv:
        ap.error(f"--shape and --heads: positive sizes and query heads a multiple of kv heads, got "
                 f"{args.shape!r}, {args.heads!r}")
    if not torch.cuda.is_available():
        print("attention_profile_once: needs a CUDA GPU", file=sys.stderr)
        return 2
    from rl_engine.backends.shared.triton.attention import kernels as K

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((B * S, h, 128), device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.arange(0, (B + 1) * S, S, device="cuda", dtype=torch.int32)
    if args.impl == "sdpa":
        qs, ks, vs = (t.view(B, S, -1, 128).transpose(1, 2).contiguous() for t in (q, k, v))

        def fn():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    else:
        def fn():
            if args.impl == "triton":
                with K.wg_forward(False):
                    return K.varlen_forward(q, k, v, cu, 128**-0.5, None, max_seqlen=S, for_backward=args.train)
            return K.varlen_forward(q, k, v, cu, 128**-0.5, None, max_seqlen=S, for_backward=args.train)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("rlk_profile")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
