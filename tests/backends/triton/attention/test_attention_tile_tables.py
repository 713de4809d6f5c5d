"""The query-tile tables (``tile_tables``: ``rlk_attn_tiles``, ``rlk_attn_varlen_tiles``; their
definition ``launch.tile_table``) and the steps that go without one: the one-launch tables build
the torch table's integers; a decode step of one token per sequence forms its tile rows from
``q_pos`` (``AttentionTuning.tile_free_rows`` scopes the choice); and on the GPU the kernels that
read a table under programmatic dependent launch wait for it (a slowed table kernel and a planted
copy without the wait are the negative control).
"""

from __future__ import annotations

import random
from itertools import accumulate

import pytest
import torch

from rl_engine.backends.triton.attention.tuning import attention_tuning, current_tuning
from rl_engine.utils.bits import same_bits
from tests.backends.triton.attention._attention_common import (
    assert_pdl_race_caught,
    gpu,
    graph_replay,
    interp,
    make_qkv,
)


@interp
def test_interpreter_varlen_tiles_equal_the_torch_table():
    """``varlen_tiles`` (one launch from ``cu_seqlens``) builds the integers of
    ``tile_table(*varlen_rows(cu_seqlens), ...)``: empty sequences anywhere, more sequences than
    one 32-sequence chunk and more tiles than one 128-row program, int32 and int64 offsets,
    several G / BLOCK_M, padding rows included; a moved boundary is seen (negative control)."""
    from rl_engine.backends.triton.attention import launch as L

    rng = random.Random(7)
    for B in (1, 2, 5, 70):
        lens = [rng.choice([0, 1, 3, 16, 17, 64, 130]) for _ in range(B)]
        lens[rng.randrange(B)] = max(lens[0], 1)
        for dt in (torch.int32, torch.int64):
            cu = torch.tensor([0, *accumulate(lens)], dtype=dt)
            T = int(cu[-1])
            for g, bm in ((1, 16), (4, 16), (2, 64), (4, 128)):
                want = L.tile_table(*L.varlen_rows(cu), g, bm, T)
                assert torch.equal(L.varlen_tiles(cu, g, bm, T), want), (B, dt, g, bm)
    moved = cu.clone()
    moved[1] += 1  # the first sequence takes a token of the second
    assert not torch.equal(L.varlen_tiles(moved, 4, 128, T), want)


@interp
def test_interpreter_rollout_tiles_equal_the_torch_table():
    """``rollout_tiles`` (one launch) builds the integers of ``tile_table(cached_rows(...))``:
    empty sequences, more sequences than one 64-lane chunk, one to three rounds of the 16-ary
    search, several G / BLOCK_M; a shifted
    position (another ``pos_base``) is seen by the same comparison (negative control)."""
    from rl_engine.backends.triton.attention import launch as L

    rng = random.Random(5)
    for B in (1, 3, 150):
        counts = [rng.choice([0, 1, 1, 2, 9, 33]) for _ in range(B)]
        counts[-1] = max(counts[-1], 1)
        q_seq = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
        q_pos = torch.cat([torch.arange(c) + rng.randint(0, 300) for c in counts])
        for g, bm in ((1, 16), (4, 16), (2, 64), (8, 128)):
            want = L.tile_table(*L.cached_rows(q_seq, q_pos, B), g, bm, q_seq.numel())
            assert torch.equal(L.rollout_tiles(q_seq, q_pos, B, g, bm), want), (B, g, bm)
    shifted = q_pos.clone()
    shifted[-1] += 1  # the last sequence's first row moves: its pos_base changes
    shifted[q_seq == q_seq[-1]] = shifted[-1] - (q_seq == q_seq[-1]).sum() + 1 + torch.arange(counts[-1])
    assert not torch.equal(L.rollout_tiles(q_seq, shifted, B, 2, 64), want)


@interp
def test_interpreter_forced_tile_free_rows_is_scoped(monkeypatch):
    """``attention_tuning(tile_free_rows=False)``: inside the block a decode-only step over a
    contiguous cache of 2 KV splits launches the tile table that ``tile_free_rows`` leaves out, with
    the same bits; ``attention_tuning(tile_free_rows=True)`` leaves it out; the rule is back after
    each block, an exception included. Negative control: the table launches are counted, so a block that changed nothing
    would be caught."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    n = 1100
    q, k, v, _ = make_qkv([n], 1, 2, 32, "float32", seed=14)
    args = (q[n - 1 :].contiguous(), k, v, torch.zeros((1, 1), dtype=torch.int64), 2048, torch.zeros(1, dtype=torch.int64),
            torch.tensor([n - 1]), 0.2, None)
    tables = []
    build = L.rollout_tiles
    monkeypatch.setattr(L, "rollout_tiles", lambda *a: tables.append(1) or build(*a))
    assert C.tile_free_rows()
    free = L.cached_forward(*args, path="decode", decode_only=True)
    assert tables == []
    with attention_tuning(tile_free_rows=False):
        assert not C.tile_free_rows()
        kept = L.cached_forward(*args, path="decode", decode_only=True)
    assert tables == [1] and same_bits(free, kept)
    with attention_tuning(tile_free_rows=True):
        assert C.tile_free_rows()
        L.cached_forward(*args, path="decode", decode_only=True)
    assert tables == [1]
    with pytest.raises(RuntimeError, match="boom"):
        with attention_tuning(tile_free_rows=False):
            raise RuntimeError("boom")
    assert current_tuning().tile_free_rows is None and C.tile_free_rows()


@gpu
def test_programmatic_dependent_launch_gives_the_same_bits(planted):
    """The attention kernels launched with programmatic dependent launch (each starts while the
    tile-table / split kernel before it runs, and waits on the device before its first load) give
    the rows of plain launches — varlen prefill (out, lse), rollout prefill, decode over three KV
    splits (split kernel + combine) — eager and replayed from a CUDA graph. Negative control: with
    a tile-table kernel made slow (and its table pre-filled with -1), the attention kernels stay
    right while they wait and are caught when a planted copy skips the wait (a race, so within
    twenty tries: the GPU can run the two kernels apart in a try)."""
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    dev = torch.device("cuda")
    assert E.use_pdl(dev), "programmatic dependent launch is expected on an sm90 device"
    lens = [2085, 300, 1]
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, 2, 4, 64, "bfloat16", seed=17))
    B, scale = len(lens), 64**-0.5
    starts = cu[:-1].to(torch.int64)
    page_rows = starts[:, None].contiguous()  # contiguous rows of each sequence in the packed k / v
    q_seq = torch.repeat_interleave(torch.arange(B, device="cuda"), torch.tensor(lens, device="cuda"))
    q_pos = torch.arange(q.shape[0], device="cuda") - starts[q_seq]
    last = (cu[1:] - 1).to(torch.int64)
    qd = q[last].contiguous()
    d_seq, d_pos = torch.arange(B, device="cuda"), torch.tensor(lens, device="cuda") - 1  # (no copies while capturing)

    def calls(mod):
        return {
            "varlen": lambda: mod.varlen_forward(q, k, v, cu, scale, None)[:2],
            "rollout prefill": lambda: mod.cached_forward(q, k, v, page_rows, 4096, q_seq, q_pos, scale, None,
                                                          path="prefill"),
            "decode": lambda: mod.cached_forward(qd, k, v, page_rows, 4096, d_seq, d_pos, scale, None, path="decode"),
        }

    def flat(x):
        return x if isinstance(x, tuple) else (x,)

    with attention_tuning(pdl=False):
        assert not E.use_pdl(dev)
        plain = {name: flat(fn()) for name, fn in calls(L).items()}
    for name, fn in calls(L).items():
        for how, got in (("eager", flat(fn())), ("graph", flat(graph_replay(fn)))):
            for a, b in zip(got, plain[name]):
                assert same_bits(a, b), (name, how, same_bits(a, b))
    # negative control: a slow table kernel (a chain of 4000 dependent loads of q_seq[0] = 0, which
    # every write of the table depends on through T) over a table pre-filled with -1 (rows that
    # no program reads as work)
    slow = {"launch": (("    tab = torch.empty((nt, 4), dtype=torch.int64, device=q_seq.device)\n    radix, rounds",
                        "    tab = torch.full((nt, 4), -1, dtype=torch.int64, device=q_seq.device)\n    radix, rounds"),),
            "tile_tables": (("    rlk_attn_gdc_launch(PDL)  # the attention kernel may launch (it waits for this kernel's end)\n"
                             "    offs = tl.arange(0, CHUNK)\n",
                             "    rlk_attn_gdc_launch(PDL)  # the attention kernel may launch (it waits for this kernel's end)\n"
                             "    spin = tl.zeros([], tl.int64)\n    for _ in range(0, 4000):\n"
                             "        spin += tl.load(q_seq_ptr + spin, volatile=True)\n    T = T + spin.to(tl.int32)\n"
                             "    offs = tl.arange(0, CHUNK)\n"),)}
    no_wait = {"device": (("    if PDL:\n        tl.extra.cuda.gdc_wait()", "    if PDL:\n        pass"),)}
    waits = planted(slow, "pdl_slow")
    skips = planted({**slow, **no_wait}, "pdl_nowait")
    for name in ("rollout prefill", "decode"):
        assert_pdl_race_caught(calls(waits)[name], calls(skips)[name], lambda out: out, plain[name][0], name)
