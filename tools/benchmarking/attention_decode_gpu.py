"""Decode-step launch configurations on the GPU: raw bits and time, side by side with SDPA.

For each case (batch ``B`` × context ``ctx``, one query token per sequence, Qwen3-8B heads: 32
query / 8 kv heads, D = 128, bf16) over a contiguous cache and over 16-token pages in shuffled
order, it runs ``launch.cached_forward(decode_only=True)`` with the shipped selection, with
every ``--configs`` key (``AttnConfig.key`` spelling: ``m16_w4_s3_v4_u4`` = 16-row tile, 4 warps,
3 stages, 4 value slices, 4 blocks a step) and with the Hopper split kernels forced
(``--wg-slots``, ``--wgt``), checks each output raw-bit against the Triton kernels' (both Hopper
decode kernels off; integer views; negative control: a perturbed visible key must move the
output), then
times them all with SDPA (``F.scaled_dot_product_attention(..., enable_gqa=True)``) in CUDA
graphs replayed round-robin (``cuda_graphs_interleaved_ms``). A tool for choosing the decode
tables and rules (the ``few_decode`` table, ``value_slices``, ``pair_blocks``, ``quad_blocks``); the
benchmark of record is ``benchmarks/operators/bench_attention_gpu.py``.

    python tools/benchmarking/attention_decode_gpu.py --out /tmp/decode.json \\
        --cases 1x512,1x4096,1x32768 --configs m16_w4_s3_v4_u1,m16_w4_s3_v4_u4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import cuda_graphs_interleaved_ms, device_info, summarize, versions  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
_KEY = re.compile(r"m(\d+)_w(\d+)_s(\d+)(?:_v(\d+))?(?:_u(\d+))?$")


def parse_config(key: str):
    """``AttnConfig`` from its ``key`` spelling (``m16_w4_s3``, ``m16_w4_s3_v4_u4``)."""
    from rl_engine.backends.triton.attention.configs import AttnConfig

    m = _KEY.match(key)
    if not m:
        raise SystemExit(f"--configs: {key!r} is not a config key like m16_w4_s3_v4_u4")
    bm, w, s, v, u = m.groups()
    return AttnConfig(int(bm), int(w), int(s), v_slices=int(v or 1), unroll=int(u or 1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def case(B: int, ctx: int):
    """The step's tensors: query, contiguous cache + rows, paged cache + page table, SDPA views."""
    g = torch.Generator(device="cuda").manual_seed(B * 7 + ctx)
    kc, vc = (torch.randn((B * ctx, HKV, D), device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn((B, HQ, D), device="cuda", generator=g).to(torch.bfloat16)
    rows = (torch.arange(B, device="cuda", dtype=torch.int64) * ctx)[:, None].contiguous()
    pages = torch.randperm(B * ctx // PAGE, generator=torch.Generator().manual_seed(0)).cuda()
    table = (pages.view(B, ctx // PAGE) * PAGE).contiguous()
    pos = torch.arange(ctx, device="cuda")
    at = (table[:, pos // PAGE] + pos % PAGE).reshape(-1)
    kp, vp = torch.empty_like(kc), torch.empty_like(vc)
    kp[at], vp[at] = kc, vc
    sdpa = (q.view(B, 1, HQ, D).transpose(1, 2).contiguous(),
            *(t.view(B, ctx, HKV, D).transpose(1, 2).contiguous() for t in (kc, vc)))
    return q, (kc, vc, rows, ctx), (kp, vp, table, PAGE), sdpa


def kernel_times(fn, calls: int) -> dict[str, float]:
    """Device time per call of each kernel ``fn`` launches (torch profiler, ``calls`` calls after a
    warm-up), in µs."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            out[e.key[:40]] = round(e.device_time_total / calls, 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x512,1x4096,1x32768", help="BxCTX,... (contexts multiples of 16)")
    ap.add_argument("--configs", default="", help="config keys, comma-separated (both caches)")
    ap.add_argument("--no-wg", action="store_true", help="also the steps with attention_tuning(wg_decode=False, "
                    "wgt_decode=False) (the splits on the Triton kernels instead of the Hopper ones; the reference bits)")
    ap.add_argument("--wg-slots", default="", help="ring slots of hopper_warpgroup.rlk_attn_split_wg to time the paged "
                    "steps with (AttentionTuning.wg_decode_slots; every step size: wg_decode_band), comma-separated; a "
                    "suffix caps the value slices: 3v1 one slice, 3v4 up to four")
    ap.add_argument("--wgt", default="", help="the steps' splits on the transposed kernel "
                    "(hopper_transposed_decode.rlk_attn_split_wgt, forced at every size with wgt_decode_bands, both "
                    "caches): ring slots and value slices, "
                    "comma-separated: 2v2 = 2 slots, 2 value slices (four blocks a step by the rule); 2v2q1 = "
                    "four blocks a step with 1 four-block slot; 2v2q0 = one block a step")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", default="", help="implementations (names as printed) to run under the torch "
                    "profiler after timing: per-kernel device time per call")
    args = ap.parse_args(argv)
    from rl_engine.backends.triton.attention import launch
    from rl_engine.backends.triton.attention.tuning import attention_tuning

    configs = [parse_config(k) for k in args.configs.split(",") if k]
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c]
    rows, failures = [], []
    for B, ctx in cases:
        q, contiguous, paged, sdpa = case(B, ctx)
        q_seq = torch.arange(B, device="cuda")
        q_pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int64)
        impls = {"torch.sdpa": lambda s=sdpa: F.scaled_dot_product_attention(*s, enable_gqa=True)}
        for cache_name, (kk, vv, pr, psz) in (("contiguous", contiguous), ("paged16", paged)):
            def step(cfg=None, kk=kk, vv=vv, pr=pr, psz=psz):
                return launch.cached_forward(q, kk, vv, pr, psz, q_seq, q_pos, D**-0.5, None, config=cfg,
                                             path="decode" if cfg is not None else None, decode_only=True)

            with attention_tuning(wg_decode=False, wgt_decode=False):
                want = step()  # the Triton kernels: every other variant is checked against these bits
            if not torch.equal(_bits(step()), _bits(want)):
                failures.append(f"{B}x{ctx} {cache_name}: the shipped step's bits differ from the Triton kernels'")
            k2 = kk.clone()
            k2[pr[0, 0] + 3, 0, 5] += 1.0  # position 3 of sequence 0 (page 0 on either cache), kv head 0
            moved = launch.cached_forward(q, k2, vv, pr, psz, q_seq, q_pos, D**-0.5, None, decode_only=True)
            control = bool(torch.equal(_bits(moved), _bits(want)))
            if control:
                failures.append(f"{B}x{ctx} {cache_name}: negative control (a perturbed key) left the output unchanged")
            impls[f"{cache_name}.shipped"] = step

            def register(name, config, fn, case=f"{B}x{ctx}", cache_name=cache_name, want=want):
                """Time ``fn`` as ``name`` after checking its rows raw-bit against the Triton kernels'."""
                equal = bool(torch.equal(_bits(fn()), _bits(want)))
                if not equal:
                    failures.append(f"{case} {cache_name}: {config}: bits differ from the Triton kernels'")
                impls[name] = fn
                rows.append({"case": case, "cache": cache_name, "config": config, "bits_equal": equal})

            if args.no_wg:
                # the same step with the splits on the Triton kernel
                def plain(step=step):
                    with attention_tuning(wg_decode=False, wgt_decode=False):
                        return step()

                register(f"{cache_name}.no_wg", "no_wg", plain)
            for spec in (x for x in args.wg_slots.split(",") if x and cache_name == "paged16"):
                # the step's splits on the warpgroup kernel whatever its size (wg_decode_band) with
                # ``slots`` ring slots; ``3v1``: one value slice (auto_value_slices=False), ``3v4``: up
                # to four (max_paged_v_slices)
                slots, vmax = (int(x) for x in (spec.split("v") + ["0"])[:2])

                def ring(step=step, slots=slots, vmax=vmax):
                    cap = {"max_paged_v_slices": vmax} if vmax else {}
                    with attention_tuning(wg_decode_slots=slots, auto_value_slices=vmax != 1,
                                          wg_decode_band=(0.0, float("inf")), **cap):
                        return step()

                register(f"{cache_name}.wg_s{spec}", f"wg_s{spec}", ring)
            for spec in (x for x in args.wgt.split(",") if x):
                m = re.match(r"(\d+)v(\d+)(?:q(\d+))?$", spec)
                if not m:
                    raise SystemExit(f"--wgt: {spec!r} is not like 2v2, 2v2q2 or 2v2q0")
                slots, vsl = int(m.group(1)), int(m.group(2))
                qslots = None if m.group(3) is None else int(m.group(3))

                def transposed(step=step, slots=slots, vsl=vsl, qslots=qslots):
                    quad = ({"wgt_quad_programs": float("inf") if qslots else 0.0} if qslots is not None else {})
                    quad_slots = {"wgt_quad_slots": qslots} if qslots else {}
                    with attention_tuning(wgt_decode_slots=slots, **quad_slots, wgt_value_slices=vsl, wg_decode=False,
                                          wgt_decode_bands=((0.0, float("inf")),) * 2, **quad):
                        return step()

                register(f"{cache_name}.wgt_s{spec}", f"wgt_s{spec}", transposed)
            for cfg in configs:
                register(f"{cache_name}@{cfg.key}", cfg.key, lambda c=cfg, f=step: f(c))
            print(f"{B}x{ctx} {cache_name}: {len(configs)} configs checked, control moved={not control}", flush=True)
        samples = cuda_graphs_interleaved_ms(impls, calls=args.calls, repeats=args.repeats, warmup=2)
        base = summarize(samples["torch.sdpa"]).median
        for name, s in samples.items():
            st = summarize(s)
            rows.append({"case": f"{B}x{ctx}", "impl": name, "unit": "ms", "p20": st.p20, "p50": st.median, "p80": st.p80,
                         "samples": len(s), "throughput_ratio": round(base / st.median, 4)})
            print(f"  {B}x{ctx} {name:40s} {st.median * 1e3:8.2f} us  {base / st.median:.3f} of SDPA", flush=True)
        for name in (n for n in args.profile.split(",") if n in impls):
            per_call = kernel_times(impls[name], args.calls)
            rows.append({"case": f"{B}x{ctx}", "impl": name, "profile_us_per_call": per_call})
            print(f"  {B}x{ctx} {name} kernels (us/call): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in per_call.items()), flush=True)
    Path(args.out).write_text(json.dumps({"device": device_info("cuda"), "versions": versions(), "rows": rows,
                                          "failures": failures}, indent=1))
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
