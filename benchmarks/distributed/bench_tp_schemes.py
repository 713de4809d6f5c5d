"""Cost of rl_engine's TP-invariant blocks against Megatron-core's native TP layers, in the same run.

Per TP size, shape, dtype and layer kind, on every rank of one ``torch.distributed`` world
(gloo on CPU; NCCL with ``--device cuda``), the slowest rank's wall time per call (forward and
backward) of:

* row-parallel (``o_proj``/``down_proj``: ``x`` ``[T, K/p]`` → ``[T, N]``): rl_engine's
  ``full_k``, ``exact_k``, ``k_tree`` and ``native`` schemes, and Megatron's
  ``tensor_parallel.RowParallelLinear``;
* column-parallel (``qkv``/``gate_up``: ``[T, K]`` → ``[T, N/p]``): rl_engine's
  ``column_parallel_linear`` and Megatron's ``ColumnParallelLinear``;
* vocabulary-parallel LM head + token log-probs: rl_engine's ``vocab_parallel_logprobs`` and
  Megatron's ``ColumnParallelLinear`` logits + ``vocab_parallel_cross_entropy``.

Every row records the bytes this rank sends per call (``comm_bytes_per_rank``: rl_engine's from
:func:`~rl_engine.distributed.transports.comm_log`, Megatron's from the bandwidth-optimal
formula of its collectives), the number of collectives, and ``bits_equal_tp1``: whether the
forward output is raw-bit equal to the single-process rl_engine op (True for the TP-invariant
schemes on the CPU, never claimed for Megatron's layers). docs/distributed.md turns the volumes
into a predicted NVLink cost.

Usage::

    python benchmarks/distributed/bench_tp_schemes.py --tp 2,4 --out artifacts/bench_tp_schemes_cpu.json
    python benchmarks/distributed/bench_tp_schemes.py --predict     # the NVLink cost model's table (no run)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

SHAPES = {
    # name: (T tokens, {layer: (K, N)})  Qwen3-0.6B widths: hidden 1024, q 2048, MLP 3072, vocab 151936
    "qwen3-0.6b": {"o_proj": (2048, 1024), "down_proj": (3072, 1024), "qkv_proj": (1024, 4096),
                   "gate_up_proj": (1024, 6144), "lm_head": (1024, 151936)},
    "tiny": {"o_proj": (256, 128), "down_proj": (512, 128), "qkv_proj": (128, 512), "gate_up_proj": (128, 512),
             "lm_head": (128, 8192)},
}
ROW, COLUMN, HEAD = ("o_proj", "down_proj"), ("qkv_proj", "gate_up_proj"), ("lm_head",)


def _megatron_config(tp: int, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=8, tensor_model_parallel_size=tp,
                             use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                             gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)


def _targets(T: int, N: int) -> torch.Tensor:
    return torch.randint(0, N, (T,), generator=torch.Generator().manual_seed(1))


def _calls(layer, K, N, T, dtype, group, dev):
    """``{implementation: (fn, forward_output_fn)}`` for one layer on this rank."""
    from megatron.core import tensor_parallel as mtp
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from rl_engine.distributed import tensor_parallel as tp
    from rl_engine.distributed.algorithms.vocab import vocab_partition

    p, r = group.size, group.rank
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, K, generator=g).to(dtype).to(dev)
    W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(dev)
    cfg = _megatron_config(p, dtype)
    out = {}

    def leaf(t):
        return t.detach().clone().requires_grad_(True)

    def fwd_bwd(f, *inputs):
        def run():
            ins = [leaf(t) for t in inputs]
            y = f(*ins)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(torch.ones_like(y))
            return y
        return run

    if layer in ROW:
        k = K // p
        x_r = x[:, r * k:(r + 1) * k].contiguous()
        for scheme in tp.ROW_SCHEMES:
            w = W[r * (N // p):(r + 1) * (N // p)] if scheme == "full_k" else W[:, r * k:(r + 1) * k]
            w = w.contiguous()
            out[f"rlk_row_{scheme}"] = fwd_bwd(lambda a, b, s=scheme: tp.row_parallel_linear(a, b, None, group, scheme=s), x_r, w)
        m = mtp.RowParallelLinear(K, N, config=cfg, init_method=lambda t: None, bias=False, input_is_parallel=True,
                                  skip_bias_add=True).to(dev)
        with torch.no_grad():
            m.weight.copy_(W[:, r * k:(r + 1) * k])
        out["megatron_row"] = fwd_bwd(lambda a: m(a)[0], x_r)
    elif layer in COLUMN:
        n = N // p
        w = W[r * n:(r + 1) * n].contiguous()
        out["rlk_column"] = fwd_bwd(lambda a, b: tp.column_parallel_linear(a, b, None, group), x, w)
        m = mtp.ColumnParallelLinear(K, N, config=cfg, init_method=lambda t: None, bias=False, gather_output=False).to(dev)
        with torch.no_grad():
            m.weight.copy_(w)
        out["megatron_column"] = fwd_bwd(lambda a: m(a)[0], x)
    else:
        lo, hi = vocab_partition(N, p)[r]
        blocks = [-(-(b - a) // 1024) for a, b in vocab_partition(N, p)]
        tgt = _targets(T, N).to(dev)
        out["rlk_vocab_logprobs"] = fwd_bwd(
            lambda a, b: tp.vocab_parallel_logprobs(a, b, tgt, group, start=lo, vocab_size=N, blocks=blocks),
            x, W[lo:hi].contiguous())
        n = N // p
        m = mtp.ColumnParallelLinear(K, N, config=cfg, init_method=lambda t: None, bias=False, gather_output=False).to(dev)
        with torch.no_grad():
            m.weight.copy_(W[r * n:(r + 1) * n])
        out["megatron_vocab_cross_entropy"] = fwd_bwd(
            lambda a: -vocab_parallel_cross_entropy(m(a)[0].float()[None], tgt[None])[0], x)
    return out, x, W


def _reference(layer, x, W, dtype, T, N):
    """The single-process rl_engine forward of the layer (what TP-invariant means here)."""
    from rl_engine.ops.gemm import linear
    from rl_engine.ops.logprob import linear_token_logprobs

    if layer in HEAD:
        return linear_token_logprobs(x.cpu(), W.cpu(), _targets(T, N))
    return linear(x.cpu(), W.cpu())


def _megatron_bytes(layer, impl, T, K, N, p, elt):
    """Bytes sent per rank per call (forward + backward) by Megatron's collectives, ring algorithms."""
    ar = lambda n: 2 * (p - 1) / p * n * elt  # noqa: E731
    if impl == "megatron_row":
        return ar(T * N), 1  # forward all-reduce of [T, N]; backward local
    if impl == "megatron_column":
        return ar(T * K), 1  # backward all-reduce of dx [T, K]
    # vocab CE: forward all-reduce max + sum-exp + target logit ([T] fp32 each), backward dx all-reduce
    return 3 * 2 * (p - 1) / p * T * 4 + ar(T * K), 4


def _rank(group, args):
    from megatron.core import parallel_state

    from benchmarks.common.harness import device_info, make_row, summarize, versions
    from rl_engine.distributed.transports import comm_log
    from rl_engine.utils.bits import same_bits

    dev = "cuda" if args.device == "cuda" else "cpu"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=group.size)
    rows = []
    try:
        for shape in args.shapes.split(","):
            for layer, (K, N) in SHAPES[shape].items():
                if args.layers and layer not in args.layers.split(","):
                    continue
                for dname in args.dtypes.split(","):
                    dtype = getattr(torch, dname)
                    T = args.tokens
                    fns, x, W = _calls(layer, K, N, T, dtype, group, dev)
                    ref = _reference(layer, x, W, dtype, T, N)
                    for impl, fn in fns.items():
                        with comm_log() as log:
                            y = fn()
                        if impl.startswith("rlk"):
                            sent, ncoll = sum(c.sent_bytes for c in log), len(log)
                        else:
                            sent, ncoll = _megatron_bytes(layer, impl, T, K, N, group.size, x.element_size())
                        y = y.detach().cpu()
                        if layer in COLUMN and impl.startswith("rlk"):
                            n = N // group.size
                            eq = bool(same_bits(y, ref[:, group.rank * n:(group.rank + 1) * n]))
                        elif impl.startswith("megatron"):
                            eq = False  # not claimed (Megatron's layers use their own GEMM and reductions)
                        else:
                            eq = bool(same_bits(y, ref))
                        for _ in range(args.warmup):
                            fn()
                        samples = []
                        for _ in range(args.repeats):
                            group.broadcast_object(None)  # barrier
                            if dev == "cuda":
                                torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            fn()
                            if dev == "cuda":
                                torch.cuda.synchronize()
                            ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=dev)
                            samples.append(float(group.all_reduce_max(ms).item()))  # the slowest rank
                        rows.append(make_row(
                            benchmark="tp_schemes", op=f"{layer} (fwd+bwd)", implementation=impl,
                            config={"model": shape, "layer": layer, "T": T, "K": K, "N": N, "dtype": dname,
                                    "tp": group.size, "backend": group.backend},
                            stats=summarize(samples), warmup=args.warmup, device=device_info(dev), versions=versions(),
                            baseline=None,
                            extra={"comm_bytes_per_rank": int(sent), "collectives": ncoll,
                                   "bits_equal_tp1": eq if group.rank == 0 else None}))
    finally:
        parallel_state.destroy_model_parallel()
    return rows if group.rank == 0 else None


#: The cost model of ``--predict``: one H200 NVLink link per direction, NCCL-level bandwidth.
NVLINK = {"bytes_per_s": 400e9, "latency_s": 10e-6, "bf16_flops": 590e12, "fp64_flops": 60e12}
QWEN3_8B = {"o_proj": (4096, 4096), "down_proj": (12288, 4096), "qkv_proj": (4096, 6144),
            "gate_up_proj": (4096, 24576)}


def predict(T: int = 4096, tps=(2, 4, 8), elt: int = 2) -> list[dict]:
    """Predicted per-layer time on H200 NVLink (bf16, Qwen3-8B widths), forward and backward:
    every GEMM at ``bf16_flops`` (float64 ones at ``fp64_flops``), every collective
    ``latency_s + sent_bytes / bytes_per_s`` with the bandwidth-optimal volumes of
    :mod:`rl_engine.distributed.transports`."""
    m = NVLINK
    ar = lambda n, p, e=elt: 2 * (p - 1) / p * n * e  # noqa: E731
    ag = lambda n, p, e=elt: (p - 1) / p * n * e  # noqa: E731
    rows = []
    for layer, (K, N) in QWEN3_8B.items():
        for p in tps:
            gemm = 2 * T * K * N / p / m["bf16_flops"]
            exact = 2 * T * K * N / p / m["fp64_flops"]  # one float64 GEMM of the integer slices (bf16)
            comm = lambda b, c: c * m["latency_s"] + b / m["bytes_per_s"]  # noqa: E731
            if layer in ("o_proj", "down_proj"):
                cases = {
                    "megatron / native": (gemm + comm(ar(T * N, p), 1), 3 * gemm, ar(T * N, p)),
                    "full_k": (gemm + comm(ag(T * K, p) + ag(T * N, p), 2),
                               2 * gemm + exact + comm(ag(T * K, p, 8), 2), ag(T * K, p) + ag(T * N, p)),
                    "exact_k": (exact + comm(ar(T * N, p, 8), 2), 3 * gemm, ar(T * N, p, 8)),
                    "k_tree": (gemm + comm(ar(T * N, p, 4), 2), 3 * gemm, ar(T * N, p, 4)),
                }
            else:
                cases = {
                    "megatron / native": (gemm, 2 * gemm + comm(ar(T * K, p), 1), 0),
                    "rl_engine column": (gemm, gemm + exact + comm(ar(T * K, p, 8), 2), 0),
                }
            for name, (fwd, bwd, fwd_bytes) in cases.items():
                rows.append({"layer": layer, "K": K, "N": N, "tp": p, "scheme": name, "forward_us": fwd * 1e6,
                             "backward_us": bwd * 1e6, "forward_sent_MB": fwd_bytes / 1e6})
    return rows


def main() -> None:
    from benchmarks.common.harness import machine_load, write_report
    from rl_engine.distributed.launch import spawn

    if "--predict" in sys.argv:
        print("| layer (K, N) | TP | scheme | forward µs | backward µs | forward MB sent per rank |")
        print("|---|---|---|---|---|---|")
        for r in predict():
            print(f"| {r['layer']} ({r['K']}, {r['N']}) | {r['tp']} | {r['scheme']} | {r['forward_us']:.0f} | "
                  f"{r['backward_us']:.0f} | {r['forward_sent_MB']:.1f} |")
        return

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shapes", default="tiny")
    ap.add_argument("--layers", default="", help="comma-separated subset of the shape's layers")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for p in [int(t) for t in args.tp.split(",")]:
        rows += spawn(_rank, p, args, backend="nccl" if args.device == "cuda" else "gloo")[0]
    write_report(rows, args.out, meta={"machine_load": machine_load(), "tp": args.tp, "tokens": args.tokens})
    for r in rows:
        c = r["config"]
        print(f"tp={c['tp']} {c['layer']:>12} {c['dtype']:<8} {r['implementation']:<28} p50 {r['p50']:8.3f} ms  "
              f"sent {r['comm_bytes_per_rank'] / 1e6:8.3f} MB in {r['collectives']:>2} collectives  "
              f"bits==tp1 {r['bits_equal_tp1']}")


if __name__ == "__main__":
    main()
