"""Every public CPU op, forward and backward, fp32 and bf16, reduced to sha256 digests of its bits.

Run as a script (``python -m tests.helpers.cpu_bits_cases --threads 1,2,3,4``) it prints one
JSON object ``{"<threads>": {"<case>": "<sha256>"}}``; the thread/ISA tests
(``tests/ops/test_cpu_bits_threads_isa.py``) run it in subprocesses under instruction-set switches
and compare the digests. Cases named ``native/...`` run plain torch (``F.linear``, ``bmm``,
``log_softmax`` backward, ``exp``...) on the same inputs: the negative control, which must differ
somewhere across the same settings.

Inputs come from integer hashing (exact integer arithmetic, then one division), never from
``torch.randn``, whose vectorised and scalar generators differ between instruction sets. Shapes
are large enough for the BLAS libraries to split ``K`` across threads (K ≥ 2048) and for the
vector-math library to take its vector paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

_M61 = (1 << 61) - 1


def hashed(shape: tuple[int, ...], seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values in ``[-scale, scale)`` from ``(index · A + seed · B) mod 2^61`` (int64 arithmetic, exact)."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    h = (i * 0x9E3779B1 + (seed + 1) * 0x85EBCA77) & _M61
    h = (h ^ (h >> 29)) * 0xBF58476D & _M61
    h = (h ^ (h >> 31)) & ((1 << 24) - 1)
    x = (h.to(torch.float64) / float(1 << 23) - 1.0) * scale
    return x.to(torch.float32).to(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.is_floating_point():
        t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.numpy().tobytes()


def digest(*tensors: torch.Tensor | None) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(_bits(t))
    return h.hexdigest()


def _fwd_bwd(fn: Callable[..., torch.Tensor], *args: torch.Tensor, grad_seed: int = 99) -> str:
    """Digest of ``fn(*args)`` and of the gradients of every floating argument."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    out_t = out.loss if hasattr(out, "loss") else out
    g = hashed(tuple(out_t.shape), grad_seed).to(out_t.dtype) if out_t.dim() else torch.ones((), dtype=out_t.dtype)
    out_t.backward(g)
    return digest(out_t, *[a.grad for a in leaves if a.is_floating_point()])


def cases() -> dict[str, Callable[[], str]]:
    from rl_engine.ops import activation, attention, embedding, gemm, logprob, loss, moe, norm, rope

    out: dict[str, Callable[[], str]] = {}
    for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = hashed((64, 2048), 1, 2.0, dt)
        w = hashed((1100, 2048), 2, 0.05, dt)
        b = hashed((1100,), 3, 0.1, dt)
        out[f"gemm.linear/{dt_name}"] = lambda x=x, w=w, b=b: _fwd_bwd(gemm.linear, x, w, b)
        out[f"native/F.linear/{dt_name}"] = lambda x=x, w=w, b=b: _fwd_bwd(F.linear, x, w, b)
        h = hashed((48, 512), 4, 3.0, dt)
        nw = (1.0 + hashed((512,), 5, 0.1)).to(dt)
        out[f"norm.rms_norm/{dt_name}"] = lambda h=h, nw=nw: _fwd_bwd(lambda a, c: norm.rms_norm(a, c, 1e-6), h, nw)
        r = hashed((48, 512), 6, 1.0, dt)
        out[f"norm.fused_add_rms_norm/{dt_name}"] = lambda h=h, r=r, nw=nw: _fwd_bwd(
            lambda a, c, d: torch.cat([t.float() for t in norm.fused_add_rms_norm(a, c, d, 1e-6)], -1), h, r, nw
        )
        a = hashed((48, 2 * 768), 7, 6.0, dt)
        out[f"activation.silu_and_mul/{dt_name}"] = lambda a=a: _fwd_bwd(activation.silu_and_mul, a)
        out[f"native/F.silu/{dt_name}"] = lambda a=a: _fwd_bwd(F.silu, a)
        q = hashed((40, 4, 128), 8, 1.0, dt)
        pos = torch.arange(40, dtype=torch.int64) * 977
        out[f"rope.apply_rope/{dt_name}"] = lambda q=q, pos=pos: _fwd_bwd(lambda t: rope.apply_rope(t, pos, theta=1e6), q)
        ew = hashed((3000, 256), 9, 1.0, dt)
        ids = (torch.arange(96, dtype=torch.int64) * 7919) % 3000
        out[f"embedding.embedding/{dt_name}"] = lambda ew=ew, ids=ids: _fwd_bwd(lambda t: embedding.embedding(ids, t), ew)
        z = hashed((24, 5000), 10, 8.0, dt)
        tgt = (torch.arange(24, dtype=torch.int64) * 613) % 5000
        out[f"logprob.log_softmax/{dt_name}"] = lambda z=z: _fwd_bwd(lambda t: logprob.log_softmax(t, 0.9), z)
        out[f"native/log_softmax/{dt_name}"] = lambda z=z: _fwd_bwd(lambda t: torch.log_softmax(t.float() / 0.9, -1), z)
        out[f"logprob.token_logprobs/{dt_name}"] = lambda z=z, tgt=tgt: _fwd_bwd(lambda t: logprob.token_logprobs(t, tgt, 0.9), z)
        out[f"logprob.entropy/{dt_name}"] = lambda z=z: _fwd_bwd(lambda t: logprob.entropy(t, 1.0), z)
        hid = hashed((40, 1024), 11, 1.0, dt)
        lw = hashed((2500, 1024), 12, 0.05, dt)
        lt = (torch.arange(40, dtype=torch.int64) * 331) % 2500
        out[f"logprob.linear_token_logprobs/{dt_name}"] = lambda hid=hid, lw=lw, lt=lt: _fwd_bwd(
            lambda hh, ww: torch.cat(logprob.linear_token_logprobs(hh, ww, lt, 0.9, True, token_chunk=16)), hid, lw
        )
        cu = torch.tensor([0, 70, 200], dtype=torch.int32)
        aq, ak, av = hashed((200, 4, 64), 13, 1.0, dt), hashed((200, 2, 64), 14, 1.0, dt), hashed((200, 2, 64), 15, 1.0, dt)
        out[f"attention.varlen_attention/{dt_name}"] = lambda aq=aq, ak=ak, av=av, cu=cu: _fwd_bwd(
            lambda a_, b_, c_: attention.varlen_attention(a_, b_, c_, cu), aq, ak, av
        )
        mx, mr = hashed((96, 1024), 26, 1.0, dt), hashed((16, 1024), 27, 0.05, dt)
        mgu, md = hashed((16, 512, 1024), 28, 0.05, dt), hashed((16, 1024, 256), 29, 0.08, dt)

        def moe_block(x_, r_, gu_, d_):
            w_, ids_ = moe.route(gemm.linear(x_, r_), 4, True)
            return moe.experts(x_, gu_, d_, w_, ids_)

        out[f"moe.route+experts/{dt_name}"] = lambda mx=mx, mr=mr, mgu=mgu, md=md: _fwd_bwd(moe_block, mx, mr, mgu, md)
        sq, sk = hashed((8, 64, 128), 16, 1.0, dt), hashed((8, 128, 64), 17, 1.0, dt)
        out[f"native/bmm/{dt_name}"] = lambda sq=sq, sk=sk: _fwd_bwd(torch.bmm, sq, sk)
    lp = -hashed((6, 300), 20, 1.0).abs() - 0.01
    old = -hashed((6, 300), 21, 1.0).abs() - 0.01
    adv = hashed((6, 300), 22, 1.0)
    mask = (hashed((6, 300), 23, 1.0) > -0.8)
    out["loss.ppo_clip_loss/fp32"] = lambda: _fwd_bwd(lambda a_: loss.ppo_clip_loss(a_, old, adv, mask), lp)
    out["loss.gspo_loss/fp32"] = lambda: _fwd_bwd(lambda a_: loss.gspo_loss(a_, old, adv, mask), lp)
    out["loss.kl_penalty/fp32"] = lambda: _fwd_bwd(lambda a_: loss.kl_penalty(a_, old, mask, estimator="k3"), lp)
    out["loss.rollout_correction/fp32"] = lambda: digest(
        *[v for _, v in sorted(loss.rollout_correction(lp, old, mask, is_level="token").metrics.items())]
    )
    out["native/exp/fp32"] = lambda: digest(torch.exp(hashed((1 << 16,), 24, 30.0)))
    out["native/log/fp32"] = lambda: digest(torch.log(hashed((1 << 16,), 25, 30.0).abs() + 1e-3))
    # ATen's parallel reduction: one partial sum per thread, so the association follows the thread count
    out["native/sum/fp32"] = lambda: digest(hashed((1 << 20,), 26, 1000.0).sum())
    return out


def run(thread_counts: list[int], only: str | None = None) -> dict[str, dict[str, str]]:
    table = cases()
    result: dict[str, dict[str, str]] = {}
    before = torch.get_num_threads()
    try:
        for n in thread_counts:
            torch.set_num_threads(n)
            result[str(n)] = {name: fn() for name, fn in table.items() if only is None or only in name}
    finally:
        torch.set_num_threads(before)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1", help="comma-separated intra-op thread counts")
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = p.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]
    json.dump(run(counts, args.only), sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
