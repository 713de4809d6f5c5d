"""Where does the prefill time of the Triton attention go? An ablation on the GPU.

A minimal causal flash-attention forward (``rlk_probe_attn_fwd``, *not* a shipped kernel and not
batch-invariant in every variant) whose constexpr switches add, one at a time, the features that
the shipped kernel (``rl_engine.backends.triton.attention``) has and a textbook kernel
does not:

* ``PACK``   GQA rows packed into the query tile (row = token·G + g, one program per kv head)
             vs one program per query head (row = token);
* ``TREE``   the fixed pairwise row sum (``rlk_attn_rowsum``, strided halves) vs ``tl.sum``;
             ``TREE=2``: an adjacent-pair tree (the row-sum tests' negative control), side by side;
* ``EXP2``   ``exp2`` with the scale folded into ``log2(e)`` vs ``exp`` after a scale multiply;
* ``IND``    key rows through a loaded base and ``min(position, cap)`` (the shipped addressing,
             which hides the rows' contiguity from the compiler) vs ``b·S + position``;
* ``BN``     keys per block (the shipped contract fixes 64);
* fp fusion on/off at launch (the shipped kernels launch with ``enable_fp_fusion=False``);
* ``+ind+table`` (``rlk_probe_attn_fwd_tab``): the tile from the shipped tile table (grid
  (table rows, kv heads)) with the shipped ``if last >= 0`` and masked q / output.
* ``tma*`` (``rlk_probe_attn_fwd_tma``): the textbook kernel with its
  q / K / V / output tiles moved by the tensor-memory accelerator (host ``TensorDescriptor``s
  over the ``[T, H·D]`` views), optionally with ``tl.range(..., warp_specialize=True)`` for the
  unmasked blocks, and ``+contract`` with the shipped numerics (64-key blocks, the fixed row
  sum, ``exp``, no FMA contraction): whether a Hopper data path moves the ceiling that the
  textbook kernel sets (0.58-0.70 of SDPA on the H200). A variant that does not compile on the
  device's Triton is recorded as its error.

The same process times the shipped launchers (train path ``varlen_forward`` with the fp32 output
and lse; rollout path ``cached_forward(path="prefill")``, output only) and SDPA on the same
inputs, all as CUDA-graph replays (``benchmarks.common.harness.cuda_graph_ms``).

    python3 tools/benchmarking/attention_ablation_gpu.py --out /tmp/ablation.json
    python3 tools/benchmarking/attention_ablation_gpu.py --out /tmp/a.json --shapes 128x128,8x1024 --only 'ind|cached'
    ncu -k regex:rlk_ --launch-skip 1 python3 tools/benchmarking/attention_ablation_gpu.py --out /dev/null \
        --shapes 32x512 --once 'rlk.cached_forward(prefill: out)'
"""

from __future__ import annotations

import argparse
import json
import math
import re
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


@triton.jit
def rlk_probe_adjacent_rowsum(x, BLOCK_M: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """An adjacent-pair tree (``x[2j] + x[2j+1]`` at every level): fixed like the shipped
    strided-halves fold but a different order, timed side by side with it (``TREE=2``)."""
    for i in tl.static_range(LOG2N):
        x = tl.reshape(x, [BLOCK_M, N >> (i + 1), 2])
        a, b = tl.split(x)
        x = a + b
    return tl.reshape(x, [BLOCK_M])


@triton.jit
def rlk_probe_block(q, k_ptr, v_ptr, b, S, base, cap, kvh, pos, start, m, l, acc, scale, HKV: tl.constexpr,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr, TREE: tl.constexpr,
                 EXP2: tl.constexpr, IND: tl.constexpr, MASKED: tl.constexpr):
    offs_d = tl.arange(0, D)
    kpos = start + tl.arange(0, BN)
    if IND:
        rows = (base + tl.minimum(kpos, cap).to(tl.int64)) * HKV + kvh
    else:
        rows = (b * S + kpos).to(tl.int64) * HKV + kvh
    kt = tl.load(k_ptr + rows[None, :] * D + offs_d[:, None])
    v = tl.load(v_ptr + rows[:, None] * D + offs_d[None, :])
    s = tl.dot(q, kt) * scale
    if MASKED:
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
    return rlk_probe_update(s, v, m, l, acc, BM, BN, LOG2BN, TREE, EXP2)


@triton.jit
def rlk_probe_update(s, v, m, l, acc, BM: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr, TREE: tl.constexpr,
                     EXP2: tl.constexpr):
    """The online-softmax update of one block's scores ``s`` (both probes)."""
    mn = tl.maximum(m, tl.max(s, axis=1))
    if EXP2:
        alpha = tl.exp2(m - mn)
        p = tl.exp2(s - mn[:, None])
    else:
        alpha = tl.exp(m - mn)
        p = tl.exp(s - mn[:, None])
    if TREE == 1:
        rs = rlk_attn_rowsum(p, BM, BN, LOG2BN)
    elif TREE == 2:
        rs = rlk_probe_adjacent_rowsum(p, BM, BN, LOG2BN)
    else:
        rs = tl.sum(p, axis=1)
    l = l * alpha + rs
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return mn, l, acc


@triton.jit
def rlk_probe_walk(q, k_ptr, v_ptr, b, S, base, lo_pos, hi_pos, kvh, pos, scale, HKV: tl.constexpr, D: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr, TREE: tl.constexpr, EXP2: tl.constexpr,
                   IND: tl.constexpr):
    """The causal block walk of both probe kernels: unmasked blocks every row sees entirely, then
    the masked ones up to the tile's last position; returns the normalised output tile."""
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    n_full = (lo_pos + 1) // BN
    for i in range(0, n_full):
        m, l, acc = rlk_probe_block(q, k_ptr, v_ptr, b, S, base, hi_pos, kvh, pos, i * BN, m, l, acc, scale, HKV, D,
                                    BM, BN, LOG2BN, TREE, EXP2, IND, False)
    for i in range(n_full, hi_pos // BN + 1):
        m, l, acc = rlk_probe_block(q, k_ptr, v_ptr, b, S, base, hi_pos, kvh, pos, i * BN, m, l, acc, scale, HKV, D,
                                    BM, BN, LOG2BN, TREE, EXP2, IND, True)
    return acc / l[:, None]


@triton.jit
def rlk_probe_attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, S, scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr, PACK: tl.constexpr,
                       TREE: tl.constexpr, EXP2: tl.constexpr, IND: tl.constexpr):
    tile = tl.program_id(0)
    hb = tl.program_id(1)
    b = tl.program_id(2)
    G = HQ // HKV
    offs_d = tl.arange(0, D)
    if PACK:
        kvh = hb
        unit = tile * BM + tl.arange(0, BM)
        tok = unit // G
        head = kvh * G + unit % G
    else:
        kvh = hb // G
        tok = tile * BM + tl.arange(0, BM)
        head = tok * 0 + hb
    qoff = ((b * S + tok).to(tl.int64) * HQ + head) * D
    q = tl.load(q_ptr + qoff[:, None] + offs_d[None, :])
    base = tl.load(cu_ptr + b).to(tl.int64)
    o = rlk_probe_walk(q, k_ptr, v_ptr, b, S, base, tl.min(tok, axis=0), tl.max(tok, axis=0), kvh, tok, scale, HKV, D,
                       BM, BN, LOG2BN, TREE, EXP2, IND)
    tl.store(o_ptr + qoff[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty))


@triton.jit
def rlk_probe_attn_fwd_tab(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, tab_ptr, S, scale, HQ: tl.constexpr, HKV: tl.constexpr,
                           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr,
                           TREE: tl.constexpr, EXP2: tl.constexpr):
    """``+ind`` (packed GQA rows, loaded key-row base) whose tile comes from the shipped kernel's
    tile table (grid (table rows, kv heads), rows ``[seq, unit0, unit1, pos_base]``), with the
    shipped ``if last >= 0`` around the body and masked q loads / output stores: the prologue the
    shipped kernel has and the grid-derived probe does not."""
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    offs_d = tl.arange(0, D)
    seq = tl.load(tab_ptr + t * 4)
    u0 = tl.load(tab_ptr + t * 4 + 1)
    u1 = tl.load(tab_ptr + t * 4 + 2)
    pbase = tl.load(tab_ptr + t * 4 + 3)
    tok0 = u0 // G
    rel = (u0 - tok0 * G).to(tl.int32) + tl.arange(0, BM)
    valid = tl.arange(0, BM).to(tl.int64) < u1 - u0
    tq = rel // G
    tokg = tok0 + tq
    head = kvh * G + (rel - tq * G)
    pos = tl.where(valid, tokg - pbase, 0).to(tl.int32)
    qoff = (tokg * HQ + head) * D
    lo_pos = tl.min(tl.where(valid, pos, 1 << 30), axis=0)
    hi_pos = tl.max(tl.where(valid, pos, -1), axis=0)
    if hi_pos >= 0:
        q = tl.load(q_ptr + qoff[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        base = tl.load(cu_ptr + seq).to(tl.int64)
        o = rlk_probe_walk(q, k_ptr, v_ptr, seq, S, base, lo_pos, hi_pos, kvh, pos, scale, HKV, D, BM, BN, LOG2BN, TREE,
                           EXP2, True)
        tl.store(o_ptr + qoff[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def rlk_probe_tma_block(q, k_desc, v_desc, krow, kcol, start, pos, m, l, acc, scale, BM: tl.constexpr, BN: tl.constexpr,
                        LOG2BN: tl.constexpr, TREE: tl.constexpr, EXP2: tl.constexpr, MASKED: tl.constexpr):
    kt = k_desc.load([krow + start, kcol])  # [BN, D]
    v = v_desc.load([krow + start, kcol])
    s = tl.dot(q, kt.T) * scale
    if MASKED:
        s = tl.where((start + tl.arange(0, BN))[None, :] <= pos[:, None], s, float("-inf"))
    return rlk_probe_update(s, v, m, l, acc, BM, BN, LOG2BN, TREE, EXP2)


@triton.jit
def rlk_probe_attn_fwd_tma(q_desc, k_desc, v_desc, o_desc, S, scale, HQ: tl.constexpr, HKV: tl.constexpr,
                           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr,
                           TREE: tl.constexpr, EXP2: tl.constexpr, WS: tl.constexpr):
    """Causal forward, one program per (query tile, query head, sequence) of equal-length
    sequences, every tile through a TMA descriptor over the ``[T, H·D]`` view. ``BM`` must be a
    multiple of ``BN``: the blocks before the tile are unmasked (the loop ``WS`` warp-specialises),
    the ``BM / BN`` diagonal blocks masked."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kcol = (h // (HQ // HKV)) * D
    row0 = b * S + tile * BM
    q = q_desc.load([row0, h * D])
    pos = tile * BM + tl.arange(0, BM)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, tile * BM, BN, warp_specialize=WS):
        m, l, acc = rlk_probe_tma_block(q, k_desc, v_desc, b * S, kcol, start, pos, m, l, acc, scale, BM, BN, LOG2BN,
                                        TREE, EXP2, False)
    for start in range(tile * BM, (tile + 1) * BM, BN):
        m, l, acc = rlk_probe_tma_block(q, k_desc, v_desc, b * S, kcol, start, pos, m, l, acc, scale, BM, BN, LOG2BN,
                                        TREE, EXP2, True)
    o_desc.store([row0, h * D], (acc / l[:, None]).to(o_desc.dtype))


def probe_tma(q, k, v, B, S, *, bm=128, bn=64, ws=False, contract=False, warps=8, stages=3):
    """The TMA probe (``rlk_probe_attn_fwd_tma``); ``contract``: the shipped numerics (fixed row
    sum, ``exp``, no FMA contraction) on the same data path."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T = q.shape[0]
    out = torch.empty_like(q)
    qd = TensorDescriptor.from_tensor(q.view(T, HQ * D), [bm, D])
    od = TensorDescriptor.from_tensor(out.view(T, HQ * D), [bm, D])
    kd = TensorDescriptor.from_tensor(k.view(T, HKV * D), [bn, D])
    vd = TensorDescriptor.from_tensor(v.view(T, HKV * D), [bn, D])
    scale = D**-0.5 * (1.0 if contract else math.log2(math.e))
    rlk_probe_attn_fwd_tma[(S // bm, HQ, B)](qd, kd, vd, od, S, scale, HQ=HQ, HKV=HKV, D=D, BM=bm, BN=bn,
                                             LOG2BN=int(math.log2(bn)), TREE=contract, EXP2=not contract, WS=ws,
                                             num_warps=warps, num_stages=stages, enable_fp_fusion=not contract)
    return out


TMA_VARIANTS = {
    # name: keyword arguments of probe_tma
    "tma_bn64_w8_s3": dict(bn=64),
    "tma_bn128_w8_s3": dict(bn=128),
    "tma_ws_bn64_w8_s3": dict(bn=64, ws=True),
    "tma_ws_bn128_w8_s3": dict(bn=128, ws=True),
    "tma_ws_bn64_w4_s3": dict(bn=64, ws=True, warps=4),
    "tma_bn64_w8_s3+contract": dict(bn=64, contract=True),
    "tma_ws_bn64_w8_s3+contract": dict(bn=64, ws=True, contract=True),
}


def probe_tab(q, k, v, cu, B, S, *, warps=8, stages=2):
    """``+ind`` on the shipped tile table (``launch.varlen_tiles``, built outside the timing)."""
    from rl_engine.backends.triton.attention import launch as L

    out = torch.empty_like(q)
    tab = probe_tab.tables.get((B, S))
    if tab is None:
        tab = probe_tab.tables[(B, S)] = L.varlen_tiles(cu, HQ // HKV, 128, q.shape[0])
    rlk_probe_attn_fwd_tab[(tab.shape[0], HKV)](q, k, v, out, cu, tab, S, D**-0.5, HQ=HQ, HKV=HKV, D=D, BM=128, BN=64,
                                                LOG2BN=6, TREE=1, EXP2=False, num_warps=warps, num_stages=stages,
                                                enable_fp_fusion=False)
    return out


probe_tab.tables = {}


def probe(q, k, v, cu, B, S, *, bm, bn, pack, tree, exp2, ind, warps, stages, fusion):
    out = torch.empty_like(q)
    G = HQ // HKV
    scale = D**-0.5 * (math.log2(math.e) if exp2 else 1.0)
    grid = (S * G // bm, HKV, B) if pack else (S // bm, HQ, B)
    rlk_probe_attn_fwd[grid](q, k, v, out, cu, S, scale, HQ=HQ, HKV=HKV, D=D, BM=bm, BN=bn, LOG2BN=int(math.log2(bn)),
                             PACK=pack, TREE=tree, EXP2=exp2, IND=ind, num_warps=warps, num_stages=stages,
                             enable_fp_fusion=fusion)
    return out


VARIANTS = {
    # name: (bm, bn, pack, tree, exp2, ind, warps, stages, fusion)
    "textbook_bn128_w8_s3": (128, 128, False, False, True, False, 8, 3, True),
    "textbook_bn64_w8_s3": (128, 64, False, False, True, False, 8, 3, True),
    "textbook_bn64_w4_s3": (128, 64, False, False, True, False, 4, 3, True),
    "textbook_bn64_w8_s2": (128, 64, False, False, True, False, 8, 2, True),
    "+nofusion": (128, 64, False, False, True, False, 8, 2, False),
    "+exp": (128, 64, False, False, False, False, 8, 2, False),
    "+tree": (128, 64, False, True, False, False, 8, 2, False),
    "+tree_adjacent": (128, 64, False, 2, False, False, 8, 2, False),
    "+pack": (128, 64, True, True, False, False, 8, 2, False),
    "+ind (all shipped features)": (128, 64, True, True, False, True, 8, 2, False),
    "all_w4_s3": (128, 64, True, True, False, True, 4, 3, False),
    "all_m64_w4_s3": (64, 64, True, True, False, True, 4, 3, False),
    "pack_only": (128, 64, True, False, True, False, 8, 2, True),
    "tree_only": (128, 64, False, True, True, False, 8, 2, True),
    "tree_adjacent_only": (128, 64, False, 2, True, False, 8, 2, True),
    "ind_only": (128, 64, False, False, True, True, 8, 2, True),
    "tree_bn128": (128, 128, False, True, True, False, 8, 3, True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", default="32x512,4x4096", help="comma-separated BxS cases (default: %(default)s)")
    ap.add_argument("--only", default=None, help="regex: time only the implementations whose name matches")
    ap.add_argument("--once", default=None, metavar="NAME",
                    help="call the named implementation once per case (after one compiling call) and exit: "
                         "the run to put under ncu (-k regex:rlk_)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in c.split("x")) for c in args.shapes.split(",")]
    from rl_engine.backends.triton.attention import launch as L

    rows = []
    for B, S in shapes:
        g = torch.Generator(device="cuda").manual_seed(B * S)
        T = B * S
        q, k, v = (torch.randn((T, h, D), device="cuda", generator=g).to(torch.bfloat16) for h in (HQ, HKV, HKV))
        cu = torch.arange(0, T + 1, S, device="cuda", dtype=torch.int32)
        qs, ks, vs = (t.view(B, S, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
        flop = 4 * B * HQ * D * S * (S + 1) / 2
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(T, HQ, D)
        q_seq = torch.arange(B, device="cuda").repeat_interleave(S)
        q_pos = torch.arange(S, device="cuda").repeat(B)
        page_rows = (torch.arange(B, device="cuda") * S)[:, None].contiguous()
        impls = {
            "torch.sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
            "rlk.varlen_forward(train: out+f32+lse)": lambda: L.varlen_forward(q, k, v, cu, D**-0.5, None, max_seqlen=S),
            "rlk.cached_forward(prefill: out)": lambda: L.cached_forward(q, k, v, page_rows, S, q_seq, q_pos,
                                                                        D**-0.5, None, path="prefill"),
        }
        for name, cfg in VARIANTS.items():
            kw = dict(zip(("bm", "bn", "pack", "tree", "exp2", "ind", "warps", "stages", "fusion"), cfg))
            impls[f"probe:{name}"] = lambda kw=kw: probe(q, k, v, cu, B, S, **kw)
        impls["probe:+ind+table"] = lambda: probe_tab(q, k, v, cu, B, S)
        for name, kw in TMA_VARIANTS.items():
            impls[f"probe:{name}"] = lambda kw=kw: probe_tma(q, k, v, B, S, **kw)
        if args.once is not None:
            if args.once not in impls:
                raise SystemExit(f"--once: expected one of {sorted(impls)}, got {args.once!r}")
            impls[args.once]()
            torch.cuda.synchronize()
            impls[args.once]()
            torch.cuda.synchronize()
            continue
        if args.only is not None:
            impls = {n: f for n, f in impls.items() if n == "torch.sdpa" or re.search(args.only, n)}
        base = None
        for name, fn in impls.items():
            try:
                o = fn()
                o = o[0] if isinstance(o, tuple) else o
                if o.dim() == 4:
                    o = o.transpose(1, 2).reshape(T, HQ, D)
                err = (o.float() - ref.float()).abs().max().item()
                st = summarize(cuda_graph_ms(fn, calls=args.calls, repeats=args.repeats, warmup=2))
                row = {"case": {"B": B, "S": S}, "impl": name, "p50_ms": st.median, "p20_ms": st.p20, "p80_ms": st.p80,
                       "tflops": round(flop / st.median / 1e9, 1), "max_abs_err_vs_sdpa": err}
                if name == "torch.sdpa":
                    base = st.median
                row["throughput_vs_sdpa"] = round(base / st.median, 3) if base else None
            except Exception as exc:  # a variant that fails to compile is a finding, not a crash
                row = {"case": {"B": B, "S": S}, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:400]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"device": device_info(), "versions": versions(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
