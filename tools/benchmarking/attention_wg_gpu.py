"""The Hopper warpgroup forward (``hopper_warpgroup.rlk_attn_fwd_wg``) against the Triton kernel: raw
bits and time.

For each case (packed causal sequences, GQA group, window, dtype) it runs ``launch.varlen_forward``
with the warpgroup kernel and with ``attention_tuning(wg_forward=False)`` (the Triton kernel) and
compares ``out``, ``lse`` and the fp32 output raw-bit (integer views; a negative control perturbs
one key and must move rows). Then it times, in CUDA graphs replayed round-robin
(``cuda_graphs_interleaved_ms``: drift over the run falls on every candidate alike), SDPA, the
Triton kernel and the warpgroup kernel in each configuration (``--stages``: the shipped
``AttentionTuning.wg_forward_rings``, or ring depths, tile rows and a register cap for every
launch), output-only and training forward, and writes JSON rows (``--out``). ``--baseline FILE``
adds another version of ``hopper_warpgroup.py`` (e.g. the previous commit's, ``git show
HEAD~1:rl_engine/backends/triton/attention/hopper_warpgroup.py > /tmp/hopper_warpgroup_prev.py``),
checked and timed under the shipped tuning in the same run (stage ``baseline``). A tool for
choosing ``AttentionTuning.wg_forward_rings`` and for a first look; the benchmark of record is
``benchmarks/operators/bench_attention_gpu.py`` (rows ``.no_wg``).

    python tools/benchmarking/attention_wg_gpu.py --out /tmp/wg.json
    python tools/benchmarking/attention_wg_gpu.py --out /tmp/wg.json --stages shipped \\
        --baseline /tmp/hopper_warpgroup_prev.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import cuda_graphs_interleaved_ms, device_info, summarize, versions  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _case(lens, hq, hkv, dtype, window, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn((T, h, 128), device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    return q, k, v, cu, window


_HOPPER = "rl_engine.backends.triton.attention.hopper_warpgroup"


@contextlib.contextmanager
def _kernel_from(module):
    """``launch.varlen_forward`` launches ``module``'s warpgroup kernel inside the block (it imports
    ``hopper_warpgroup`` at each call): the package attribute and ``sys.modules`` entry are swapped
    and restored in ``finally``."""
    from rl_engine.backends.triton import attention
    from rl_engine.backends.triton.attention import hopper_warpgroup

    saved = hopper_warpgroup, sys.modules[_HOPPER]
    attention.hopper_warpgroup = sys.modules[_HOPPER] = module
    try:
        yield
    finally:
        attention.hopper_warpgroup, sys.modules[_HOPPER] = saved


def _load_baseline(path: Path):
    """``path`` (a version of ``hopper_warpgroup.py``) imported as its own module: its kernels
    compile apart."""
    spec = importlib.util.spec_from_file_location("rlk_hopper_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variant(var):
    """The warpgroup forward's configuration for a block (restored after): ``None`` keeps the
    shipped ``AttentionTuning.wg_forward_rings``; ``(K, V, rows, regs)`` sets every launch to K key
    and V value ring slots, ``rows``-row tiles and the register cap ``regs`` (``None``: the
    compiler's choice); a module (``--baseline``) launches that version of the kernel."""
    from rl_engine.backends.triton.attention.tuning import attention_tuning

    if var is None:
        return contextlib.nullcontext()
    if not isinstance(var, tuple):
        return _kernel_from(var)
    ring = (var[0], var[1], var[3])
    return attention_tuning(wg_forward_rings=(ring, ring), wg_forward_block_m=var[2])


def _tag(var) -> str:
    if var is None:
        return "shipped"
    if not isinstance(var, tuple):
        return "baseline"
    return "k{}v{}@{}".format(*var[:3]) + (f"r{var[3]}" if var[3] else "")


def _parse_variant(text: str):
    """``shipped``, ``KxVxROWS`` or ``KxVxROWSrREGS`` -> ``None`` or ``(K, V, ROWS, REGS or None)``."""
    if text == "shipped":
        return None
    body, _, regs = text.partition("r")
    ks_, vs_, rows = (int(x) for x in body.split("x"))
    return ks_, vs_, rows, int(regs) if regs else None


def check_bits(cases, variants) -> list[dict]:
    out = []
    for var in variants:
        with _variant(var):
            out += _check_bits(cases, _tag(var))
    return out


def _check_bits(cases, tag) -> list[dict]:
    from rl_engine.backends.triton.attention import eligibility, launch
    from rl_engine.backends.triton.attention.tuning import attention_tuning

    rows = []
    for name, (q, k, v, cu, window) in cases:
        name = f"{name} {tag}"
        assert eligibility.wg_eligible(q, k, v, None), name
        a = launch.varlen_forward(q, k, v, cu, 128**-0.5, window)
        with attention_tuning(wg_forward=False):
            b = launch.varlen_forward(q, k, v, cu, 128**-0.5, window)
        a_nb = launch.varlen_forward(q, k, v, cu, 128**-0.5, window, for_backward=False)[0]
        diff = [int((_bits(x) != _bits(y)).sum()) for x, y in zip(a, b)]
        diff.append(int((_bits(a_nb) != _bits(b[0])).sum()))
        # negative control: a perturbed key moves some rows
        k2 = k.clone()
        k2[k.shape[0] // 2, 0, 0] += 1.0
        c = launch.varlen_forward(q, k2, v, cu, 128**-0.5, window)[0]
        moved = int((_bits(c) != _bits(a[0])).sum())
        ok = all(d == 0 for d in diff) and moved > 0 and bool(torch.isfinite(a[0].float()).all())
        rows.append({"case": name, "mismatched": diff, "control_moved": moved, "ok": ok})
        print(f"bits {name:40s} mismatched out/lse/out32/no-grad {diff} control moved {moved} "
              f"-> {'OK' if ok else 'FAIL'}",
              flush=True)
    return rows


def timing(stages, repeats: int) -> list[dict]:
    from rl_engine.backends.triton.attention import launch
    from rl_engine.backends.triton.attention.tuning import attention_tuning

    dev, ver = device_info("cuda"), versions()
    out = []
    for B, S in ((32, 512), (4, 4096)):
        q, k, v, cu, _ = _case([S] * B, 32, 8, torch.bfloat16, None, B * S)
        qs, ks, vs = (t.view(B, S, -1, 128).transpose(1, 2).contiguous() for t in (q, k, v))
        flop = 4 * B * 32 * 128 * S * (S + 1) / 2
        impls = {"torch.sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)}
        for fb in (False, True):
            tag = "train_forward" if fb else "out"

            def triton_fwd(fb=fb):
                with attention_tuning(wg_forward=False):
                    return launch.varlen_forward(q, k, v, cu, 128**-0.5, None, max_seqlen=S, for_backward=fb)

            impls[f"triton.{tag}"] = triton_fwd
            for var in stages:
                def wg(fb=fb, var=var):
                    with _variant(var):
                        return launch.varlen_forward(q, k, v, cu, 128**-0.5, None, max_seqlen=S, for_backward=fb)

                impls[f"wg.{_tag(var)}.{tag}"] = wg
        res = {n: summarize(v) for n, v in cuda_graphs_interleaved_ms(impls, calls=5, repeats=repeats,
                                                                         warmup=3).items()}
        base = res["torch.sdpa"].median
        for n, st in res.items():
            row = {"case": f"prefill {B}x{S}", "implementation": n, "median_us": round(st.median * 1e3, 1),
                   "throughput_ratio": round(base / st.median, 4), "tflops": round(flop / (st.median * 1e-3) / 1e12, 1),
                   "device": dev, "versions": ver}
            out.append(row)
            print(f"time {row['case']:14s} {n:34s} {row['median_us']:9.1f} us  {row['throughput_ratio']:.3f} of SDPA "
                  f"({row['tflops']} TFLOP/s)", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="shipped,2x2x64",
                    help="configurations to check bits at and to time: 'shipped' (AttentionTuning.wg_forward_rings) or "
                         "KxVxROWS[rREGS] for every launch (e.g. 2x1x64r160: 2 key slots, 1 value slot, "
                         "64-row tiles, maxnreg 160)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another version of hopper_warpgroup.py, checked and timed beside the stages")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    if args.baseline is not None and not args.baseline.is_file():
        ap.error(f"--baseline: no such file {str(args.baseline)!r}")
    if not torch.cuda.is_available():
        print("attention_wg_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        stages = [_parse_variant(s) for s in args.stages.split(",")]
    except ValueError:
        ap.error(f"--stages: 'shipped' or KxVxROWS[rREGS] items, got {args.stages!r}")
    for ks_, vs_, rows, regs in (v for v in stages if v is not None):
        if rows not in (64, 128) or ks_ < 1 or vs_ < 1 or (regs is not None and not 24 <= regs <= 256):
            ap.error(f"--stages: K and V depths >= 1, 64 or 128 tile rows, a register cap in 24..256; got "
                     f"{ks_}x{vs_}x{rows}r{regs}")
    if args.baseline is not None:
        stages.append(_load_baseline(args.baseline))
    cases = [
        ("32x512 G4 bf16", _case([512] * 32, 32, 8, torch.bfloat16, None, 1)),
        ("4x4096 G4 bf16", _case([4096] * 4, 32, 8, torch.bfloat16, None, 2)),
        ("ragged G4 bf16", _case([1, 63, 64, 65, 1023, 1025, 2100, 3000], 32, 8, torch.bfloat16, None, 3)),
        ("ragged G1 fp16", _case([77, 1500, 2049], 8, 8, torch.float16, None, 4)),
        ("ragged G8 bf16 window 700", _case([900, 2500, 31], 64, 8, torch.bfloat16, 700, 5)),
        ("ragged G2 bf16 window 64", _case([300, 1100], 16, 8, torch.bfloat16, 64, 6)),
    ]
    bits = check_bits(cases, list(dict.fromkeys(stages)))
    times = timing(stages, args.repeats)
    args.out.write_text(json.dumps({"bits": bits, "timing": times}, indent=1))
    return 0 if all(r["ok"] for r in bits) else 1


if __name__ == "__main__":
    raise SystemExit(main())
