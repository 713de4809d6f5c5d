"""Where the device time of one attention launcher call goes: every kernel it launches, on the GPU.

Each shipped launcher (``rl_engine.backends.triton.attention.launch``) runs ``--iters``
times under ``torch.profiler`` (CUDA activity) after warm-up; the kernels' device time is summed
per name and divided by the iterations, next to the wall time of one CUDA-graph replay of the
same call (``benchmarks.common.harness.cuda_graph_ms``). So a launcher's time splits into its
main kernel, the small kernels that build its tables (torch ops or ``rlk_attn_tiles``) and the
gaps between launches (graph time minus the kernels' sum). Qwen3-8B heads, bf16.

    python3 tools/benchmarking/attention_breakdown_gpu.py --out /tmp/breakdown.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import cuda_graph_ms, device_info, summarize, versions  # noqa: E402

HQ, HKV, D = 32, 8, 128


def cases():
    from rl_engine.backends.triton.attention import launch as L
    from rl_engine.backends.triton.attention.configs import AttnConfig

    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)

    out = {}
    B, S = 32, 512
    T = B * S
    q, k, v = randn(T, HQ, D), randn(T, HKV, D), randn(T, HKV, D)
    cu = torch.arange(0, T + 1, S, device="cuda", dtype=torch.int32)
    q_seq = torch.arange(B, device="cuda").repeat_interleave(S)
    q_pos = torch.arange(S, device="cuda").repeat(B)
    rows = (torch.arange(B, device="cuda") * S)[:, None].contiguous()
    out["prefill 32x512 varlen (out only)"] = lambda: L.varlen_forward(q, k, v, cu, D**-0.5, None, max_seqlen=S,
                                                                         for_backward=False)
    out["prefill 32x512 varlen (train: out+f32+lse)"] = lambda: L.varlen_forward(q, k, v, cu, D**-0.5, None, max_seqlen=S)
    out["prefill 32x512 cached (rollout)"] = lambda: L.cached_forward(q, k, v, rows, S, q_seq, q_pos, D**-0.5, None,
                                                                       path="prefill")
    # the rollout prefill over a paged cache of 16-token pages (shuffled), shipped and two smaller tiles
    ps = 16
    pages = torch.randperm(T // ps, generator=torch.Generator().manual_seed(0)).cuda()
    ptab = (pages.view(B, S // ps) * ps).contiguous()
    prow = (ptab[:, torch.arange(S, device="cuda") // ps] + torch.arange(S, device="cuda") % ps).reshape(-1)
    kp, vp = torch.empty_like(k), torch.empty_like(v)
    kp[prow], vp[prow] = k, v
    for cfg in (None, AttnConfig(128, 4, 2), AttnConfig(64, 4, 2)):
        tag = "shipped" if cfg is None else cfg.key
        out[f"prefill 32x512 cached paged16 ({tag})"] = (lambda cfg=cfg: L.cached_forward(
            q, kp, vp, ptab, ps, q_seq, q_pos, D**-0.5, None, path="prefill", config=cfg))
    # the same at 4 x 4096 (the long-prompt shape of the prefill target)
    B4, S4 = 4, 4096
    q4 = randn(B4 * S4, HQ, D)
    qs4 = torch.arange(B4, device="cuda").repeat_interleave(S4)
    qp4 = torch.arange(S4, device="cuda").repeat(B4)
    pages4 = torch.randperm(B4 * S4 // ps, generator=torch.Generator().manual_seed(1)).cuda()
    ptab4 = (pages4.view(B4, S4 // ps) * ps).contiguous()
    prow4 = (ptab4[:, torch.arange(S4, device="cuda") // ps] + torch.arange(S4, device="cuda") % ps).reshape(-1)
    kp4, vp4 = randn(B4 * S4, HKV, D), randn(B4 * S4, HKV, D)
    kp4[prow4], vp4[prow4] = kp4.clone(), vp4.clone()
    for cfg in (None, AttnConfig(128, 4, 2)):
        tag = "shipped" if cfg is None else cfg.key
        out[f"prefill 4x4096 cached paged16 ({tag})"] = (lambda cfg=cfg: L.cached_forward(
            q4, kp4, vp4, ptab4, ps, qs4, qp4, D**-0.5, None, path="prefill", config=cfg))
    for b, ctx in ((1, 512), (1, 4096), (1, 32768), (64, 512), (64, 4096)):
        kc, vc, qd = randn(b * ctx, HKV, D), randn(b * ctx, HKV, D), randn(b, HQ, D)
        qs = torch.arange(b, device="cuda")
        qp = torch.full((b,), ctx - 1, device="cuda", dtype=torch.int64)
        crow = (torch.arange(b, device="cuda", dtype=torch.int64) * ctx)[:, None].contiguous()
        for one in (True, False):  # decode_only (no tile table: what the ops layer passes), tile table
            tag = "" if one else " (tile table)"
            out[f"decode B={b} ctx={ctx}{tag}"] = (
                lambda kc=kc, vc=vc, qd=qd, qs=qs, qp=qp, crow=crow, ctx=ctx, one=one:
                L.cached_forward(qd, kc, vc, crow, ctx, qs, qp, D**-0.5, None, decode_only=one))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for name, fn in cases().items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = summarize(cuda_graph_ms(fn, calls=10, repeats=7, warmup=2)).median * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                per[e.name] += e.time_range.elapsed_us() / args.iters  # µs
        kernels = sorted(({"kernel": n, "us": round(t, 2)} for n, t in per.items()), key=lambda r: -r["us"])
        total = sum(r["us"] for r in kernels)
        row = {"case": name, "graph_us": round(graph, 2), "kernels_sum_us": round(total, 2),
               "gaps_us": round(graph - total, 2), "kernels": kernels}
        rows.append(row)
        print(f"{name:45s} graph {graph:9.1f} us  kernels {total:9.1f} us  gaps {graph - total:7.1f} us", flush=True)
        for r in kernels[:8]:
            print(f"    {r['us']:9.2f} us  {r['kernel'][:90]}", flush=True)
    args.out.write_text(json.dumps({"device": device_info(), "versions": versions(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
