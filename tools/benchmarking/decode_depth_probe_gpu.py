"""Decode steps of few (sequence, kv head) pairs: where the time goes, and what pipeline depth does.

An exploration (session 12), not a benchmark of record: for batch 1 / 4 at 512 / 4096 / 32768 keys
(Qwen3-8B heads, bf16, contiguous cache) it times, in CUDA graphs beside SDPA,

* the one-pass step (``kernels.score_pass(False)``) and the score pass (``rlk_attn_qk`` first) with
  the few-programs tile's pipeline depth set to 2 .. 8 stages (``FEW_DECODE_CONFIGS`` patched for
  the run; the stage count does not enter the bits), the score pass also with one key block per
  ``rlk_attn_qk`` program;
* per-kernel device time (torch profiler, 20 calls) of the default one-pass and score-pass steps.

    python tools/benchmarking/decode_depth_probe_gpu.py --out /tmp/depth.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import cuda_graph_ms, device_info, summarize, versions  # noqa: E402

HQ, HKV, D = 32, 8, 128


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Mean device µs per call of each CUDA kernel ``fn`` launches (torch profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name.split("(")[0][:60]] += e.device_time_total / calls
    return {k: round(v, 2) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    from rl_engine.backends.shared.triton.attention import kernels as K

    rows = []
    dt = torch.bfloat16
    for B, ctx in ((1, 512), (1, 4096), (1, 32768), (4, 4096)):
        g = torch.Generator(device="cuda").manual_seed(B + ctx)
        kc = torch.randn((B * ctx, HKV, D), device="cuda", generator=g).to(dt)
        vc = torch.randn((B * ctx, HKV, D), device="cuda", generator=g).to(dt)
        q = torch.randn((B, HQ, D), device="cuda", generator=g).to(dt)
        q_seq = torch.arange(B, device="cuda")
        q_pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int64)
        rows_ = (torch.arange(B, device="cuda", dtype=torch.int64) * ctx)[:, None].contiguous()
        ks, vs = (t.view(B, ctx, HKV, D).transpose(1, 2).contiguous() for t in (kc, vc))
        qs = q.view(B, 1, HQ, D).transpose(1, 2).contiguous()

        def step(scores):
            return K.cached_forward(q, kc, vc, rows_, ctx, q_seq, q_pos, D**-0.5, None, decode_only=True, scores=scores)

        ref = step(False)
        cases = {"sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)}
        for stages in (2, 3, 4, 6, 8):
            cfg = K.AttnConfig(16, 4, stages)
            for name, scores, qb in (("one_pass", False, None), ("score_pass", True, None), ("score_pass_qb1", True, 1)):
                def fn(cfg=cfg, scores=scores, qb=qb):
                    patches = [mock.patch.dict(K.FEW_DECODE_CONFIGS, {(dt, D): cfg})]
                    if qb is not None:
                        patches.append(mock.patch.object(K, "score_group_blocks", lambda *a: qb))
                    with patches[0]:
                        if len(patches) > 1:
                            with patches[1]:
                                return step(scores)
                        return step(scores)
                cases[f"{name}@s{stages}"] = fn
        for name, fn in cases.items():
            try:
                out = fn()
                same = name == "sdpa" or torch.equal(out.view(torch.int16), ref.view(torch.int16))
                st = summarize(cuda_graph_ms(fn, calls=20, repeats=args.repeats, warmup=3))
                rows.append({"B": B, "context": ctx, "case": name, "p50_us": round(st.median * 1e3, 2),
                             "p20_us": round(st.p20 * 1e3, 2), "p80_us": round(st.p80 * 1e3, 2), "bits_equal": same})
                print(f"B={B} ctx={ctx:6d} {name:22s} p50 {st.median * 1e3:8.2f} us  bits_equal={same}", flush=True)
            except Exception as e:  # a depth that does not fit shared memory: recorded, not fatal
                rows.append({"B": B, "context": ctx, "case": name, "error": repr(e)[:300]})
                print(f"B={B} ctx={ctx:6d} {name:22s} ERROR {repr(e)[:120]}", flush=True)
        for name, scores in (("one_pass", False), ("score_pass", True)):
            kt = kernel_times(lambda scores=scores: step(scores))
            rows.append({"B": B, "context": ctx, "case": f"{name}.kernels", "kernels_us": kt})
            print(f"B={B} ctx={ctx:6d} {name} kernels {kt}", flush=True)
    args.out.write_text(json.dumps({"tool": "decode_depth_probe_gpu", "device": device_info("cuda"),
                                    "versions": versions(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
