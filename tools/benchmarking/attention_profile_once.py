"""One attention call (a packed causal forward, or a decode step), run a few times, the last
inside an NVTX range, for a profiler.

``ncu --nvtx --nvtx-include "rlk_profile/"`` then profiles only the kernels of the last call
(the earlier calls compile and warm up). Implementations: ``wg`` (the shipped train-path forward,
the Hopper warpgroup kernel where eligible), ``triton`` (``attention_tuning(wg_forward=False)``), ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention`` on the padded ``[B, H, S, D]`` layout).

``--decode BxCTX``: instead, one decode step (one query token per sequence at position
``CTX - 1``, ``launch.cached_forward(decode_only=True)``, what ``bench_attention_gpu.py``'s
decode rows time) over a contiguous cache (``--impl wg`` or ``triton``: the shipped selection)
or, with ``--paged``, over 16-token pages in shuffled order; ``--impl sdpa``: SDPA's decode
(``enable_gqa=True``). ``--decode-kernel`` picks the step's split kernel instead of the shipped
selection: ``triton`` (both Hopper decode kernels off), ``wgt`` / ``wgt-quad`` (the transposed
Hopper kernel at any size, one block a step / four where the cache allows), each call under the
scoped switches of ``attention_tuning``.

    ncu --clock-control none --nvtx --nvtx-include "rlk_profile/" --set full -o prof \\
        python tools/benchmarking/attention_profile_once.py --shape 4x4096 --impl wg
    ncu ... python tools/benchmarking/attention_profile_once.py --decode 64x4096 --paged
    ncu ... python tools/benchmarking/attention_profile_once.py --decode 1x4096 --paged --decode-kernel wgt
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
    ap.add_argument("--decode", default=None, metavar="BxCTX",
                    help="a decode step of B sequences at CTX keys instead of the packed forward")
    ap.add_argument("--paged", action="store_true", help="with --decode: a cache of 16-token pages, shuffled")
    ap.add_argument("--decode-kernel", choices=("shipped", "triton", "wgt", "wgt-quad"), default="shipped",
                    help="with --decode: the shipped selection, the Triton split kernels (both Hopper decode kernels "
                         "off), or the transposed Hopper kernel forced at any size, one block a step or four")
    args = ap.parse_args(argv)
    if args.paged and args.decode is None:
        ap.error("--paged needs --decode BxCTX")
    if args.decode_kernel != "shipped" and args.decode is None:
        ap.error("--decode-kernel needs --decode BxCTX")
    try:
        B, S = (int(x) for x in (args.decode or args.shape).split("x"))
        hq, hkv = (int(x) for x in args.heads.split("x"))
    except ValueError:
        ap.error(f"--shape BxS (--decode BxCTX) and --heads HQxHKV with positive integers, got "
                 f"{args.decode or args.shape!r}, {args.heads!r}")
    if min(B, S, hq, hkv) < 1 or hq % hkv:
        ap.error(f"--shape and --heads: positive sizes and query heads a multiple of kv heads, got "
                 f"{args.shape!r}, {args.heads!r}")
    if not torch.cuda.is_available():
        print("attention_profile_once: needs a CUDA GPU", file=sys.stderr)
        return 2
    from rl_engine.backends.triton.attention import launch
    from rl_engine.backends.triton.attention.tuning import attention_tuning

    g = torch.Generator(device="cuda").manual_seed(0)
    if args.decode is not None:
        fn = _decode_step(launch, B, S, hq, hkv, args.impl, args.paged, g)
        return _profile(_with_decode_kernel(fn, args.decode_kernel))
    q, k, v = (torch.randn((B * S, h, 128), device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.arange(0, (B + 1) * S, S, device="cuda", dtype=torch.int32)
    if args.impl == "sdpa":
        qs, ks, vs = (t.view(B, S, -1, 128).transpose(1, 2).contiguous() for t in (q, k, v))

        def fn():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    else:
        def fn():
            if args.impl == "triton":
                with attention_tuning(wg_forward=False):
                    return launch.varlen_forward(q, k, v, cu, 128**-0.5, None, max_seqlen=S, for_backward=args.train)
            return launch.varlen_forward(q, k, v, cu, 128**-0.5, None, max_seqlen=S, for_backward=args.train)
    return _profile(fn)


def _decode_step(launch, B: int, ctx: int, hq: int, hkv: int, impl: str, paged: bool, g: torch.Generator):
    """A decode step's call: one query token per sequence at position ``ctx - 1``."""
    kc, vc = (torch.randn((B * ctx, hkv, 128), device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn((B, hq, 128), device="cuda", generator=g).to(torch.bfloat16)
    if impl == "sdpa":
        qs = q.view(B, 1, hq, 128).transpose(1, 2).contiguous()
        ks, vs = (t.view(B, ctx, hkv, 128).transpose(1, 2).contiguous() for t in (kc, vc))
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
    q_seq = torch.arange(B, device="cuda")
    q_pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int64)
    if not paged:
        rows = (torch.arange(B, device="cuda", dtype=torch.int64) * ctx)[:, None].contiguous()
        ps, kk, vv = ctx, kc, vc
    else:
        ps = 16
        pages = torch.randperm(B * ctx // ps, generator=torch.Generator().manual_seed(0)).cuda()
        rows = (pages.view(B, ctx // ps) * ps).contiguous()
        pos = torch.arange(ctx, device="cuda")
        kk, vv = torch.empty_like(kc), torch.empty_like(vc)
        at = (rows[:, pos // ps] + pos % ps).reshape(-1)
        kk[at], vv[at] = kc, vc
    return lambda: launch.cached_forward(q, kk, vv, rows, ps, q_seq, q_pos, 128**-0.5, None, decode_only=True)


def _with_decode_kernel(fn, which: str):
    """``fn`` run under the switches that pick ``which`` decode split kernel (scoped to each call)."""
    import contextlib

    from rl_engine.backends.triton.attention.tuning import attention_tuning

    def scoped():
        with contextlib.ExitStack() as st:
            if which == "triton":
                st.enter_context(attention_tuning(wg_decode=False, wgt_decode=False))
            elif which in ("wgt", "wgt-quad"):
                st.enter_context(attention_tuning(wg_decode=False, wgt_decode_bands=((0.0, float("inf")),) * 2,
                                                  wgt_quad_programs=float("inf") if which == "wgt-quad" else 0.0))
            return fn()

    return fn if which == "shipped" else scoped


def _profile(fn) -> int:
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
