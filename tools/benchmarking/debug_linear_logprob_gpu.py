"""Stage-by-stage debugger of the Triton fused LM head (``logprob.linear_token_logprobs``) on a GPU.

Part 1 — bits. For each case (default: ``N=130, H=64, V=5000, fp32, τ=1``, where fp fusion
changes the bits, the LM-head vocabulary ``N=300, H=256, V=151936`` fp32, and a bf16 control) it isolates
every stage of the fused path against the unfused GPU path it must equal bit for bit
(``gemm.linear`` → ``token_logprobs`` / ``entropy``) and prints one line per stage::

    [case] stage ...................... equal | n/total differ (max |Δ| ...)

stages: forward ``lp`` / ``lse`` / ``entropy``; the ``dlogits`` the fused path forms (grad-hidden pass
row chunks and grad-weight pass vocabulary chunks) vs the unfused autograd ``dlogits``; the same fused
kernel launched with fp fusion **on** (expected to differ in fp32 at τ = 1: the contraction
``enable_fp_fusion=False`` prevents); ``grad_input`` / ``grad_weight`` on *identical* dlogits with the
row / column split and tile configurations each path uses; the full ``grad hidden`` /
``grad weight`` through the public op and autograd.

Part 2 — time (``--no-profile`` skips it). At ``H = 4096, V = 151936`` bf16, ``T ∈ {1024,
8192}``: the wall time (CUDA events, median) of one forward + backward of the fused op, of the
unfused Triton path and of the naive cuBLAS path; a ``torch.profiler`` breakdown of one fused
forward + backward (kernel name → total ms, count); micro-timings (TFLOP/s) of the GEMMs the
fused backward runs (grad-hidden pass ``grad_input`` over ``K = V`` at the grad-hidden pass row count with several
tile configurations — their outputs compared bitwise — grad-weight pass ``grad_weight``, the logits
GEMMs) and the extra peak memory of the fused forward + backward.

Usage (on the GPU machine, repository root)::

    python3 tools/benchmarking/debug_linear_logprob_gpu.py --out /tmp/debug_linear_logprob.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

RESULTS: dict = {"stages": [], "timing": {}, "profile": {}, "gemm": [], "memory": {}}


def _line(case: str, stage: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    from rl_engine.utils.bits import same_bits

    d = same_bits(a, b)
    if d.equal:
        msg = "equal"
    else:
        msg = str(d)
    print(f"[{case}] {stage:<58s} {msg}", flush=True)
    RESULTS["stages"].append({"case": case, "stage": stage, "equal": bool(d.equal), "detail": str(d)})
    return bool(d.equal)


def _data(n, h, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0], targets[1] = 0, v - 1
    up = torch.Generator().manual_seed(1)
    g_lp = torch.randn(n, generator=up)
    g_ent = torch.randn(n, generator=up)
    return [x.cuda() for x in (hidden, weight, targets, g_lp, g_ent)]


def _dlogits_launch(logits, c0, targets, lse, g_lp, ent, g_ent, temperature, fp_fusion: bool):
    """The fused dlogits kernel with an explicit fp-fusion setting (False = the shipped launch)."""
    import triton

    from rl_engine.backends.triton.logprob import fused

    R, C = logits.shape
    fused.rlk_linear_logprob_dlogits[(R, triton.cdiv(C, fused.VOCAB_BLOCK))](
        logits, logits, C, C, c0, targets, lse, g_lp, ent, g_ent, lse, lse, R, float(temperature),
        HAS_LP=True, HAS_ENT=True, HAS_TEMP=temperature != 1.0, KEPT=False, BLOCK_V=fused.VOCAB_BLOCK,
        num_warps=fused._WARPS, enable_fp_fusion=fp_fusion,
    )
    return logits


def stages(n: int, h: int, v: int, dtype: torch.dtype, temperature: float) -> None:
    from rl_engine.backends.triton import logprob as tlp
    from rl_engine.backends.triton.gemm import kernels as gk
    from rl_engine.backends.triton.gemm.configs import select_forward, select_weight_grad
    from rl_engine.backends.triton.logprob import fused
    from rl_engine.backends.triton.logprob import kernels as lk
    from rl_engine.ops import gemm, logprob

    case = f"{n}x{h}x{v} {str(dtype).split('.')[-1]} T={temperature}"
    hidden, weight, targets, g_lp, g_ent = _data(n, h, v, dtype, seed=n + v)
    chunks = tlp._chunks(n, h, v, dtype, None, None, training=True)
    fwd_rows, fwd_vc, bwd_rows, bwd_vc = chunks.fwd_rows, chunks.fwd_cols, chunks.dx_rows, chunks.dw_cols
    print(f"[{case}] default training chunks: {chunks}")
    print(f"[{case}] dx config unfused (M={n}): {select_forward(dtype, n, h).key}; "
          f"grad-hidden pass (M={min(bwd_rows, n)}): {select_forward(dtype, min(bwd_rows, n), h).key}; dW: {select_weight_grad(dtype).key}")

    # 1. forward
    logits = gk.forward(hidden, weight, None)
    _, lp_u, lse_u, _ = lk.forward(logits, temperature, targets=targets)
    _, _, _, ent_u = lk.forward(logits, temperature, entropy=True)
    lp_f, ent_f, lse_f = fused.forward(hidden, weight, targets, temperature, True, fwd_rows, fwd_vc)
    _line(case, "forward lp", lp_f, lp_u)
    _line(case, "forward lse", lse_f, lse_u)
    _line(case, "forward entropy", ent_f, ent_u)

    # 2. dlogits: unfused = autograd through the two public ops on the same logits
    lg = logits.clone().requires_grad_()
    lp = logprob.token_logprobs(lg, targets, temperature)
    en = logprob.entropy(lg, temperature)
    ((lp * g_lp).sum() + (en * g_ent).sum()).backward()
    dl_u = lg.grad
    d_two = lk.token_logprobs_backward(g_lp, logits, targets, lse_u, temperature) + lk.entropy_backward(
        g_ent, logits, lse_u, ent_u, temperature)
    _line(case, "dlogits: unfused kernels summed vs autograd", d_two, dl_u)
    parts = []
    for r0 in range(0, n, bwd_rows):
        r1 = min(n, r0 + bwd_rows)
        parts.append(fused._dlogits_(gk.forward(hidden[r0:r1], weight, None), 0, targets[r0:r1], lse_f[r0:r1],
                                     g_lp[r0:r1], ent_f[r0:r1], g_ent[r0:r1], temperature))
    dl_a = torch.cat(parts)
    _line(case, "dlogits fused grad-hidden pass (row chunks) vs unfused", dl_a, dl_u)
    cols = []
    for c0 in range(0, v, bwd_vc):
        cols.append(fused._dlogits_(gk.forward(hidden, weight[c0 : c0 + bwd_vc], None), c0, targets, lse_f, g_lp,
                                    ent_f, g_ent, temperature))
    _line(case, "dlogits fused grad-weight pass (vocab chunks) vs unfused", torch.cat(cols, 1), dl_u)
    on = _dlogits_launch(gk.forward(hidden, weight, None), 0, targets, lse_f, g_lp, ent_f, g_ent, temperature, True)
    _line(case, "dlogits, same kernel with fp fusion ON", on, dl_u)

    # 3. the GEMMs on identical dlogits, split and configured as each path does
    dx_u = gk.grad_input(dl_u, weight)
    dx_a = torch.cat([gk.grad_input(dl_u[r0 : r0 + bwd_rows], weight) for r0 in range(0, n, bwd_rows)])
    _line(case, f"grad_input same dlogits: M={n} vs M={bwd_rows} chunks", dx_a, dx_u)
    dw_u = gk.grad_weight(dl_u, hidden)
    dw_b = torch.cat([gk.grad_weight(dl_u[:, c0 : c0 + bwd_vc].contiguous(), hidden) for c0 in range(0, v, bwd_vc)])
    _line(case, f"grad_weight same dlogits: V={v} vs {bwd_vc}-col chunks", dw_b, dw_u)
    dx_fa = torch.cat([gk.grad_input(dl_a[r0 : r0 + bwd_rows], weight) for r0 in range(0, n, bwd_rows)])
    _line(case, "grad_input(fused grad-hidden pass dlogits) vs unfused dx", dx_fa, dx_u)

    # 4. full grads through the public ops
    def grads(fn):
        hh = hidden.clone().requires_grad_()
        ww = weight.clone().requires_grad_()
        a, b = fn(hh, ww)
        ((a * g_lp).sum() + (b * g_ent).sum()).backward()
        return hh.grad, ww.grad

    def unfused(hh, ww):
        z = gemm.linear(hh, ww)
        return logprob.token_logprobs(z, targets, temperature), logprob.entropy(z, temperature)

    gu = grads(unfused)
    gf = grads(lambda hh, ww: logprob.linear_token_logprobs(hh, ww, targets, temperature, True))
    _line(case, "full grad hidden (public op) vs unfused", gf[0], gu[0])
    _line(case, "full grad weight (public op) vs unfused", gf[1], gu[1])


def _time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def timing(T: int, H: int, V: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from rl_engine.backends.triton import logprob as tlp
    from rl_engine.backends.triton.gemm import kernels as gk
    from rl_engine.backends.triton.gemm.configs import TileConfig, select_forward, select_weight_grad
    from rl_engine.ops import gemm, logprob

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=g) * (3.0 / H**0.5)).to(torch.bfloat16)
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    up = torch.randn(T, device="cuda", generator=g)

    def fwd_bwd(fn):
        def run():
            hh = h.detach().requires_grad_()
            ww = w.detach().requires_grad_()
            lp, ent = fn(hh, ww)
            ((lp * up).sum() + (ent * up).sum()).backward()
            return hh.grad, ww.grad
        return run

    fused = fwd_bwd(lambda hh, ww: logprob.linear_token_logprobs(hh, ww, t, 1.0, True))

    def unfused(hh, ww):
        z = gemm.linear(hh, ww)
        return logprob.token_logprobs(z, t), logprob.entropy(z)

    def naive(hh, ww):
        ls = torch.log_softmax(F.linear(hh, ww).float(), -1)
        return ls.gather(1, t[:, None]).squeeze(1), -(ls.exp() * ls).sum(-1)

    key = f"T={T}"
    res = {"fused_fwd_bwd_ms": _time_ms(fused, 3)}
    torch.cuda.empty_cache()
    for name, fn in (("unfused_triton_fwd_bwd_ms", fwd_bwd(unfused)), ("naive_fwd_bwd_ms", fwd_bwd(naive))):
        try:
            res[name] = _time_ms(fn, 3)
        except torch.OutOfMemoryError as exc:
            res[name] = f"OOM: {exc}"
        torch.cuda.empty_cache()
    # extra peak of the fused forward + backward (gradients included, then subtracted)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fused()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = sum(x.numel() * x.element_size() for x in out)
    del out
    RESULTS["memory"][key] = {"extra_peak_bytes": peak, "grads_bytes": grads, "extra_minus_grads_MiB": (peak - grads) / 2**20}
    print(f"[{key}] times (ms): {res}; fused extra peak minus grads {(peak - grads) / 2**20:.1f} MiB", flush=True)
    RESULTS["timing"][key] = res

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fused()
        torch.cuda.synchronize()
    agg: dict[str, list] = defaultdict(lambda: [0.0, 0])
    from torch.autograd import DeviceType

    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            agg[e.name][0] += e.time_range.elapsed_us() / 1e3
            agg[e.name][1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
    print(f"[{key}] profiler, one fused forward+backward (kernel: total ms, count):")
    for name, (ms, cnt) in rows[:25]:
        print(f"    {ms:10.3f} ms  x{cnt:<5d} {name[:110]}")
    RESULTS["profile"][key] = [{"kernel": k, "total_ms": ms, "count": c} for k, (ms, c) in rows]

    # micro-timings of the fused backward's GEMMs
    chunks = tlp._chunks(T, H, V, torch.bfloat16, None, None, training=True)
    fwd_rows, fwd_vc, bwd_rows, bwd_vc = chunks.fwd_rows, chunks.fwd_cols, chunks.dx_rows, chunks.dw_cols
    rows_a = min(bwd_rows, T)
    dl = torch.randn(rows_a, V, device="cuda", generator=g).to(torch.bfloat16) * 1e-3
    flops = 2.0 * rows_a * V * H
    ref = None
    for cfg in (None, TileConfig(64, 128, 64, 4, 4), TileConfig(128, 128, 64, 8, 3), TileConfig(64, 256, 64, 8, 3),
                TileConfig(128, 256, 64, 8, 3)):
        label = (cfg or select_forward(torch.bfloat16, rows_a, H)).key + ("" if cfg else " (shipped)")
        try:
            ms = _time_ms(lambda cfg=cfg: gk.grad_input(dl, w, cfg))
            out = gk.grad_input(dl, w, cfg)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
            print(f"[{key}] grad_input {label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        same = None if ref is None else bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
        ref = out if ref is None else ref
        row = {"T": T, "gemm": f"grad-hidden pass grad_input M={rows_a} K={V} N={H}", "config": label, "ms": ms,
               "tflops": flops / ms / 1e9, "bits_equal_to_shipped": same}
        RESULTS["gemm"].append(row)
        print(f"[{key}] {row['gemm']} {label:<40s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s bits==shipped: {same}")
    tm = _time_ms(lambda: dl @ w)
    print(f"[{key}] torch (cuBLAS) dl @ W same shape {tm:8.3f} ms {flops / tm / 1e9:7.1f} TFLOP/s")
    dl = None
    dlb = torch.randn(T, bwd_vc, device="cuda", generator=g).to(torch.bfloat16) * 1e-3
    flops = 2.0 * T * bwd_vc * H
    ms = _time_ms(lambda: gk.grad_weight(dlb, h))
    print(f"[{key}] grad-weight pass grad_weight M={T} N={bwd_vc} K={H} {select_weight_grad(torch.bfloat16).key} "
          f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s; cuBLAS {_time_ms(lambda: dlb.t() @ h):8.3f} ms")
    RESULTS["gemm"].append({"T": T, "gemm": f"grad-weight pass grad_weight M={T} N={bwd_vc} K={H}", "ms": ms, "tflops": flops / ms / 1e9})
    dlb = None
    for m, n in ((rows_a, V), (T, bwd_vc), (fwd_rows, fwd_vc)):
        ms = _time_ms(lambda m=m, n=n: gk.forward(h[:m], w[:n], None))
        tf = 2.0 * m * n * H / ms / 1e9
        RESULTS["gemm"].append({"T": T, "gemm": f"logits forward M={m} N={n} K={H}", "ms": ms, "tflops": tf})
        print(f"[{key}] logits forward M={m} N={n} K={H} {select_forward(torch.bfloat16, m, n).key} {ms:8.3f} ms {tf:7.1f} TFLOP/s")
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for every line printed")
    p.add_argument("--no-profile", action="store_true", help="bits only (part 1)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("debug_linear_logprob_gpu: no CUDA device", file=sys.stderr)
        return 2
    ok = True
    for n, h, v, dtype, temp in ((130, 64, 5000, torch.float32, 1.0), (40, 64, 3005, torch.float32, 1.0),
                                 (300, 256, 151936, torch.float32, 1.0), (130, 64, 5000, torch.bfloat16, 1.0),
                                 (130, 64, 5000, torch.float32, 0.8)):
        try:
            stages(n, h, v, dtype, temp)
        except Exception as exc:  # noqa: BLE001 - report and continue with the next case
            ok = False
            print(f"[{n}x{h}x{v}] ERROR {type(exc).__name__}: {exc}", flush=True)
            RESULTS["stages"].append({"case": f"{n}x{h}x{v}", "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
    if not args.no_profile:
        for T in args.tokens:
            try:
                timing(T, 4096, 151936)
            except Exception as exc:  # noqa: BLE001
                ok = False
                print(f"[T={T}] ERROR {type(exc).__name__}: {exc}", flush=True)
                RESULTS["timing"][f"T={T}"] = {"error": f"{type(exc).__name__}: {exc}"}
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
