"""Attention on the GPU: rl-kernel's Triton attention vs PyTorch SDPA, same process, same method.

Qwen3-8B heads (32 query / 8 kv heads, head dim 128), bf16:

* ``prefill``  causal forward, S ∈ {512, 4096} with B = 32 × 512 and 4 × 4096 (16k tokens).
  Ours: the varlen launcher (``launch.varlen_forward(for_backward=False)``, packed
  ``[T, H, D]``: the output only, what a no-grad call of the public op stores), and the training
  forward (``.train_forward``: also the fp32 output and lse the backward reads); SDPA:
  ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` on
  ``[B, H, S, D]`` (the layout it is fastest in; the transposes are not timed).
* ``decode``   one query token per sequence, batch ∈ {1, 64} × context ∈ {512, 4096, 32768}.
  Ours: ``launch.cached_forward(decode_only=True)`` (what ``cached_attention`` and
  ``paged_attention_step`` pass for such a step: no tile-table kernel; split-parallel path,
  ``rlk_attn_fwd_split`` + ``rlk_attn_combine``, or one ``rlk_attn_fwd`` launch at 512 keys)
  over a contiguous cache, and over a paged cache of 16-token pages in shuffled order
  (``rlk.paged16``); rows ending ``.tile_table`` are the same step with the tile table built
  first (``rlk_attn_tiles``, what a step of mixed lengths runs); at batch 1 (fewer (sequence,
  kv head) pairs than SMs) rows ``@v1`` … ``@v8`` force each value slicing of the few-programs
  tile (``AttnConfig.v_slices``; the default row lets ``configs.value_slices`` pick it, rows
  ``.no_v`` run without it: ``attention_tuning(auto_value_slices=False)``; rows ``.no_quad`` run the
  sliced step without four blocks a step, ``attention_tuning(four_block_steps=False)``); at batch 64, rows ``@v2`` and
  ``@v4`` slice the decode tile (a finer grain for the last wave of programs); SDPA: a ``[B, 32, 1, D]`` query against ``[B, 8, ctx, D]``
  K/V with ``enable_gqa=True`` (no expanded copies).
* ``train``    varlen forward + backward at S = 4096 (B = 4) vs SDPA forward + backward.

Rows ending ``.no_tma`` (prefill and train) run the train path's forward with its key / value blocks
by pointer loads (``attention_tuning(tma_loads=False)``), beside the default rows' TMA copies;
decode rows ending ``.no_dtma`` run the contiguous step with every block by pointer loads
(``attention_tuning(decode_tma_loads=False)``), beside the default's TMA copies of the unmasked
run. Rows ending ``.no_wg`` (prefill and train) run the train path's forward with the Triton kernel
(``attention_tuning(wg_forward=False)``), beside the default's Hopper warpgroup kernel
(``hopper_warpgroup.rlk_attn_fwd_wg``, sm90 with Triton 3.6); decode rows ending ``.paged16.no_wg``
run the paged step on the Triton kernels (``attention_tuning(wg_decode=False, wgt_decode=False)``),
beside the default's Hopper split kernels where their bands take the step; rows ending ``.no_wgt``
run either step without the transposed split kernel (``hopper_transposed_decode.rlk_attn_split_wgt``,
``configs.wgt_decode_programs``).

Rows ending ``~sb<n>`` (``--split-blocks``) run the shipped call with the KV split set to ``n``
64-key blocks instead of the contract's 16 (an experiment: fewer blocks per split give a decode
step of few sequences more programs, and prefill more merges); the ``best`` lists them apart.

Rows ending ``~u<n>`` (``--unroll``) run the shipped call with the selected forward tiles walking
the unmasked blocks ``n`` per step (``AttnConfig.unroll``; the same bits), side by side.

``--rows`` narrows every case to the implementations matching its shell-style patterns (SDPA, the
baseline, always runs): a decode case with every side-by-side row takes about 100 s on the H200,
``--rows 'rlk.triton.blocked_online_softmax,*.paged16'`` a fraction of it. The JSON
is rewritten after every case (``meta.partial`` until the run ends), so a run cut by its time
limit keeps the cases it finished.

Decode rows ending ``.grid_tiles``, ``.grid_heads`` and ``.grid_splits`` run the step with the split
kernel's grid in that order (``AttentionTuning.split_grid``: tiles, kv heads or splits scheduled
fastest; launch order only, the same bits), side by side with the default's rule (``"auto"``:
splits first at batch 1, kv heads first at batch 64).

Rows ending ``.no_pdl`` (prefill output-only and both decode launchers) are the same calls with
every kernel launched plainly (``attention_tuning(pdl=False)``), side by side with the default's
programmatic dependent launch.

Timing: ``prefill`` and ``decode`` are captured ``n`` times in a CUDA graph per implementation,
and the graphs of a case are replayed round-robin (``harness.cuda_graphs_interleaved_ms``: clock
drift over the case falls on SDPA and every candidate alike; device time, no Python launch
overhead; per call = replay time / n); ``train`` (autograd, milliseconds
of work per call) is timed eagerly. Warm-up calls (compilation included) are excluded; every
sample is one replay / loop, ``--repeats`` samples, rows carry p20/p50/p80 in ms (harness rows)
plus ``time_ratio`` = ours / SDPA p50 and ``throughput_ratio`` = its inverse. The rl-kernel
public entry points add host-side validation (a device sync for ``cu_seqlens``, the finite-input
scan, cache planning) that is not part of these numbers.

``--configs all`` also times every candidate launch configuration of
``configs.CANDIDATE_CONFIGS`` (rows ``rlk.triton.blocked_online_softmax@m128_w8_s2`` etc.;
prefill/decode: forward candidates, train: backward candidates after the shipped forward) and
the report's ``best`` lists the fastest configuration per case, to be copied into the config
tables (every candidate is proven raw-bit equal to the shipped ones by the GPU tests).

Usage::

    python benchmarks/operators/bench_attention_gpu.py --out bench_attention_gpu.json
    python benchmarks/operators/bench_attention_gpu.py --out /tmp/a.json --quick   # smoke run
    python benchmarks/operators/bench_attention_gpu.py --out /tmp/c.json --configs all --kinds prefill,decode
    # other decode shapes (the value-slicing regime: batches with fewer (sequence, kv head) pairs than SMs)
    python benchmarks/operators/bench_attention_gpu.py --out /tmp/d.json --kinds decode --decode-batch 1,2,4,8,16 \
        --decode-ctx 512,4096
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import (cuda_graphs_interleaved_ms, device_info, make_row, summarize,  # noqa: E402
                                      versions, write_report)
from rl_engine.backends.triton.attention.tuning import attention_tuning  # noqa: E402

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
PREFILL = ((32, 512), (4, 4096))  # (B, S)
DECODE_BATCH = (1, 64)
DECODE_CTX = (512, 4096, 32768)
OP = "attention"


def _randn(shape, g):
    return torch.randn(shape, device="cuda", generator=g).to(DTYPE)


def time_eager(fn: Callable[[], object], *, n: int, repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / n)
    return out


OURS = "rlk.triton.blocked_online_softmax"


def _candidates(kind: str, all_configs: bool):
    from rl_engine.backends.triton.attention.configs import CANDIDATE_CONFIGS

    return CANDIDATE_CONFIGS[kind] if all_configs else ()


@contextlib.contextmanager
def _triton_decode():
    """A decode step's splits on the Triton kernels: both Hopper decode kernels off
    (``attention_tuning(wg_decode=False, wgt_decode=False)``)."""
    with attention_tuning(wg_decode=False, wgt_decode=False):
        yield


def _within(fn: Callable[[], object], mode: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], object]:
    """``fn`` called inside a fresh ``mode()`` context: the side-by-side rows of a tuning switch
    (``attention_tuning(pdl=False)`` for ``.no_pdl``, ``auto_value_slices=False`` for ``.no_v``,
    ``tma_loads=False`` for ``.no_tma``, another KV split size for ``~sb<n>``, another block walk
    for ``~u<n>``). The context is entered at every call, so a CUDA-graph capture
    records the kernels it selects."""

    def call():
        with mode():
            return fn()

    return call


def _with_experiment_rows(impls: dict, names: Sequence[str], split_blocks: Sequence[int],
                         unrolls: Sequence[int] = ()) -> None:
    """Add a ``name~sb{n}`` row for each of ``names`` and each KV split size ``n`` (64-key blocks)
    instead of the contract's ``configs.SPLIT_BLOCKS`` (``AttentionTuning.split_blocks``): an
    experiment that changes the bits of
    rows past a split boundary, so a benchmark-only override, not an API (the train path and the
    rollout path must share the value for parity). And a ``name~u{n}`` row for each ``unrolls``
    value: the selected forward tiles with ``AttnConfig.unroll = n`` (the same bits, proven on the
    GPU by ``test_paired_blocks_give_the_same_rows``; 4 only on 16-row tiles), to decide the tables'
    choice."""
    from rl_engine.backends.triton.attention import configs as C

    def unrolled(n: int) -> contextlib.ExitStack:
        # every selected tile with unroll = n (n = 4: the 16-row tiles, the only ones it takes);
        # the few-pairs rules configs.pair_blocks / quad_blocks answer for n alone
        stack = contextlib.ExitStack()
        for select in ("select_prefill", "select_decode"):
            orig = getattr(C, select)
            stack.enter_context(mock.patch.object(
                C, select, lambda *a, _orig=orig, **kw: (lambda c: replace(c, unroll=n)
                                                         if n != 4 or c.block_m == 16 else c)(_orig(*a, **kw))))
        stack.enter_context(mock.patch.object(C, "pair_blocks", lambda *a: n == 2))
        stack.enter_context(mock.patch.object(C, "quad_blocks", lambda *a: n == 4))
        return stack

    for name in names:
        if name not in impls:
            continue
        for n in split_blocks:
            impls[f"{name}~sb{n}"] = _within(impls[name], lambda n=n: attention_tuning(split_blocks=n))
        for n in unrolls:
            impls[f"{name}~u{n}"] = _within(impls[name], lambda n=n: unrolled(n))


def prefill_case(B: int, S: int, all_configs: bool = False, split_blocks: Sequence[int] = (),
                 unrolls: Sequence[int] = ()):
    from rl_engine.backends.triton.attention import launch as L

    g = torch.Generator(device="cuda").manual_seed(B * S)
    T = B * S
    q, k, v = _randn((T, HQ, D), g), _randn((T, HKV, D), g), _randn((T, HKV, D), g)
    cu = torch.arange(0, T + 1, S, device="cuda", dtype=torch.int32)
    qs, ks, vs = (t.view(B, S, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
    flop = 4 * B * HQ * D * S * (S + 1) / 2  # causal: two matmuls over the visible half
    impls = {
        # a forward no backward follows (what SDPA is timed doing): out only
        "rlk.triton.blocked_online_softmax": lambda: L.varlen_forward(q, k, v, cu, D**-0.5, None, max_seqlen=S,
                                                                      for_backward=False),
        # the training forward: also the fp32 output and lse the backward reads
        f"{OURS}.train_forward": lambda: L.varlen_forward(q, k, v, cu, D**-0.5, None, max_seqlen=S),
        "torch.sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
    }
    impls[f"{OURS}.no_pdl"] = _within(impls[OURS], lambda: attention_tuning(pdl=False))
    impls[f"{OURS}.no_tma"] = _within(impls[OURS], lambda: attention_tuning(tma_loads=False))
    impls[f"{OURS}.train_forward.no_tma"] = _within(impls[f"{OURS}.train_forward"], lambda: attention_tuning(tma_loads=False))
    impls[f"{OURS}.no_wg"] = _within(impls[OURS], lambda: attention_tuning(wg_forward=False))
    impls[f"{OURS}.train_forward.no_wg"] = _within(impls[f"{OURS}.train_forward"], lambda: attention_tuning(wg_forward=False))
    _with_experiment_rows(impls, (OURS, f"{OURS}.train_forward"), split_blocks, unrolls)
    for c in _candidates("prefill", all_configs):
        impls[f"{OURS}@{c.key}"] = lambda c=c: L.varlen_forward(q, k, v, cu, D**-0.5, None, config=c, max_seqlen=S,
                                                                for_backward=False)
    return impls, flop, {"B": B, "S": S, "tokens": T}


def decode_case(B: int, ctx: int, all_configs: bool = False, split_blocks: Sequence[int] = (),
                unrolls: Sequence[int] = ()):
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    g = torch.Generator(device="cuda").manual_seed(B + ctx)
    kc, vc = _randn((B * ctx, HKV, D), g), _randn((B * ctx, HKV, D), g)
    q = _randn((B, HQ, D), g)
    q_seq = torch.arange(B, device="cuda")
    q_pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int64)
    contiguous_rows = (torch.arange(B, device="cuda", dtype=torch.int64) * ctx)[:, None].contiguous()
    ps = 16
    pages = torch.randperm(B * ctx // ps, generator=torch.Generator().manual_seed(0)).cuda()
    page_table = pages.view(B, ctx // ps) * ps
    # the paged copy: position p of sequence b at row page_table[b, p // 16] + p % 16
    pos = torch.arange(ctx, device="cuda")
    rows = (page_table[:, pos // ps] + pos % ps).reshape(-1)
    kp, vp = torch.empty_like(kc), torch.empty_like(vc)
    kp[rows], vp[rows] = kc, vc
    ks, vs = (t.view(B, ctx, HKV, D).transpose(1, 2).contiguous() for t in (kc, vc))
    qs = q.view(B, 1, HQ, D).transpose(1, 2).contiguous()
    # A decode step: one token per sequence, which the ops layer knows on the host and passes as
    # decode_only (cached_attention, plan_paged_attention): the kernels form their tile rows from
    # q_pos. The ".tile_table" rows run the same step through the tile-table kernel (a step of
    # mixed lengths always does), side by side.
    impls = {
        OURS: lambda: L.cached_forward(q, kc, vc, contiguous_rows, ctx, q_seq, q_pos, D**-0.5, None, decode_only=True),
        f"{OURS}.paged16": lambda: L.cached_forward(q, kp, vp, page_table.contiguous(), ps, q_seq, q_pos, D**-0.5, None,
                                                    decode_only=True),
        "torch.sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
        f"{OURS}.tile_table": lambda: L.cached_forward(q, kc, vc, contiguous_rows, ctx, q_seq, q_pos, D**-0.5, None),
        f"{OURS}.paged16.tile_table": lambda: L.cached_forward(q, kp, vp, page_table.contiguous(), ps, q_seq, q_pos,
                                                               D**-0.5, None),
    }
    impls[f"{OURS}.no_pdl"] = _within(impls[OURS], lambda: attention_tuning(pdl=False))
    # the contiguous step with every block by pointer loads (eligibility.decode_tma_eligible), side by side
    impls[f"{OURS}.no_dtma"] = _within(impls[OURS], lambda: attention_tuning(decode_tma_loads=False))
    impls[f"{OURS}.paged16.no_pdl"] = _within(impls[f"{OURS}.paged16"], lambda: attention_tuning(pdl=False))
    # the paged step with its splits on the Triton kernels (wg_decode=False), beside the
    # default's warpgroup kernel where configs.wg_decode_programs takes the step
    impls[f"{OURS}.paged16.no_wg"] = _within(impls[f"{OURS}.paged16"], _triton_decode)
    # either step with its splits off the transposed kernel (wgt_decode=False): the
    # Triton kernels or, over pages, the warpgroup kernel where its band takes the step
    impls[f"{OURS}.no_wgt"] = _within(impls[OURS], lambda: attention_tuning(wgt_decode=False))
    impls[f"{OURS}.paged16.no_wgt"] = _within(impls[f"{OURS}.paged16"], lambda: attention_tuning(wgt_decode=False))
    # the split kernel's grid in another order (AttentionTuning.split_grid), side by side
    for order in ("tiles", "heads", "splits"):
        for name in (OURS, f"{OURS}.paged16"):
            impls[f"{name}.grid_{order}"] = _within(impls[name], lambda o=order: attention_tuning(split_grid=o))
    few = C.few_programs(B, HKV, q.device)
    if few:
        # the step without the value slicing configs.value_slices picks (".no_v"), beside the
        # default and each slicing forced (@v1 ...): the measurement the rule is checked against
        impls[f"{OURS}.no_v"] = _within(impls[OURS], lambda: attention_tuning(auto_value_slices=False))
        impls[f"{OURS}.paged16.no_v"] = _within(impls[f"{OURS}.paged16"], lambda: attention_tuning(auto_value_slices=False))
        # the sliced step without four blocks a step (configs.quad_blocks): the walk it replaced
        impls[f"{OURS}.no_quad"] = _within(impls[OURS], lambda: attention_tuning(four_block_steps=False))
        impls[f"{OURS}.paged16.no_quad"] = _within(impls[f"{OURS}.paged16"], lambda: attention_tuning(four_block_steps=False))
    ns = C.num_splits(ctx)
    few_tile = few and C.one_wave(B * HKV * ns, q.device)  # cached_forward's choice
    _with_experiment_rows(impls, (OURS, f"{OURS}.paged16"), split_blocks, unrolls)
    # many programs: the tail of the last wave is a program's work (batch 64 x 4096 keys: 2048
    # programs, about 5.2 waves at three programs per SM); value slices make the grain finer
    for v in (1, 2, 4, 8) if few else (2, 4):
        contiguous_cfg = replace(C.select_decode(q.dtype, D, None, few=few_tile, many=not few_tile), v_slices=v)
        paged_cfg = replace(C.select_decode(q.dtype, D, ps, few=few_tile, many=not few_tile), v_slices=v)
        impls[f"{OURS}@v{v}"] = lambda c=contiguous_cfg: L.cached_forward(
            q, kc, vc, contiguous_rows, ctx, q_seq, q_pos, D**-0.5, None, path="decode", config=c, decode_only=True)
        impls[f"{OURS}.paged16@v{v}"] = lambda c=paged_cfg: L.cached_forward(
            q, kp, vp, page_table.contiguous(), ps, q_seq, q_pos, D**-0.5, None, path="decode", config=c,
            decode_only=True)
    for c in _candidates("decode", all_configs):
        impls[f"{OURS}@{c.key}"] = lambda c=c: L.cached_forward(q, kc, vc, contiguous_rows, ctx, q_seq, q_pos, D**-0.5,
                                                                None, path="decode", config=c, decode_only=True)
        impls[f"{OURS}.paged16@{c.key}"] = lambda c=c: L.cached_forward(
            q, kp, vp, page_table.contiguous(), ps, q_seq, q_pos, D**-0.5, None, path="decode", config=c,
            decode_only=True)
    kv_bytes = 2 * B * ctx * HKV * D * 2
    return impls, kv_bytes, {"B": B, "context": ctx, "sdpa_gqa": "enable_gqa=True (no expanded K/V)"}


def train_case(B: int, S: int, all_configs: bool = False, split_blocks: Sequence[int] = (),
               unrolls: Sequence[int] = ()):
    from rl_engine.backends.triton.attention import launch as L
    from rl_engine.backends.triton.attention import varlen_attention_fwd_triton

    g = torch.Generator(device="cuda").manual_seed(7)
    T = B * S
    q, k, v = _randn((T, HQ, D), g), _randn((T, HKV, D), g), _randn((T, HKV, D), g)
    up = _randn((T, HQ, D), g)
    cu = torch.arange(0, T + 1, S, device="cuda", dtype=torch.int32)
    qs, ks, vs = (t.view(B, S, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
    ups = up.view(B, S, HQ, D).transpose(1, 2).contiguous()
    for t in (q, k, v, qs, ks, vs):
        t.requires_grad_()

    def ours():
        out = varlen_attention_fwd_triton(q, k, v, cu, D**-0.5, None)[0]
        torch.autograd.grad(out, (q, k, v), up)

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (qs, ks, vs), ups)

    flop = 2.5 * 4 * B * HQ * D * S * (S + 1) / 2  # forward + backward (2.5x the forward's matmuls)
    impls = {OURS: ours, "torch.sdpa": sdpa}
    impls[f"{OURS}.no_tma"] = _within(ours, lambda: attention_tuning(tma_loads=False))
    impls[f"{OURS}.no_wg"] = _within(ours, lambda: attention_tuning(wg_forward=False))
    _with_experiment_rows(impls, (OURS,), split_blocks, unrolls)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    for c in _candidates("backward", all_configs):
        def cand(c=c):
            out, lse, out32 = L.varlen_forward(qd, kd, vd, cu, D**-0.5, None)
            L.varlen_backward(up, qd, kd, vd, out32, lse, cu, D**-0.5, None, config=c)

        impls[f"{OURS}@bwd_{c.key}"] = cand
    return impls, flop, {"B": B, "S": S, "tokens": T}


def select_rows(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The implementations of a case that ``--rows`` keeps: ``torch.sdpa`` (every ratio's
    baseline) and each name matching one of the shell-style ``patterns`` (``fnmatch``, case
    sensitive); every name when ``patterns`` is empty."""
    if not patterns:
        return list(names)
    return [n for n in names if n == "torch.sdpa" or any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def run(quick: bool, repeats: int, all_configs: bool = False,
        kinds: Sequence[str] = ("prefill", "decode", "train"), decode_batch: Sequence[int] = DECODE_BATCH,
        decode_ctx: Sequence[int] = DECODE_CTX, split_blocks: Sequence[int] = (),
        unrolls: Sequence[int] = (), patterns: Sequence[str] = (),
        checkpoint: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Time every case of ``kinds``; ``patterns`` (``--rows``) narrows each case's implementations
    (``select_rows``); ``checkpoint(rows)`` runs after each case (the partial JSON a cut run keeps)."""
    dev, ver = device_info("cuda"), versions()
    rows: list[dict] = []
    cases: list[tuple[str, Callable]] = []
    prefill = PREFILL[:1] if quick else PREFILL
    for B, S in prefill:
        cases.append(("prefill", lambda B=B, S=S: prefill_case(B, S, all_configs, split_blocks, unrolls)))
    for B in decode_batch:
        for ctx in (decode_ctx[:2] if quick else decode_ctx):
            cases.append(("decode", lambda B=B, ctx=ctx: decode_case(B, ctx, all_configs, split_blocks, unrolls)))
    cases.append(("train", lambda: train_case(1 if quick else 4, 4096, all_configs, split_blocks, unrolls)))
    cases = [(kind, make) for kind, make in cases if kind in kinds]
    for kind, make in cases:
        impls, work, cfg = make()
        impls = {name: impls[name] for name in select_rows(list(impls), patterns)}
        mode = "eager" if kind == "train" else "graph"
        n = 3 if kind == "train" else (20 if kind == "decode" else 5)
        if mode == "graph":
            # replayed round-robin: clock drift over the case falls on SDPA and every candidate alike
            res = {name: summarize(ts)
                   for name, ts in cuda_graphs_interleaved_ms(impls, calls=n, repeats=repeats, warmup=3).items()}
        else:
            res = {name: summarize(time_eager(fn, n=n, repeats=repeats)) for name, fn in impls.items()}
        base = res["torch.sdpa"].median
        for name, st in res.items():
            extra = {"kind": kind,
                     "timing": f"{mode} (CUDA graphs of {n} calls, replayed round-robin)" if mode == "graph"
                     else f"eager loop of {n}",
                     "time_ratio": round(st.median / base, 4), "throughput_ratio": round(base / st.median, 4)}
            if kind == "decode":
                extra["kv_TB_per_s"] = round(work / (st.median * 1e-3) / 1e12, 3)
            else:
                extra["tflops"] = round(work / (st.median * 1e-3) / 1e12, 1)
            rows.append(make_row(benchmark="attention_gpu", op=OP, implementation=name,
                                 config={**cfg, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16"}, stats=st,
                                 warmup=3, device=dev, versions=ver, baseline="torch.sdpa", extra=extra))
            print(f"{kind:7s} {cfg} {name:56s} p50 {st.median * 1e3:10.1f} us  x{extra['time_ratio']:.3f} "
                  f"(throughput {extra['throughput_ratio']:.3f} of SDPA)", flush=True)
        del impls
        torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer shapes and samples")
    ap.add_argument("--repeats", type=int, default=None, help="samples per implementation (default 15; quick 3)")
    ap.add_argument("--configs", choices=("default", "all"), default="default",
                    help="all: also time every candidate launch configuration (configs.CANDIDATE_CONFIGS)")
    ap.add_argument("--kinds", default="prefill,decode,train", help="comma-separated subset of prefill,decode,train")
    ap.add_argument("--decode-batch", default=",".join(map(str, DECODE_BATCH)),
                    help="comma-separated decode batch sizes (default: the issue's 1,64)")
    ap.add_argument("--decode-ctx", default=",".join(map(str, DECODE_CTX)),
                    help="comma-separated decode contexts, multiples of 16 (default: the issue's 512,4096,32768)")
    ap.add_argument("--split-blocks", default="",
                    help="comma-separated KV split sizes in 64-key blocks to time beside the contract's "
                         "(rows ending ~sb<n>; an experiment: the bits of rows past a split change)")
    ap.add_argument("--unroll", default="",
                    help="comma-separated blocks per unmasked step (1, 2, 4: AttnConfig.unroll) to time beside the "
                         "shipped tiles (rows ending ~u<n>; the same bits)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated shell-style patterns of the implementations to time (torch.sdpa, the "
                         "baseline, always runs), e.g. 'rlk.triton.blocked_online_softmax,*.paged16'; default: all")
    args = ap.parse_args(argv)

    def ints(flag: str, text: str, multiple: int = 1) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(",") if x)
        except ValueError:
            vals = ()
        if not vals or min(vals) < 1 or any(x % multiple for x in vals):
            ap.error(f"{flag}: expected positive integers (multiples of {multiple}) separated by commas, got {text!r}")
        return vals

    decode_batch = ints("--decode-batch", args.decode_batch)
    decode_ctx = ints("--decode-ctx", args.decode_ctx, 16)
    split_blocks = ints("--split-blocks", args.split_blocks) if args.split_blocks else ()
    unrolls = ints("--unroll", args.unroll) if args.unroll else ()
    if any(u not in (1, 2, 4) for u in unrolls):
        ap.error(f"--unroll: expected values among 1,2,4, got {args.unroll!r}")
    patterns = ()
    if args.rows is not None:
        patterns = tuple(p.strip() for p in args.rows.split(","))
        if not all(patterns):
            ap.error(f"--rows: expected comma-separated non-empty patterns, got {args.rows!r}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in ("prefill", "decode", "train")]
    if bad or not kinds:
        ap.error(f"--kinds: expected a subset of prefill,decode,train, got {args.kinds!r}")
    if not torch.cuda.is_available():
        print("bench_attention_gpu: no CUDA device visible", file=sys.stderr)
        return 2
    repeats = args.repeats or (3 if args.quick else 15)

    def checkpoint(rows: list[dict]) -> None:  # the rows so far: a run cut by its time limit keeps them
        write_report(rows, args.out, meta={"partial": True})

    rows = run(args.quick, repeats, args.configs == "all", kinds, decode_batch, decode_ctx, split_blocks, unrolls,
               patterns, checkpoint)
    target = {"prefill": 0.9, "decode": 0.9}
    def has_target(r):  # the training forward (extra outputs for the backward) is reported, not targeted
        return r["kind"] in target and ".train_forward" not in r["implementation"]

    summary = [{"kind": r["kind"], "config": r["config"], "implementation": r["implementation"],
                "throughput_ratio": r["throughput_ratio"],
                "target": f">= {target[r['kind']]}x SDPA throughput" if has_target(r) else "(no target)",
                "met": (r["throughput_ratio"] >= target[r["kind"]]) if has_target(r) else None}
               for r in rows if r["implementation"] != "torch.sdpa"]
    best = {}
    for r in rows:
        if not r["implementation"].startswith(OURS):
            continue
        variant = next((v for v in ("paged16", "train_forward") if f".{v}" in r["implementation"]), "contiguous")
        if "~sb" in r["implementation"]:  # another KV split size: its own best (not the contract's)
            variant += "~sb" + r["implementation"].rsplit("~sb", 1)[1]
        shape = " ".join(f"{k}={r['config'][k]}" for k in ("B", "S", "context") if k in r["config"])
        key = f"{r['kind']} {variant} {shape}"
        if key not in best or r["throughput_ratio"] > best[key]["throughput_ratio"]:
            best[key] = {"implementation": r["implementation"], "throughput_ratio": r["throughput_ratio"]}
    for key, b in best.items():
        print(f"best {key:40s} {b['implementation']:56s} throughput {b['throughput_ratio']:.3f} of SDPA")
    write_report(rows, args.out, meta={"summary": summary, "best": best})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
