"""Cost of rl_engine's TP-invariant row-parallel linear (vLLM plugin) vs vLLM's scheme.

vLLM's ``RowParallelLinear`` (o_proj, down_proj) shards ``W [N, K]`` along K and all-reduces
the partial products: the K reduction order — hence the bits — depends on the TP size. The
rl_engine plugin (``RlkRowParallelLinear``) instead gives each rank ``N/tp`` output rows of
``W`` with the full K and runs::

    x = all_gather(x_r, dim=-1);  y_r = gemm.linear(x, W_r);  y = all_gather(y_r, dim=-1)

Same FLOPs per rank; two all-gathers (``T·K`` + ``T·N`` elements) instead of one all-reduce
(``T·N``). This script times both schemes with the **same** GEMM (``rl_engine.ops.gemm.linear``)
so only the parallel scheme differs, plus the native ``F.linear`` K-shard + all-reduce (what
vLLM runs), on every rank of a ``torch.distributed`` group, and checks the bits of each result
against the single-device ``gemm.linear(x, W)`` (``bits_equal_tp1``: True only for ours).

Usage (one process per rank; gloo on CPU, NCCL on CUDA)::

    python benchmarks/integrations/bench_tp_row_parallel.py --nproc 2 --out artifacts/bench_tp_row_parallel_cpu.json
    python benchmarks/integrations/bench_tp_row_parallel.py --nproc 2 --device cuda --shapes qwen3-8b \\
        --out bench_tp_row_parallel_cuda.json          # a 2-GPU host

Each (shape, T, dtype, scheme) is one JSON row from rank 0 (p20/p50/p80 in ms over the
slowest rank per repetition), with ``ratio_vs_baseline`` against vLLM's scheme with the same
GEMM.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

SHAPES = {
    # name: {layer: (K, N)}  (o_proj: K = heads·head_dim, N = hidden; down_proj: K = intermediate)
    "qwen3-0.6b": {"o_proj": (2048, 1024), "down_proj": (3072, 1024)},
    "qwen3-8b": {"o_proj": (4096, 4096), "down_proj": (12288, 4096)},
}


def _schemes(x_r, W, W_kshard, W_nshard, tp, rank):
    from rl_engine.ops.gemm import linear

    def vllm_native():
        y = F.linear(x_r, W_kshard)
        dist.all_reduce(y)
        return y

    def vllm_scheme_rlk_gemm():
        y = linear(x_r, W_kshard)
        dist.all_reduce(y)
        return y

    def gather_last(t):  # all_gather along the last dim = concatenation in rank order
        buf = t.new_empty((tp * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(buf, t.contiguous())
        return buf.view(tp, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], tp * t.shape[-1])

    def rlk_full_k_gather():
        return gather_last(linear(gather_last(x_r), W_nshard))

    return {"vllm_kshard_allreduce_native": vllm_native, "vllm_kshard_allreduce": vllm_scheme_rlk_gemm,
            "rlk_full_k_allgather": rlk_full_k_gather}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def worker(rank: int, tp: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = "cuda" if args.device == "cuda" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=rank, world_size=tp)
    torch.set_num_threads(1) if dev == "cpu" else None
    from benchmarks.common.harness import device_info, machine_load, make_row, summarize, versions, write_report
    from rl_engine.ops.gemm import linear
    from rl_engine.utils.bits import bits_equal

    rows = []
    for shape in args.shapes.split(","):
        for layer, (K, N) in SHAPES[shape].items():
            for T in [int(t) for t in args.tokens.split(",")]:
                for dname in args.dtypes.split(","):
                    dt = getattr(torch, dname)
                    g = torch.Generator().manual_seed(0)
                    x = torch.randn(T, K, generator=g).to(dt).to(dev)
                    W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt).to(dev)
                    x_r = x[:, rank * K // tp:(rank + 1) * K // tp].contiguous()
                    W_k = W[:, rank * K // tp:(rank + 1) * K // tp].contiguous()
                    W_n = W[rank * N // tp:(rank + 1) * N // tp].contiguous()
                    ref = linear(x, W)
                    fns = _schemes(x_r, W, W_k, W_n, tp, rank)
                    res = {}
                    for name, fn in fns.items():
                        out = fn()
                        eq = bits_equal(out.cpu(), ref.cpu())
                        for _ in range(args.warmup):
                            fn()
                        samples = []
                        for _ in range(args.repeats):
                            dist.barrier()
                            _sync(dev)
                            t0 = time.perf_counter()
                            fn()
                            _sync(dev)
                            dt_ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=dev)
                            dist.all_reduce(dt_ms, op=dist.ReduceOp.MAX)  # the slowest rank
                            samples.append(float(dt_ms.item()))
                        eqs = torch.tensor([1 if eq else 0], device=dev)
                        dist.all_reduce(eqs, op=dist.ReduceOp.MIN)
                        res[name] = (summarize(samples), bool(eqs.item()))
                    base = res["vllm_kshard_allreduce"][0].median
                    for name, (st, eq) in res.items():
                        rows.append(make_row(
                            benchmark="tp_row_parallel", op="gemm.linear (row-parallel layer)", implementation=name,
                            config={"model": shape, "layer": layer, "K": K, "N": N, "T": T, "dtype": dname, "tp": tp},
                            stats=st, warmup=args.warmup, device=device_info(dev), versions=versions(),
                            baseline="vllm_kshard_allreduce",
                            extra={"ratio_vs_baseline": st.median / base, "bits_equal_tp1": eq}))
    if rank == 0:
        write_report(rows, args.out, meta={"machine_load": machine_load(), "nproc": tp})
        for r in rows:
            c = r["config"]
            print(f"{c['model']:>10} {c['layer']:>9} T={c['T']:<5} {c['dtype']:<8} {r['implementation']:<30} "
                  f"p50 {r['p50']:.3f} ms  x{r['ratio_vs_baseline']:.2f}  bits==tp1 {r['bits_equal_tp1']}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shapes", default="qwen3-0.6b")
    ap.add_argument("--tokens", default="16,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
