"""The portable Triton kernels of ``attention.varlen_attention`` / ``attention.cached_attention``
(``portable_forward``, ``portable_backward`` over the shared device functions of ``device``):
accuracy of the output and of ``dq``/``dk``/``dv``, and raw-bit equality across every shipped
configuration, path, block walk, load form and value slicing.

GPU tests (``@pytest.mark.gpu``; the device run must show zero skips): accuracy against float64
(contract tolerances), fp32 and bf16, GQA, windows, head dims 32/64/128, sequences across KV
splits; every shipped and candidate BLOCK_M / warps / stages configuration and both paths against
each other (kernel level); the split-merge specialisation; two and four blocks a step; TMA copies
of the train path and of decode steps; value slices; the split kernel's grid orders; the block
walk with unmasked interior blocks against every block masked (forced both ways, forward and
grads).

Triton-interpreter subset (``TRITON_INTERPRET=1`` and triton importable, CPU tensors, small
shapes, D = 32, fp32): accuracy and path/config bit equality, the row sum against the CPU fold,
and each walk, load form and slicing against the plain one, each with a planted change it must
catch. Offline sm_90 compile (no GPU): the decode launches are software-pipelined without spills.
"""

from __future__ import annotations

from itertools import accumulate, product

import pytest
import torch

from rl_engine import contracts
from rl_engine.backends.cpu.attention import fold_sum
from rl_engine.backends.triton.attention.configs import Variant
from rl_engine.backends.triton.attention.tuning import attention_tuning, current_tuning
from rl_engine.ops.attention import varlen_attention
from rl_engine.reference.attention import varlen_attention_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import NoEligibleImplementation
from rl_engine.utils.bits import same_bits
from tests.backends.triton._rowwise_common import evidence
from tests.backends.triton.attention._attention_common import (
    DTYPES,
    GARBAGE,
    IMPL,
    OPS,
    gpu,
    interp,
    last_token_step,
    make_qkv,
    offline_sm90,
)


# --------------------------------------------------------------------------- Triton interpreter subset (CPU)


@interp
@pytest.mark.parametrize("window,d", [(None, 32), (7, 32), (7, 256)])
def test_interpreter_kernels_accuracy_and_path_bits(window, d):
    """The kernels' forward and backward against the float64 reference (contract tolerances), and
    the rows on the decode path and two other tiles raw-bit equal to the prefill rows; at the
    smallest and the largest supported head dim."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, cu = make_qkv([5, 40, 1], 1, 2, d, "float32", seed=3)
    scale = d**-0.5
    out, lse, _ = L.varlen_forward(q, k, v, cu, scale, window)
    ref = varlen_attention_f64(q.double(), k.double(), v.double(), cu, scale, window)
    tol = contracts.tolerance(OPS[0], torch.float32, "forward")
    assert tol.check(out, ref), tol.max_violation(out, ref)
    for path, cfg in (("decode", None), ("prefill", C.AttnConfig(16, 4, 1)), ("prefill", C.AttnConfig(32, 4, 1))):
        o2, l2, _ = L.varlen_forward(q, k, v, cu, scale, window, path=path, config=cfg)
        assert same_bits(o2, out) and same_bits(l2, lse), (path, cfg)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv = L.varlen_backward(up, q, k, v, out, lse, cu, scale, window)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    varlen_attention_f64(q64, k64, v64, cu, scale, window).backward(up.double())
    btol = contracts.tolerance(OPS[0], torch.float32, "backward")
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        assert btol.check(got, want), (name, btol.max_violation(got, want))


@interp
def test_interpreter_split_grid_orders_give_the_same_bits(monkeypatch, tuned, planted):
    """``AttentionTuning.split_grid``: the split kernel's grid with tiles, kv heads or splits scheduled
    fastest (``rlk_attn_fwd_split(ORDER=...)``), or the ``auto`` rule (splits first for fewer
    (tile, kv head) pairs than SMs, else kv heads first) — launch order only — gives the prefill
    kernel's rows for a decode step of three sequences over 1, 3 and 5 KV splits (64-key splits),
    2 kv heads. An order that would put more than 65 535 programs on the grid's y or z axis falls
    back to tiles first; an unknown order is refused; the switch is restored. Negative control: a
    planted kernel whose heads-first order reads the split index from the wrong axis is caught."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    args = last_token_step(2, seed=43)
    tuned(split_blocks=1)
    want = L.cached_forward(*args, path="prefill")
    assert current_tuning().split_grid == "auto"
    cpu = torch.device("cpu")
    assert C.split_grid_order(3, 2, 5, cpu) == 1  # auto off CUDA: never few programs, heads first
    for order in ("tiles", "heads", "splits", "auto"):
        with attention_tuning(split_grid=order):
            if order != "auto":
                assert C.split_grid_order(3, 2, 5, cpu) == ("tiles", "heads", "splits").index(order)
            assert same_bits(L.cached_forward(*args, path="decode"), want), order
    assert current_tuning().split_grid == "auto"
    # auto: splits first for fewer (tile, kv head) pairs than SMs, kv heads first otherwise
    monkeypatch.setattr(C, "few_programs", lambda tiles, heads, device: tiles * heads < 132)
    assert C.split_grid_order(1, 8, 16, cpu) == 2 and C.split_grid_order(64, 8, 4, cpu) == 1
    with attention_tuning(split_grid="heads"):  # (kv heads, tiles, split programs)
        assert C.split_grid_order(70000, 8, 4, cpu) == 0  # 70 000 tiles on the y axis: tiles first
        assert C.split_grid_order(8, 8, 70000, cpu) == 0  # 70 000 split programs on z
    with attention_tuning(split_grid="splits"):  # (split programs, tiles, kv heads)
        assert C.split_grid_order(70000, 8, 4, cpu) == 0
        assert C.split_grid_order(8, 8, 70000, cpu) == 2  # the x axis takes them
    with pytest.raises(ValueError, match="split_grid: expected 'auto' or one of"):
        with attention_tuning(split_grid="rows"):
            pass
    bad = planted({"device": (("        kvh = tl.program_id(0).to(tl.int64)\n        js = tl.program_id(2)",
                               "        kvh = tl.program_id(0).to(tl.int64)\n        js = tl.program_id(0)"),)},
                  "grid_heads_axis")
    with attention_tuning(split_grid="heads"):
        assert not same_bits(bad.cached_forward(*args, path="decode"), want)


@interp
@pytest.mark.parametrize("window", [None, 7])
def test_interpreter_tma_loads_give_the_same_bits(window, monkeypatch, tuned, planted):
    """``AttentionTuning.tma_loads`` (on by default; ``attention_tuning(tma_loads=False)`` scopes it
    off): the train path's key / value blocks by TMA copies (``rlk_attn_block(TMA=True)``, no clamp of the rows past a tile's
    queries) give the rows and lse of the pointer loads at the same tile — across a split merge
    (2-block splits here, so short sequences cross them) and beside a next sequence of large
    values that a block reads past the first one's end (masked: the first sequence's rows equal
    its rows alone). The switch is scoped; ``tma_eligible`` refuses CPU tensors (the copies are
    forced here past its device clause), sliced configs and the ``"propagate"`` NaN policy
    (unchecked inputs). Negative controls: a perturbed visible key changes the rows; a planted
    copy whose copies start one row late is caught (the TMA path is the one that ran)."""
    import types
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L
    from rl_engine.utils.checks import nan_policy

    tuned(split_blocks=2)
    q, k, v, cu = make_qkv([70, 200, 5], 1, 2, 32, "float32", seed=31)
    v[70:270] *= 100.0
    k[70:270] *= 100.0
    assert current_tuning().tma_loads and not E.tma_eligible(q, k, v, C.select_prefill(q.dtype, 32))  # CPU tensors: never
    rule = E.tma_eligible
    as_sm90 = types.SimpleNamespace(device=torch.device("cuda", 0))  # the rule's only look at q: its device
    monkeypatch.setattr(E, "capability", lambda index: (9, 0))
    monkeypatch.setattr(E, "tma_eligible", lambda q, k, v, cfg: rule(as_sm90, k, v, cfg))
    with attention_tuning(tma_loads=False):
        assert not E.tma_eligible(q, k, v, C.select_prefill(q.dtype, 32))
        plain = L.varlen_forward(q, k, v, cu, 0.2, window)
    assert E.tma_eligible(q, k, v, C.select_prefill(q.dtype, 32))
    assert not E.tma_eligible(q, k, v, replace(C.select_prefill(q.dtype, 32), v_slices=2))
    with nan_policy("propagate"):  # unchecked inputs: a NaN past a sequence's end must not reach it
        assert not E.tma_eligible(q, k, v, C.select_prefill(q.dtype, 32))
    tma = L.varlen_forward(q, k, v, cu, 0.2, window)
    alone = L.varlen_forward(q[:70].contiguous(), k[:70].contiguous(), v[:70].contiguous(), cu[:2], 0.2, window)
    k2 = k.clone()
    k2[10, 0, 5] += 0.25
    perturbed = L.varlen_forward(q, k2, v, cu, 0.2, window)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_tuning(tma_loads=False):
            raise RuntimeError("boom")
    assert current_tuning().tma_loads
    assert same_bits(tma[0], plain[0]) and same_bits(tma[1], plain[1])
    assert same_bits(alone[0], tma[0][:70]) and same_bits(alone[1], tma[1][:70])
    assert not same_bits(perturbed[0][:70], tma[0][:70]) and same_bits(perturbed[0][70:], tma[0][70:])
    late_copies = planted({"device": (("row0 = (kbase + b * 64).to(tl.int32)",
                                       "row0 = (kbase + b * 64 + 1).to(tl.int32)"),)}, f"tma_{window}")
    with attention_tuning(tma_loads=False):  # switch off: pointer loads
        assert same_bits(late_copies.varlen_forward(q, k, v, cu, 0.2, window)[0], plain[0])
    late = late_copies.varlen_forward(q, k, v, cu, 0.2, window)
    assert not same_bits(late[0], plain[0])


@interp
@pytest.mark.parametrize("window", [None, 300])
def test_interpreter_decode_tma_loads_give_the_same_bits(window, monkeypatch, tuned, planted):
    """``decode_tma_eligible`` (contiguous caches, on by default;
    ``attention_tuning(decode_tma_loads=False)`` scopes it off): over a cache whose slots past each sequence's end hold NaN, a decode step
    whose unmasked blocks arrive by TMA copies and whose masked blocks by clamped pointer loads
    gives the rows of the pointer loads at the same tile, which give the varlen rows — through
    the split kernel (2 KV splits) and the prefill kernel (one split), one or two blocks per
    step, one or two value slices (the value copy's column offset); fp32 here with the 16-bit
    three-run walk forced. The rule: only CUDA sm90+, 16-bit, unpaged, head-contiguous aligned
    rows; every decode tile (the many-pairs tile of steps with few pairs past one wave too). Negative control: a planted kernel whose masked blocks also take the copies reads the NaN
    slots past a sequence's end (unclamped) and its rows are caught."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(E, "capability", lambda index: (9, 0))
    bf = torch.zeros((64, 2, 32), dtype=torch.bfloat16)
    assert E.decode_tma_eligible(bf, bf, False, cuda)
    assert not E.decode_tma_eligible(bf, bf, True, cuda)  # pages
    assert not E.decode_tma_eligible(bf, bf, False, torch.device("cpu"))
    assert not E.decode_tma_eligible(bf.float(), bf.float(), False, cuda)
    assert not E.decode_tma_eligible(torch.zeros((64, 2, 64), dtype=torch.bfloat16)[:, :, :32], bf, False, cuda)
    with attention_tuning(decode_tma_loads=False):
        assert not E.decode_tma_eligible(bf, bf, False, cuda)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_tuning(decode_tma_loads=False):
            raise RuntimeError("boom")
    assert current_tuning().decode_tma_loads
    monkeypatch.setattr(E, "capability", lambda index: (8, 0))
    assert not E.decode_tma_eligible(bf, bf, False, cuda)

    lens = [1100, 3, 40]
    q, k, v, cu = make_qkv(lens, 1, 2, 32, "float32", seed=33)
    ref, _, _ = L.varlen_forward(q, k, v, cu, 0.2, window)
    last = torch.tensor([c - 1 for c in accumulate(lens)])
    kc, vc = torch.full((3 * 2048, 1, 32), float("nan")), torch.full((3 * 2048, 1, 32), float("nan"))
    for i, n in enumerate(lens):  # each sequence at its own 2048-row region, NaN past its end
        kc[i * 2048 : i * 2048 + n], vc[i * 2048 : i * 2048 + n] = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
    regions = torch.tensor([[0], [2048], [4096]])
    tuned(split_runs=True)  # the 16-bit walk (fp32 masks every block)
    seen = []
    # past the device clause; the switch still decides
    monkeypatch.setattr(E, "decode_tma_eligible", lambda *a: current_tuning().decode_tma_loads and (seen.append(1) or True))

    def step(mod, cfg, n=3, bound=2048):
        return mod.cached_forward(q[last[3 - n :]].contiguous(), kc, vc, regions[3 - n :], bound,
                                  torch.arange(n), torch.tensor([x - 1 for x in lens[3 - n :]]), 0.2, window,
                                  path="decode", config=cfg, decode_only=True)

    # the interpreter's tl.dot is numpy's matmul, whose bits follow the operand layout (the copies
    # give a transposed key view; tma_eligible): the copies are compared with the pointer loads at
    # the same tile (64 rows: at 16 numpy's bits differ between the two layouts), the pointer loads
    # with the varlen rows (the GPU test compares every path and tile)
    base = C.AttnConfig(64, 4, 2)
    for cfg in (base, replace(base, unroll=2), replace(base, v_slices=2)):
        with attention_tuning(decode_tma_loads=False):
            plain = step(L, cfg)
        assert same_bits(plain, ref[last]), cfg.key
        assert same_bits(step(L, cfg), plain), cfg.key
    with attention_tuning(decode_tma_loads=False):
        plain = step(L, base, n=2, bound=64)
    assert same_bits(step(L, base, n=2, bound=64), plain)  # one split: the prefill kernel
    assert seen
    # every decode step takes the copies: the few-programs tile and the many-pairs tile of steps
    # with few pairs past one wave
    flags = []
    attend = L.attend
    monkeypatch.setattr(L, "attend",
                        lambda *a, **kw: flags.append((kw["variant"] is Variant.CACHE_TMA, kw["config"])) or attend(*a, **kw))
    rules = C.few_programs, C.one_wave
    monkeypatch.setattr(C, "few_programs", lambda *a: True)
    for wave in (False, True):
        monkeypatch.setattr(C, "one_wave", lambda *a, wave=wave: wave)
        step(L, None)
    assert [f for f, _ in flags] == [True, True]
    assert flags[0][1] == C.select_decode(torch.float32, 32, many=True) and flags[1][1].num_stages == C.select_decode(
        torch.float32, 32, few=True).num_stages
    edit = ("HAS_WINDOW, TMA, U, False, vs * DV)", "HAS_WINDOW, TMA, U, True, vs * DV)")
    monkeypatch.setattr(C, "few_programs", rules[0])  # the planted step under the shipped rules
    monkeypatch.setattr(C, "one_wave", rules[1])
    caught = step(planted({"portable_forward": (edit,)}, f"dtma_{window}"), base)
    assert not same_bits(caught, ref[last]) and torch.isnan(caught).any()


@interp
def test_interpreter_paged_decode_equals_varlen_rows():
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, cu = make_qkv([50], 1, 2, 32, "float32", seed=4)
    out, _, _ = L.varlen_forward(q, k, v, cu, 0.2, None)
    ps, n = 16, 50
    pages = torch.tensor([3, 0, 5, 1])  # shuffled physical pages
    kc = torch.full((6 * ps, 1, 32), GARBAGE)
    vc = torch.full((6 * ps, 1, 32), -GARBAGE)
    pos = torch.arange(n)
    kc[pages[pos // ps] * ps + pos % ps] = k
    vc[pages[pos // ps] * ps + pos % ps] = v
    for path in ("decode", "prefill"):
        o = L.cached_forward(q[n - 2:].contiguous(), kc, vc, (pages * ps)[None].contiguous(), ps,
                             torch.zeros(2, dtype=torch.int64), torch.tensor([n - 2, n - 1]), 0.2, None, path=path)
        assert same_bits(o, out[n - 2:]), path
    # a cache bound past one KV split (2048 positions): the decode path runs the split kernel and
    # the combine (with one split it takes the prefill kernel); same rows
    kk = torch.cat([k, torch.full((2048 - n, 1, 32), GARBAGE)])
    vv = torch.cat([v, torch.full((2048 - n, 1, 32), -GARBAGE)])
    for path in ("decode", "prefill"):  # decode: 3 of the 16 workspace rows of a tile stored and merged
        o = L.cached_forward(q[n - 3:].contiguous(), kk, vv, torch.zeros((1, 1), dtype=torch.int64), 2048,
                             torch.zeros(3, dtype=torch.int64), torch.tensor([n - 3, n - 2, n - 1]), 0.2, None,
                             path=path)
        assert same_bits(o, out[n - 3:]), path


@interp
@pytest.mark.parametrize("unroll", [1, 2])
def test_interpreter_paged_walks_load_page_entries_ahead(unroll, tuned, planted):
    """The paged unmasked walks load the page-table entries of the next block (``unroll = 1``) or
    pair (``unroll = 2``) before the current one's products (``rlk_attn_pages``,
    ``rlk_attn_load_paged``). Decode steps over 16-token pages in shuffled order, through the
    split kernel (4-block KV splits, the three-run walk forced on: unmasked runs of several
    blocks), raw-bit equal to the same steps over a contiguous cache. Negative control: a
    planted walk that never advances its loaded entries (every block reads the first block's
    pages) is caught."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    lens = [700, 300]
    q, k, v, cu = make_qkv(lens, 1, 2, 32, "float32", seed=31)
    ps, npages = 16, sum(-(-n // 16) for n in lens)
    perm = torch.randperm(npages, generator=torch.Generator().manual_seed(5))
    kp, vp = torch.full((npages * ps, 1, 32), GARBAGE), torch.full((npages * ps, 1, 32), -GARBAGE)
    table = torch.zeros(2, 44, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        pages = perm[used : used + -(-n // ps)]
        used += len(pages)
        table[i, : len(pages)] = pages * ps
        pos = torch.arange(n)
        kp[pages[pos // ps] * ps + pos % ps] = k[cu[i] : cu[i + 1]]
        vp[pages[pos // ps] * ps + pos % ps] = v[cu[i] : cu[i + 1]]
    q_seq, q_pos = torch.arange(2), torch.tensor([n - 1 for n in lens])
    last = torch.tensor([c - 1 for c in accumulate(lens)])
    cfg = replace(C.AttnConfig(16, 4, 1), unroll=unroll)

    tuned(split_runs=True, split_blocks=4)

    def step(mod, kk, vv, rows, psz):
        return mod.cached_forward(q[last].contiguous(), kk, vv, rows, psz, q_seq, q_pos, 0.2, None, path="decode",
                                  config=cfg, decode_only=True)

    want = step(L, k, v, cu[:-1].to(torch.int64)[:, None], 1024)
    assert same_bits(step(L, kp, vp, table, ps), want)
    stale = ("            pages = nxt\n", "            pages = pages\n") if unroll == 1 else \
        ("            p0 = n0\n", "            p0 = p0\n")
    stale_entries = planted({"device": (stale,)}, f"pages_ahead{unroll}")
    assert same_bits(step(stale_entries, k, v, cu[:-1].to(torch.int64)[:, None], 1024), want)  # contiguous: unaffected
    assert not same_bits(step(stale_entries, kp, vp, table, ps), want), "planted stale page entries not caught"


@interp
@pytest.mark.parametrize("window", [None, 100])
def test_interpreter_unmasked_interior_blocks_give_the_same_bits(window, planted):
    """fp32 (the interpreter's faithful dtype) with the three-run block walk forced on (masked
    edge blocks, unmasked interior blocks) against the one-run walk (every block masked): forward
    on both paths and several tiles, and dq/dk/dv, raw-bit equal; a planted change in the
    unmasked variant alone is caught (so the unmasked runs do execute here)."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, cu = make_qkv([150, 3, 70], 1, 2, 32, "float32", seed=8)
    scale = 32**-0.5
    up = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))

    def run(mod, force, path="prefill", config=None):
        with attention_tuning(split_runs=force):
            out, lse, _ = mod.varlen_forward(q, k, v, cu, scale, window, path=path, config=config)
            return out, lse, mod.varlen_backward(up, q, k, v, out, lse, cu, scale, window)

    ref, ref_lse, ref_g = run(L, False)
    ref64 = varlen_attention_f64(q.double(), k.double(), v.double(), cu, scale, window)
    tol = contracts.tolerance(OPS[0], torch.float32, "forward")
    assert tol.check(ref, ref64), tol.max_violation(ref, ref64)
    for path, cfg in (("prefill", None), ("prefill", C.AttnConfig(16, 4, 1)), ("decode", None)):
        out, lse, grads = run(L, True, path, cfg)
        assert same_bits(out, ref) and same_bits(lse, ref_lse), (path, cfg)
        for name, a, b in zip(("dq", "dk", "dv"), grads, ref_g):
            assert same_bits(a, b), (name, path, cfg)
    # negative control: scale the unmasked variant's softmax shift and dS (a module copy with the edit)
    edits = {"device": (("        shift = mn\n    alpha = rlk_attn_exp2", "        shift = mn * 1.0001\n    alpha = rlk_attn_exp2"),),
             "portable_backward": (("        ds = tl.where(vis, ds, 0.0)\n    if IEEE:",
                                    "        ds = tl.where(vis, ds, 0.0)\n    else:\n        ds = ds * 1.0001\n    if IEEE:"),)}
    scaled = planted(edits, "attention")
    bad_out, _, bad_g = run(scaled, True, "prefill", C.AttnConfig(16, 4, 1))
    assert not same_bits(bad_out, ref), "planted unmasked-variant change not caught (forward)"
    assert not same_bits(bad_g[0], ref_g[0]), "planted unmasked-variant change not caught (dq)"
    assert same_bits(run(scaled, False)[0], ref)  # the one-run walk never uses the unmasked variant


@interp
@pytest.mark.parametrize("unroll", [2, 4])
@pytest.mark.parametrize("window", [None, 300])  # 300: windows holding up to 4 whole blocks
def test_interpreter_paired_blocks_give_the_same_bits(window, unroll, tuned, planted):
    """``AttnConfig.unroll = 2`` (the unmasked run two blocks per step, ``rlk_attn_pair``) and
    ``unroll = 4`` (four, ``rlk_attn_quad``: one batched score product, the running maxima taken in
    block order) against one block per step, with the three-run walk forced on and 4-block KV
    splits (so splits hold whole and partial unmasked runs, the blocks left over walked by the
    masked run): the train path's rows and lse, and decode steps through the split kernel and
    through the prefill kernel, contiguous and on 16-row pages, raw-bit equal. Negative control:
    a planted step whose second block rescales by the wrong maximum is caught at the unroll
    and unseen at 1 (so the multi-block steps do run here)."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    tuned(split_runs=True, split_blocks=4)
    lens = [448, 3, 200]  # last rows at 447 and 199: odd unmasked runs (3 blocks) in their splits
    q, k, v, cu = make_qkv(lens, 1, 2, 32, "float32", seed=23)
    one, two = C.AttnConfig(16, 4, 1), C.AttnConfig(16, 4, 1, unroll=unroll)
    assert two.key == f"m16_w4_s1_u{unroll}"
    last = torch.tensor([c - 1 for c in accumulate(lens)])
    q_seq, q_pos = torch.arange(3), torch.tensor([n - 1 for n in lens])
    kp, vp = (torch.zeros(64 * 16 * 3, 1, 32) for _ in range(2))
    rows = []
    for i, n in enumerate(lens):  # sequence i's pages: 64 consecutive 16-row pages at 1024·i
        base = 1024 * i
        kp[base : base + n], vp[base : base + n] = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
        rows.append(base + torch.arange(64) * 16)
    caches = ((k, v, cu[:-1].to(torch.int64)[:, None], 1024), (kp, vp, torch.stack(rows), 16))

    def run(mod, cfg):
        # (the train rows through the split kernel: the GPU test; here the decode steps take it)
        got = [*mod.varlen_forward(q, k, v, cu, 0.2, window, config=cfg)[:2]]
        for kk, vv, page_rows, psz in caches:
            for path in ("decode", "prefill"):
                got.append(mod.cached_forward(q[last].contiguous(), kk, vv, page_rows, psz, q_seq, q_pos, 0.2, window,
                                              path=path, config=replace(cfg, block_m=16), decode_only=True))
        return got

    want = run(L, one)
    for a, b in zip(run(L, two), want):
        assert same_bits(a, b)
    if unroll == 2:
        edits = (("    alpha1 = rlk_attn_exp2(mn0 - mn1)\n", "    alpha1 = rlk_attn_exp2(mn0 - mn1) * 1.0001\n"),)
    else:
        edits = (("    a1 = rlk_attn_exp2(mn0 - mn1)\n", "    a1 = rlk_attn_exp2(mn0 - mn1) * 1.0001\n"),)
    wrong_max = planted({"device": edits}, f"unroll{unroll}")
    assert all(same_bits(a, b) for a, b in zip(run(wrong_max, one), want))
    assert not all(same_bits(a, b) for a, b in zip(run(wrong_max, two), want)), "planted pair step not caught"


@interp
@pytest.mark.parametrize("n", [32, 64, 128])
def test_interpreter_rowsum_is_the_cpu_fold(n):
    """``rlk_attn_rowsum`` (rowsum(P) over a 64-key block, ``Σ dO⊙O`` over D) is the CPU
    backend's ``fold_sum`` bit for bit, whatever the tile's row count; the adjacent-pair tree
    (also fixed, not the contract's) is caught by the same comparison (negative control)."""
    from tests.backends.triton.attention._rowsum_probe import rowsum

    g = torch.Generator().manual_seed(n)
    x = torch.randn(64, n, generator=g) * torch.logspace(-6, 6, n)  # wide magnitudes: order shows
    want = fold_sum(x, -1)
    for bm in (16, 64):
        assert same_bits(rowsum(x, bm), want), bm
    assert not same_bits(rowsum(x, 16, adjacent=True), want)


@interp
def test_interpreter_value_slices_give_the_same_bits():
    """``AttnConfig.v_slices``: programs that each accumulate a slice of the value columns (the
    scores and softmax state computed alike in each) give the rows, the fp32 rows and the lse of
    one program per tile — through the prefill kernel (one split, and several splits merged in
    program) and the split kernel + combine, on a contiguous and a paged cache, with and without
    the tile table. Negative control: one perturbed value column moves exactly that column of
    the rows that see it (a slice that read or wrote the wrong columns would move others)."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    base = C.AttnConfig(16, 4, 2)
    q, k, v, cu = make_qkv([40, 3, 20], 1, 2, 32, "float32", seed=12)  # the train path: out, fp32 out, lse
    ref = L.varlen_forward(q, k, v, cu, 0.2, None, config=base)
    for path in ("prefill", "decode"):
        got = L.varlen_forward(q, k, v, cu, 0.2, None, path=path, config=replace(base, v_slices=2))
        assert same_bits(got[0], ref[0]) and same_bits(got[1], ref[1]), path
    with pytest.raises(ValueError, match="v_slices"):
        L.varlen_forward(q, k, v, cu, 0.2, None, config=replace(base, v_slices=4))  # 8-column slices

    lens = [1100, 3, 40]  # the last token of each: two KV splits for the first
    q, k, v, cu = make_qkv(lens, 1, 2, 32, "float32", seed=11)
    last = torch.tensor([c - 1 for c in accumulate(lens)])
    q_seq, q_pos = torch.arange(3), torch.tensor([n - 1 for n in lens])
    contiguous = (k, v, torch.tensor([[0], [1100], [1103]]), 2048)
    npages = sum(-(-n // 16) for n in lens)
    perm = torch.randperm(npages, generator=torch.Generator().manual_seed(3))  # 16-row pages, shuffled
    kp, vp = torch.zeros(npages * 16, 1, 32), torch.zeros(npages * 16, 1, 32)
    rows = []
    for i, n in enumerate(lens):
        pages = perm[sum(-(-m // 16) for m in lens[:i]):][: -(-n // 16)]
        slots = (pages[:, None] * 16 + torch.arange(16)).reshape(-1)[:n]
        kp[slots], vp[slots] = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
        rows.append(torch.cat([pages * 16, torch.zeros(80 - len(pages), dtype=torch.int64)]))
    paged = (kp, vp, torch.stack(rows), 16)

    def step(kk, vv, page_rows, psz, path, vs, one=False, n=3):
        return L.cached_forward(q[last[3 - n :]].contiguous(), kk, vv, page_rows[3 - n :], psz, q_seq[:n],
                                q_pos[3 - n :], 0.2, None, path=path, config=replace(base, v_slices=vs),
                                decode_only=one)

    want = step(*contiguous, "prefill", 1)
    for cache in (contiguous, paged):
        for path, one in (("prefill", False), ("decode", False), ("decode", True)):
            assert same_bits(step(*cache, path, 2, one), want), (cache[3], path, one)
    short = step(k, v, contiguous[2], 64, "decode", 2, one=True, n=2)  # one split: the prefill kernel
    assert same_bits(short, want[1:])
    v2 = v.clone()
    v2[1090, 0, 21] += 0.5  # column 21: the second slice of two
    changed = (step(k, v2, *contiguous[2:], "decode", 2) != want).nonzero().tolist()
    assert changed and {(r, c) for r, _, c in changed} <= {(0, 21)}, changed


@offline_sm90
def test_offline_sm90_decode_kernels_are_pipelined_without_spills():
    """Compiled ahead of time for sm_90 (``benchmarks/profiling/attention_resources_sm90.py``, no
    GPU): every decode split-kernel launch that ``cached_forward`` can select loads its key and
    value blocks through a software pipeline (``cp.async``), the ones of one value slice with at
    most 16 bytes of register spills (what ptxas gives a few variants here; the spills of a few
    bytes move from variant to variant with small code changes, e.g. an 8-byte spill between a
    paired sliced tile and the unpaired table-reading one), and so
    does the single-split prefill kernel (no spills); the train path's
    single-split launch loads them by TMA copies (``cp.async.bulk.tensor``) without spills, the
    rollout prefill by none; every decode launch over a contiguous cache loads its unmasked run by
    TMA copies and its masked blocks by ``cp.async`` (``decode_tma_eligible``), over pages by
    ``cp.async`` only. Negative control: the
    same decode kernel compiled without the argument divisibility a real launch specialises has
    no pipelined loads (what an offline compile without them measures by mistake)."""
    from benchmarks.profiling.attention_resources_sm90 import compile_sm90, variants

    rows = {v.label: (v, compile_sm90(v)) for v in variants(("decode",))}
    # + the four-block tiles, + the one-split steps (prefill kernel: one, two or four blocks a step)
    assert len(rows) == 38 + 8 + 4, sorted(rows)
    for label, (v, r) in rows.items():
        assert r.pipelined, (label, r)
        if "_v" not in label:  # one value slice: a few bytes at most (the 255-register, spilling
            # compile of the negative control below is what this guards against)
            assert r.spill_store_bytes <= 16, (label, r)
    prefill = [v for v in variants(("prefill",)) if v.label.startswith("prefill contiguous") and "multi=False" in v.label]
    r = compile_sm90(prefill[0])
    assert r.pipelined and r.spill_store_bytes == 0 and r.tma_copies == 0, r
    # the train path's launch (Variant.PACKED_TMA): its key / value blocks by TMA copies, no spills
    train = [v for v in variants(("prefill",)) if v.label.startswith("train tma") and "multi=False" in v.label]
    t = compile_sm90(train[0])
    assert t.tma_copies > 0 and t.cp_async == 0 and t.spill_store_bytes == 0, t
    # over a contiguous cache the unmasked run arrives by TMA copies, the masked blocks by cp.async
    for label, (v, r) in rows.items():
        assert (r.tma_copies > 0) == ("contiguous" in label) and r.cp_async > 0, (label, r)
    default = rows["split paged16 m16_w4_s2 one=True"][0]  # pointer loads only
    plain = compile_sm90(default, divisibility=False)
    assert not plain.pipelined, plain


# --------------------------------------------------------------------------- GPU: accuracy and bits across configurations


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lens,hkv,g,d,window,scale",
    [
        ([1, 63, 64, 65, 200], 2, 1, 32, None, None),
        ([300, 17], 2, 4, 64, None, None),
        ([130, 77], 1, 4, 128, 50, 0.3),
        ([1100], 1, 4, 128, None, None),  # crosses a KV split
        ([2100, 5], 2, 1, 64, 1500, None),  # two splits, window across a split boundary
        ([257, 3], 1, 4, 64, 1, None),  # window 1: each query sees only itself
        ([1100, 70], 2, 2, 256, 600, None),  # D = 256 (the portable kernels, one block a step)
    ],
    ids=["ragged", "gqa4", "window50-d128", "split-d128", "2splits-window", "window1", "split-window-d256"],
)
def test_accuracy_forward_and_grads(dtype, lens, hkv, g, d, window, scale):
    from rl_engine.backends.triton.attention import FP32_TRAIN_MAX_HEAD_DIM

    if dtype == "float32" and d == 128 and lens != [1100]:
        d = 64  # fp32 at D = 128 (FMA products, the slowest kernels to compile): the split case only
    q, k, v, cu = make_qkv(lens, hkv, g, d, dtype, seed=sum(lens))
    qq, kk, vv = (t.cuda().requires_grad_() for t in (q, k, v))
    if dtype == "float32" and d > FP32_TRAIN_MAX_HEAD_DIM:
        # no fp32 backward at D = 256 (shared memory): the strict policy names the reason
        with pytest.raises(NoEligibleImplementation, match=f"head_dim {d} in float32 not supported on the train path"):
            varlen_attention(qq, kk, vv, cu.cuda(), scale=scale, window=window)
        return
    with provenance.record() as recs:
        out = varlen_attention(qq, kk, vv, cu.cuda(), scale=scale, window=window)
    assert recs[-1].impl_id == IMPL
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(up.cuda())
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = varlen_attention_f64(q64, k64, v64, cu, scale, window)
    ref.backward(up.double())
    op = OPS[0]
    fwd = contracts.tolerance(op, q.dtype, "forward")
    bwd = contracts.tolerance(op, q.dtype, "backward")
    assert out.dtype == q.dtype and out.shape == q.shape
    assert fwd.check(out.detach().cpu(), ref), fwd.max_violation(out.detach().cpu(), ref)
    worst = {"out": fwd.max_violation(out.detach().cpu(), ref)}
    for name, got, want in (("dq", qq.grad, q64.grad), ("dk", kk.grad, k64.grad), ("dv", vv.grad, v64.grad)):
        assert got.dtype == q.dtype, name
        worst[name] = bwd.max_violation(got.cpu(), want)
        assert bwd.check(got.cpu(), want), (name, worst[name])
    evidence(f"attention_accuracy_{dtype}_{'-'.join(map(str, lens))}_g{g}_d{d}", worst)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 300])
def test_split_merge_specialisation_gives_the_same_bits(dtype, window):
    """Sequences of at most 1024 tokens, more than 1024 packed: the forward compiled without the
    KV-split merge (``max_seqlen`` known, what the registered op passes) and with it (bound = the
    token count) give raw-bit equal ``out``, ``lse`` and fp32 output, on every row."""
    from rl_engine.backends.triton.attention import launch as L

    lens = [1024, 700, 1, 333]
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, 2, 4, 128, dtype, seed=41))
    with_merge = L.varlen_forward(q, k, v, cu, 0.09, window)
    without = L.varlen_forward(q, k, v, cu, 0.09, window, max_seqlen=max(lens))
    for name, a, b in zip(("out", "lse", "out_f32"), with_merge, without):
        assert same_bits(a, b), (name, same_bits(a, b))
    # the registered op picks the specialisation itself
    out = varlen_attention(q, k, v, cu, scale=0.09, window=window)
    assert same_bits(out, with_merge[0])


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("g", [1, 4])
def test_every_shipped_config_and_path_gives_the_same_rows(dtype, d, g):
    """Kernel level: the varlen rows (prefill config) against the decode path, the prefill path
    with every shipped and a few extra BLOCK_M / warp configurations, at a context with three
    KV splits; plus each row computed alone (a 1-row batch) on both paths."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    dt = getattr(torch, dtype)
    q, k, v, cu = (t.cuda() for t in make_qkv([2085, 300, 1], 2, g, d, dtype, seed=d + g))
    scale = d**-0.5
    ref, ref_lse, _ = L.varlen_forward(q, k, v, cu, scale, None)
    # the shipped configs on both paths; the benchmark candidates (any may be shipped next) and
    # two extra tiles on the path they are candidates for
    # (the value slicings of the few-programs tiles: test_value_slices_give_the_same_rows)
    shipped = {c for c in C.shipped_forward_configs(dt, d) if c.v_slices == 1}
    runs = {(c, p) for c in shipped for p in ("prefill", "decode")}
    extra = (C.AttnConfig(16, 4, 2), C.AttnConfig(32, 4, 2))
    runs |= {(c, "prefill") for c in (*C.CANDIDATE_CONFIGS["prefill"], *extra)}
    runs |= {(c, "decode") for c in C.CANDIDATE_CONFIGS["decode"]}
    if dt == torch.float32:  # fp32 tiles are 2x the bytes: keep to what fits in shared memory
        runs = {(c, p) for c, p in runs if c in shipped or (c.block_m <= 64 and c.num_stages <= 2)}
    if d == 256:  # a stage of a 64-key block's keys and values is 64 KiB at 16 bits, 128 KiB in fp32
        stage = 2 * 64 * d * dt.itemsize
        runs = {(c, p) for c, p in runs
                if c in shipped or (c.block_m <= 64 and c.num_stages * c.unroll * stage <= 128 * 1024)}
    seen = []
    for cfg, path in sorted(runs, key=lambda r: (r[0].key, r[1])):
        out, lse, _ = L.varlen_forward(q, k, v, cu, scale, None, path=path, config=cfg)
        assert same_bits(out, ref), (cfg.key, path, same_bits(out, ref))
        assert same_bits(lse, ref_lse), (cfg.key, path)
        seen.append(f"{cfg.key}/{path}")
    for t in (0, 1023, 1024, 2084, 2085 + 299, 2385):  # single rows through the cached entry, both paths
        n = t + 1 if t < 2085 else (t - 2085 + 1 if t < 2385 else 1)
        start = t + 1 - n
        kk, vv = k[start : t + 1].contiguous(), v[start : t + 1].contiguous()
        page_rows = torch.zeros((1, 1), dtype=torch.int64, device="cuda")
        for path in ("prefill", "decode"):
            o = L.cached_forward(q[t : t + 1].contiguous(), kk, vv, page_rows, 1 << 20,
                                 torch.zeros(1, dtype=torch.int64, device="cuda"),
                                 torch.tensor([n - 1], device="cuda"), scale, None, path=path)
            assert same_bits(o, ref[t : t + 1]), (t, path)
    evidence(f"attention_configs_{dtype}_d{d}_g{g}", {"compared_equal": seen})


@gpu
@pytest.mark.parametrize("dtype,d,g,window", [("bfloat16", 128, 4, None), ("bfloat16", 64, 1, 300),
                                              ("float16", 128, 4, 300)])
def test_paired_blocks_give_the_same_rows(dtype, d, g, window):
    """``AttnConfig.unroll = 2`` (``rlk_attn_pair``) and ``unroll = 4`` (``rlk_attn_quad``: the
    batched score product, four key blocks a TMA copy over a contiguous cache) on the H200: the
    train path's rows and lse on both paths, and decode steps (one token per sequence, split
    kernel and combine; two blocks a step on 16- and 64-row tiles over a contiguous cache, four
    on the 16-row tile with 1, 2 and 4 value slices, contiguous and on shuffled 16-row pages)
    over sequences of 2085 (three KV splits), 300 and 1 tokens, raw-bit equal to one block per
    step. Negative control: a perturbed visible key changes the paired rows of its sequence."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    lens = [2085, 300, 1]
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, 2, g, d, dtype, seed=7 * d + g))
    scale = d**-0.5
    last = torch.tensor([c - 1 for c in accumulate(lens)], device="cuda")
    q_seq = torch.arange(3, device="cuda")
    q_pos = torch.tensor([n - 1 for n in lens], device="cuda")
    rows = cu[:-1].to(torch.int64)[:, None].contiguous()
    # the 16-row pages: sequence i's positions at 4096·i + page-permuted rows
    pages = torch.randperm(3 * 256, generator=torch.Generator().manual_seed(d)).view(3, 256).cuda() * 16
    kp, vp = (torch.zeros(3 * 4096, t.shape[1], d, dtype=t.dtype, device="cuda") for t in (k, v))
    for i, n in enumerate(lens):
        at = pages[i, torch.arange(n, device="cuda") // 16] + torch.arange(n, device="cuda") % 16
        kp[at], vp[at] = k[cu[i]:cu[i + 1]], v[cu[i]:cu[i + 1]]
    caches = ((k, v, rows, 4096), (kp, vp, pages.contiguous(), 16))
    for base in (C.select_prefill(q.dtype, d), C.AttnConfig(16, 4, 3), C.AttnConfig(64, 4, 2)):
        for u in (2, 4) if base.block_m == 16 else (2,):  # four blocks a step: 16-row tiles
            paired = replace(base, unroll=u)
            for path in ("prefill", "decode"):
                a = L.varlen_forward(q, k, v, cu, scale, window, path=path, config=base)
                b = L.varlen_forward(q, k, v, cu, scale, window, path=path, config=paired)
                assert same_bits(a[0], b[0]) and same_bits(a[1], b[1]), (base.key, u, path)
    steps = [(bm, vs, 2, caches[:1]) for vs in (1, 2) for bm in (16, 64)]
    steps += [(16, vs, 4, caches) for vs in (1, 2, 4)]
    for bm, vs, u, cached in steps:
        one, two = C.AttnConfig(bm, 4, 3, v_slices=vs), C.AttnConfig(bm, 4, 3, v_slices=vs, unroll=u)
        for (kk, vv, pr, psz), path in product(cached, ("decode", "prefill")):
            a, b = (L.cached_forward(q[last].contiguous(), kk, vv, pr, psz, q_seq, q_pos, scale, window,
                                     path=path, config=c, decode_only=True) for c in (one, two))
            assert same_bits(a, b), (bm, vs, u, psz, path)
    k2 = k.clone()
    k2[2000, 1, 3] += 0.5
    paired = replace(C.select_prefill(q.dtype, d), unroll=2)
    base = L.varlen_forward(q, k, v, cu, scale, window, config=paired)[0]
    moved = L.varlen_forward(q, k2, v, cu, scale, window, config=paired)[0]
    assert not same_bits(moved[:2085], base[:2085]) and same_bits(moved[2085:], base[2085:])


@gpu
@pytest.mark.parametrize("dtype,d,g,window", [("bfloat16", 128, 4, None), ("bfloat16", 64, 1, 300),
                                              ("float16", 128, 4, None), ("float32", 128, 4, None),
                                              ("bfloat16", 256, 2, None)])
def test_tma_loads_give_the_same_rows(dtype, d, g, window):
    """``AttentionTuning.tma_loads`` (on by default) on the H200: the train path's forward with its key / value blocks
    copied by TMA (``tma_eligible``) gives the rows, lse and fp32 rows of the pointer loads, over
    sequences of 2085 (three KV splits merged), 300 and 1 tokens, and the first sequence's rows
    beside a next sequence of large values equal its rows alone (the copies read past a
    sequence's end unclamped; those keys are masked). Negative control: a visible key perturbed
    changes the TMA rows of its sequence and no other."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, cu = (t.cuda() for t in make_qkv([2085, 300, 1], 2, g, d, dtype, seed=5 * d + g))
    k[2085:2385] *= 8
    v[2085:2385] *= 8
    scale = d**-0.5
    with attention_tuning(tma_loads=False):
        plain = L.varlen_forward(q, k, v, cu, scale, window)
    assert E.tma_eligible(q, k, v, C.select_prefill(q.dtype, d))  # on by default on sm90
    tma = L.varlen_forward(q, k, v, cu, scale, window)
    alone = L.varlen_forward(q[:2085].contiguous(), k[:2085].contiguous(), v[:2085].contiguous(), cu[:2], scale,
                             window)
    k2 = k.clone()
    k2[1500, 1, 7] += 0.5
    perturbed = L.varlen_forward(q, k2, v, cu, scale, window)
    for a, b, name in zip(tma, plain, ("out", "lse", "out_f32")):
        assert same_bits(a, b), name
    assert same_bits(alone[0], tma[0][:2085]) and same_bits(alone[1], tma[1][:2085])
    assert not same_bits(perturbed[0][:2085], tma[0][:2085]) and same_bits(perturbed[0][2085:], tma[0][2085:])


@gpu
@pytest.mark.parametrize(  # each head dim and group size on each dtype, not every product (compile time)
    "dtype,d,g", [("float32", 32, 1), ("float32", 64, 4), ("float32", 128, 4), ("bfloat16", 32, 4),
                  ("bfloat16", 64, 1), ("bfloat16", 128, 1), ("bfloat16", 128, 4), ("bfloat16", 256, 2)])
def test_value_slices_give_the_same_rows(dtype, d, g, monkeypatch):
    """``AttnConfig.v_slices`` on the GPU: every value slicing of the few-programs decode tiles
    (``shipped_forward_configs``), and the many-programs decode tiles sliced in two and four (the
    benchmark's batch-64 rows), give the varlen rows and lse on both kernels, at a context of
    three KV splits; a batch-1 decode step with the automatic selection (``AttentionTuning.auto_value_slices``, on
    by default) picks a slicing > 1 (head dims of 64 and 128) on a contiguous and on a 16-token
    paged cache and gives the row. Negative
    control: a value column doubled doubles exactly that output column, bit for bit."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    dt = getattr(torch, dtype)
    q, k, v, cu = (t.cuda() for t in make_qkv([2085, 300, 1], 2, g, d, dtype, seed=3 * d + g))
    scale = d**-0.5
    ref, ref_lse, _ = L.varlen_forward(q, k, v, cu, scale, None)
    # every valid slicing (16 columns or more) of the few-programs tiles: the benchmark's @v rows;
    # the shipped list holds those the rule can pick (at most 4 slices of at least 32 columns)
    multi = C.multi_block_steps(d)  # D = 256 walks one block a step
    few = [replace(C.select_decode(dt, d, page, few=True), unroll=u) for page in (None, 16)
           for u in ((1, 2) if multi else (1,))]
    few += [C.quad_tile(c) for c in few if c.unroll == 1 and multi]  # pair_blocks, quad_blocks
    sliced = [replace(c, v_slices=v) for c in few for v in (2, 4, 8) if d // v >= 16]
    shipped = {c for c in C.shipped_forward_configs(dt, d) if c.v_slices > 1}
    assert shipped <= set(sliced)
    assert {c.v_slices for c in shipped} == {v for v in (2, 4, 8) if v <= C.MAX_V_SLICES and d // v >= C.MIN_V_COLUMNS}
    # the many-programs decode tiles sliced as the benchmark times them (rows @v2, @v4 at batch 64)
    sliced += [replace(C.select_decode(dt, d, page), v_slices=v) for page in (None, 16) for v in (2, 4) if d // v >= 16]
    sliced = list(dict.fromkeys(sliced))
    for cfg in sliced:
        for path in ("prefill", "decode"):
            out, lse, _ = L.varlen_forward(q, k, v, cu, scale, None, path=path, config=cfg)
            assert same_bits(out, ref) and same_bits(lse, ref_lse), (cfg.key, path, same_bits(out, ref))
    chosen = []
    rule = C.value_slices
    monkeypatch.setattr(C, "value_slices", lambda *a, **kw: chosen.append(rule(*a, **kw)) or chosen[-1])
    t = 2084  # the last token of the first sequence: one step of batch 1
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    pages = torch.randperm(131, generator=torch.Generator().manual_seed(d)).cuda()  # 16-row pages, shuffled
    slots = (pages[:, None] * 16 + torch.arange(16, device="cuda")).reshape(-1)[: t + 1]
    kp, vp = torch.zeros((131 * 16, 2, d), dtype=dt, device="cuda"), torch.zeros((131 * 16, 2, d), dtype=dt, device="cuda")
    kp[slots], vp[slots] = k[: t + 1], v[: t + 1]
    caches = {"contiguous": (k, v, zero[:, None], 4096), "paged16": (kp, vp, (pages * 16)[None, :], 16)}
    with attention_tuning(auto_value_slices=True):
        for name, (kk, vv, page_rows, psz) in caches.items():
            chosen.clear()
            o = L.cached_forward(q[t : t + 1].contiguous(), kk, vv, page_rows, psz, zero, zero + t, scale, None,
                                 decode_only=True)
            # 1 sequence x 2 kv heads x 3 splits = 6 programs: sliced unless a slice would be < 32 columns
            assert chosen and (chosen[-1] > 1) == (d >= 2 * C.MIN_V_COLUMNS), (name, chosen)
            assert same_bits(o, ref[t : t + 1]), (name, chosen)
        v2 = v.clone()
        v2[:, :, d - 1] *= 2  # the last value column doubled (exactly): the last slice's
        o = L.cached_forward(q[t : t + 1].contiguous(), k, v2, zero[:, None], 4096, zero, zero + t, scale, None,
                             decode_only=True)
    changed = (o != ref[t : t + 1]).nonzero().tolist()
    assert changed and {c for _, _, c in changed} == {d - 1}, changed
    assert same_bits(o[..., d - 1], 2 * ref[t : t + 1, :, d - 1])


@gpu
@pytest.mark.parametrize("dtype,d,g,window", [("bfloat16", 128, 4, None), ("bfloat16", 64, 1, 300),
                                              ("bfloat16", 32, 2, None), ("bfloat16", 256, 2, None)])
def test_decode_tma_loads_give_the_same_rows(dtype, d, g, window, monkeypatch, tuned):
    """Decode steps over a contiguous cache (``decode_tma_eligible``: on by default on the H200)
    load the blocks every row of a tile sees by TMA copies and the masked blocks by clamped
    pointer loads: over a cache whose slots past each sequence's end hold NaN, the decode step of
    each sequence's last token gives the varlen rows bit for bit, and the rows of the same step
    with ``attention_tuning(decode_tma_loads=False)``, at three KV splits (split kernel), one split (prefill
    kernel) and one key — with every decode tile, value slicing and blocks-per-step choice
    ``shipped_forward_configs`` lists, and the automatic choice (which takes the copies).
    Negative control: one key in the first sequence's unmasked run perturbed moves that row."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    dt = getattr(torch, dtype)
    lens = [2085, 300, 1]
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, 2, g, d, dtype, seed=7 * d + g))
    scale = d**-0.5
    ref, _, _ = L.varlen_forward(q, k, v, cu, scale, window)
    last = cu[1:] - 1
    kc = torch.full((3 * 4096, 2, d), float("nan"), dtype=dt, device="cuda")
    vc = torch.full((3 * 4096, 2, d), float("nan"), dtype=dt, device="cuda")
    for i, n in enumerate(lens):
        kc[i * 4096 : i * 4096 + n], vc[i * 4096 : i * 4096 + n] = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
    regions = torch.arange(3, device="cuda")[:, None] * 4096
    q_seq = torch.arange(3, device="cuda")
    q_pos = torch.tensor([n - 1 for n in lens], device="cuda")
    flags = []
    attend = L.attend
    monkeypatch.setattr(L, "attend", lambda *a, **kw: flags.append(kw["variant"] is Variant.CACHE_TMA) or attend(*a, **kw))

    def step(cfg=None, kk=kc, n=3, bound=4096):
        return L.cached_forward(q[last[3 - n :]].contiguous(), kk, vc, regions[3 - n :], bound, q_seq[:n],
                                q_pos[3 - n :], scale, window, path="decode", config=cfg, decode_only=True)

    assert E.decode_tma_eligible(kc, vc, False, q.device)
    tuned(wgt_decode=False)  # the Triton kernels' copies (the transposed kernel's band)
    cfgs = [None] + [c for c in C.shipped_forward_configs(dt, d) if c.block_m == 16]
    for cfg in cfgs:
        with attention_tuning(decode_tma_loads=False):
            plain = step(cfg)
        got = step(cfg)
        assert flags[-2:] == [False, True]
        assert same_bits(got, ref[last]) and same_bits(got, plain), (cfg, same_bits(got, ref[last]))
    assert same_bits(step(None, n=2, bound=1024), ref[last[1:]]) and flags[-1]  # one split: the prefill kernel
    k2 = kc.clone()
    k2[2000, 1, 3] += 0.5  # kv head 1, an unmasked block of the first sequence (inside the window)
    moved = step(None, kk=k2)
    assert not same_bits(moved[:1], ref[last[:1]]) and same_bits(moved[1:], ref[last[1:]])


@gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "pages16"])
@pytest.mark.parametrize("batch", [1, 40])
def test_split_grid_orders_give_the_same_rows_on_gpu(batch, paged):
    """Every order of the split kernel's grid (``AttentionTuning.split_grid``: tiles, kv heads or splits
    fastest, and the ``auto`` rule) gives the same decode rows, raw bits, on the device: one
    sequence (fewer (sequence, kv head) pairs than SMs: the few-programs tile with value slices
    and four blocks a step) or 40 (160 pairs: the many-programs tile), 1100-3000 keys (2-3 KV
    splits, the combine's groups of 2 and 4), bf16, D = 128, over a contiguous cache or 16-token
    pages in shuffled order. Negative control: a perturbed visible key moves the rows."""
    from rl_engine.backends.triton.attention import launch as L

    gen = torch.Generator().manual_seed(50 + batch)
    hkv, g, d, ps = 4, 4, 128, 16
    lens = torch.randint(1100, 3001, (batch,), generator=gen)
    lens[0] = 3000
    cap = 3008  # 188 pages of 16 rows per sequence
    kc = torch.randn((batch * cap, hkv, d), generator=gen).to(torch.bfloat16).cuda()
    vc = torch.randn((batch * cap, hkv, d), generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn((batch, hkv * g, d), generator=gen).to(torch.bfloat16).cuda()
    q_seq, q_pos = torch.arange(batch).cuda(), (lens - 1).cuda()
    if paged:
        pages = torch.randperm(batch * cap // ps, generator=gen).cuda()
        rows, size = (pages.view(batch, cap // ps) * ps).contiguous(), ps
    else:
        rows, size = (torch.arange(batch) * cap).cuda()[:, None].contiguous(), cap

    def step(k):
        return L.cached_forward(q, k, vc, rows, size, q_seq, q_pos, d**-0.5, None, path="decode", decode_only=True)

    want = step(kc)
    for order in ("tiles", "heads", "splits", "auto"):
        with attention_tuning(split_grid=order):
            assert same_bits(step(kc), want), order
    k2 = kc.clone()
    at = (rows[0, 0] + 5) if paged else rows[0, 0] + 2000  # a key that sequence 0's query sees
    k2[at, 0] += 0.5
    moved = step(k2)
    assert not same_bits(moved[0], want[0]) and (batch == 1 or same_bits(moved[1:], want[1:]))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 300])
def test_unmasked_interior_blocks_give_the_same_bits(dtype, window):
    """The block walk with unmasked interior blocks (three runs, the 16-bit default) against
    every block masked (one run, the fp32 default), forced both ways on the device: forward on
    both paths and dq/dk/dv raw-bit equal (the kernels are compiled without fp contraction, so
    leaving the identity masks out changes no rounding)."""
    from rl_engine.backends.triton.attention import launch as L

    # fp32 at head dim 32: the forced three-run walk compiles the IEEE (FMA) products of every
    # kernel once more, which at D = 128 takes minutes (D = 128 fp32 is covered by the tests above)
    d = 32 if dtype == "float32" else 128
    q, k, v, cu = (t.cuda() for t in make_qkv([1100, 130, 1], 2, 4, d, dtype, seed=31))
    scale = d**-0.5
    up = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype).cuda()
    res = {}
    for force in (False, True):
        with attention_tuning(split_runs=force):
            outs = [L.varlen_forward(q, k, v, cu, scale, window, path=p) for p in ("prefill", "decode")]
            out, lse, out32 = outs[0]
            res[force] = (out, lse, outs[1][0], outs[1][1],
                          *L.varlen_backward(up, q, k, v, out32 if out32.numel() else out, lse, cu, scale, window))
    names = ("out", "lse", "decode out", "decode lse", "dq", "dk", "dv")
    for name, a, b in zip(names, res[False], res[True]):
        assert same_bits(a, b), (name, same_bits(a, b))
    assert same_bits(res[True][2], res[True][0])
