"""The split-KV combine of decode steps (``split_kv_combine.rlk_attn_combine``) and the split size
every kernel shares: a decode step through the split kernel and the combine gives the prefill
kernel's in-program merge, bit for bit, whatever the combine's group size, past its group of
sixteen splits, with or without the tile table.

Triton-interpreter subset (``TRITON_INTERPRET=1``, CPU tensors, small shapes, D = 32, fp32) with
small KV splits (``AttentionTuning.split_blocks``); GPU: up to 18 KV splits, contiguous and paged.
"""

from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from rl_engine.backends.triton.attention.tuning import attention_tuning
from rl_engine.utils.bits import same_bits
from tests.backends.triton.attention._attention_common import (
    DTYPES,
    GARBAGE,
    gpu,
    interp,
    last_token_step,
    make_qkv,
)


@interp
def test_interpreter_split_size_is_one_constant_of_every_kernel():
    """The KV split size is the one value ``AttentionTuning.split_blocks`` that the prefill kernel,
    the split kernel and the combine all read (a ``tl.constexpr`` of each launch): with 2-block
    (128-key) splits, the train path's rows, a decode step through the split kernel and the
    combine, and the same step through the prefill kernel are raw-bit equal. Negative control:
    the contract's 16-block splits give other bits for rows past 128 keys, so the value is used."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    n = 300
    q, k, v, cu = make_qkv([n], 1, 2, 32, "float32", seed=21)
    args = (q[n - 2:].contiguous(), k, v, torch.zeros((1, 1), dtype=torch.int64), n, torch.zeros(2, dtype=torch.int64),
            torch.tensor([n - 2, n - 1]), 0.2, None)
    shipped, _, _ = L.varlen_forward(q, k, v, cu, 0.2, None)
    with attention_tuning(split_blocks=2):
        assert C.num_splits(n) == 3
        out, _, _ = L.varlen_forward(q, k, v, cu, 0.2, None)
        for path in ("decode", "prefill"):  # decode: 3 splits, rlk_attn_fwd_split + rlk_attn_combine
            assert same_bits(L.cached_forward(*args, path=path), out[n - 2:]), path
    assert same_bits(out[:128], shipped[:128])  # one split either way
    assert not same_bits(out[128:], shipped[128:])


@interp
def test_interpreter_combine_group_size_does_not_change_the_bits(monkeypatch, tuned, planted):
    """``rlk_attn_combine`` loads ``combine_group(splits)`` splits per trip before merging them
    (the launch's split count rounded up to a power of two, at most 16); splits past a tile's
    last merge as exact identities, so the group size cannot change a row. With 1-block (64-key)
    splits, a decode step of three sequences over 1, 3 and 5 splits (the launch's bound: 5, the
    shipped group 8) gives the prefill kernel's rows with every group size forced: 1, 2, 4, 8 and
    16 (several trips, a partly used trip, one trip with identities). Negative control: a planted
    combine that stops after its first trip is caught at group 2."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    assert [C.combine_group(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 16, 16]
    with pytest.raises(ValueError, match="splits: expected at least 1"):
        C.combine_group(0)
    args = last_token_step(1, seed=41)
    tuned(split_blocks=1)
    assert C.num_splits(320) == 5 and C.combine_group(5) == 8
    want = L.cached_forward(*args, path="prefill")
    for group in (1, 2, 4, 8, 16):
        monkeypatch.setattr(C, "combine_group", lambda splits, g=group: g)
        assert same_bits(L.cached_forward(*args, path="decode"), want), group
    first_trip = planted({"split_kv_combine": (("        for j in range(0, n, GROUP):",
                                                "        for j in range(0, GROUP, GROUP):"),)}, "combine_first_trip")
    monkeypatch.setattr(C, "combine_group", lambda splits: 2)
    got = first_trip.cached_forward(*args, path="decode")
    assert same_bits(got[0], want[0]) and not same_bits(got[2], want[2])  # 1 split: right; 5: caught


@interp
def test_interpreter_decode_step_without_tile_table_and_long_combine():
    """A decode step with one token per sequence (``decode_only``: the kernels form their tile
    rows from ``q_pos``, no tile table) gives the rows of the tile-table launch and of the
    varlen rows, through the prefill kernel (one split) and through the split kernel + combine;
    a 17-split context (16484 keys) folds across the combine's group of sixteen splits and equals
    the prefill kernel's in-program merge. Negative controls: a position shifted by one under
    ``decode_only`` (a wrong tile row) and one perturbed key in the seventeenth split are caught."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    lens = [50, 1, 30]
    q, k, v, cu = make_qkv(lens, 1, 2, 32, "float32", seed=6)
    out, _, _ = L.varlen_forward(q, k, v, cu, 0.2, None)
    last = torch.tensor([c - 1 for c in accumulate(lens)])
    q_seq, q_pos = torch.arange(3), torch.tensor([n - 1 for n in lens])
    page_rows = torch.tensor([[0], [50], [51]])  # a contiguous (packed) cache: one column
    for bound in (64, 2048):  # 2048: the split kernel and the combine
        kk = torch.cat([k, torch.full((bound, 1, 32), GARBAGE)])
        vv = torch.cat([v, torch.full((bound, 1, 32), -GARBAGE)])
        rows = {one: L.cached_forward(q[last].contiguous(), kk, vv, page_rows, bound, q_seq, q_pos, 0.2, None,
                                      path="decode", decode_only=one) for one in (False, True)}
        assert same_bits(rows[True], out[last]) and same_bits(rows[False], out[last]), bound
        wrong = L.cached_forward(q[last].contiguous(), kk, vv, page_rows, bound, q_seq, q_pos - (q_pos > 0).long(),
                                 0.2, None, path="decode", decode_only=True)
        assert not same_bits(wrong, out[last]), bound
    with pytest.raises(ValueError, match="decode_only"):
        L.cached_forward(q[:4].contiguous(), k, v, page_rows, 64, torch.tensor([0, 0, 1, 2]), torch.arange(4), 0.2,
                         None, path="decode", decode_only=True)
    # the measured rule: every decode-only step without the table launch
    assert C.tile_free_rows()
    n = 16 * 1024 + 100
    q1, k1, v1, _ = make_qkv([n], 1, 2, 32, "float32", seed=7)
    args = (q1[n - 1 :].contiguous(), k1, v1, torch.zeros((1, 1), dtype=torch.int64), n, torch.zeros(1, dtype=torch.int64),
            torch.tensor([n - 1]), 0.2, None)
    merged = L.cached_forward(*args, path="prefill")
    for one in (False, True):
        assert same_bits(L.cached_forward(*args, path="decode", decode_only=one), merged), one
    k2 = k1.clone()
    k2[16 * 1024 + 7, 0, 3] += 0.5
    perturbed = L.cached_forward(args[0], k2, *args[2:], path="decode", decode_only=True)
    assert not same_bits(perturbed, merged)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [4, 32])
@pytest.mark.parametrize("window", [None, 17200])
def test_decode_step_without_tile_table_across_many_kv_splits(dtype, g, window):
    """A decode step (one token per sequence) at contexts of up to 18 KV splits, so that
    ``rlk_attn_combine`` folds more than its group of sixteen splits: ``decode_only`` (tile rows
    formed from ``q_pos``; G = 32 exceeds the 16-row decode tile and falls back to the table) and
    the tile-table launch give the train path's rows, contiguous and paged (16-token pages,
    shuffled); the 17200-key window masks the first 300 keys of the 17500-token row and the
    first split of the 9000-token one still holds visible keys. Negative control: one key of the
    seventeenth split perturbed changes that row and no other."""
    from rl_engine.backends.triton.attention import launch as L

    lens = [9000, 17500, 1, 1500]
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, 2, g, 128, dtype, seed=g + (window or 0)))
    scale = 128**-0.5
    ref = L.varlen_forward(q, k, v, cu, scale, window)[0]
    last = cu[1:] - 1
    qd = q[last].contiguous()
    q_seq = torch.arange(len(lens), device="cuda")
    q_pos = torch.tensor([n - 1 for n in lens], device="cuda")
    ps = 16
    npages = [-(-n // ps) for n in lens]
    order = torch.randperm(sum(npages), generator=torch.Generator().manual_seed(3)).cuda()
    ptab = torch.zeros((len(lens), max(npages)), dtype=torch.int64, device="cuda")
    kp = torch.full((sum(npages) * ps, 2, 128), GARBAGE, dtype=k.dtype, device="cuda")
    vp = torch.full_like(kp, -GARBAGE)
    used = 0
    for i, n in enumerate(lens):
        ptab[i, : npages[i]] = order[used : used + npages[i]] * ps
        used += npages[i]
        pos = torch.arange(n, device="cuda")
        rows = ptab[i, pos // ps] + pos % ps
        kp[rows], vp[rows] = k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]
    caches = {"contiguous": (k, v, cu[:-1, None].to(torch.int64).contiguous(), 1 << 20), "paged": (kp, vp, ptab, ps)}
    for name, (kk, vv, page_rows, psz) in caches.items():
        for one in (True, False):
            o = L.cached_forward(qd, kk, vv, page_rows, psz, q_seq, q_pos, scale, window, path="decode",
                                 decode_only=one)
            assert same_bits(o, ref[last]), (name, one, same_bits(o, ref[last]))
    k2 = k.clone()
    k2[int(cu[1]) + 17000, 0] *= 1.5  # sequence 1, position 17000: split 16, the first of the second group
    o = L.cached_forward(qd, k2, v, caches["contiguous"][2], 1 << 20, q_seq, q_pos, scale, window, path="decode",
                         decode_only=True)
    assert same_bits(o[[0, 2, 3]], ref[last][[0, 2, 3]])
    assert not same_bits(o[1], ref[last][1])
