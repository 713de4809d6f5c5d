"""packing.pack / packing.unpack: layout and row invariance on raw bits (with a negative control),
round trips, agreement with the row-by-row reference, gradients, dispatch and mask validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts, runtime
from rl_engine.ops import packing
from rl_engine.reference import packing as ref_packing
from rl_engine.utils.bits import same_bits
from tests.helpers.strategies import DTYPES
from tests.helpers.threads import threads


def _sequences(lengths, dtype, feat=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    return [torch.randn(n, *feat, generator=g).to(dt) for n in lengths]


def _padded(seqs, L, side, fill=float("nan")):
    """Pad sequences to ``[B, L, ...]``; padding holds NaN so any leak of it into a result fails."""
    feat = seqs[0].shape[1:]
    out = torch.full((len(seqs), L, *feat), fill).to(seqs[0].dtype)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = s.shape[0]
        span = slice(0, n) if side == "right" else slice(L - n, L)
        out[b, span] = s
        mask[b, span] = 1
    return out, mask


def naive_left_pack(padded, attention_mask, padding_side="right"):
    """Negative control: a common bug — position ids taken as the padded column index, which is
    wrong for left padding (they no longer start at 0)."""
    m = attention_mask.bool()
    cols = torch.arange(padded.shape[1]).expand_as(m)
    values = padded[m]
    lengths = m.sum(1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return values, cu, cols[m]


def ours(padded, attention_mask, padding_side="right"):
    p = packing.pack(padded, attention_mask, padding_side=padding_side)
    return p.values, p.cu_seqlens, p.position_ids


def layout_failures(pack_fn, seqs, L):
    """Raw-bit differences between packing the right-padded and the left-padded batch."""
    right = pack_fn(*_padded(seqs, L, "right"), padding_side="right")
    left = pack_fn(*_padded(seqs, L, "left"), padding_side="left")
    names = ("values", "cu_seqlens", "position_ids")
    return [f"{n}: {same_bits(a, b)}" for n, a, b in zip(names, right, left) if not same_bits(a, b).equal]


lengths_st = st.lists(st.integers(0, 12), min_size=1, max_size=8)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(lengths=lengths_st, extra=st.integers(0, 3), feat=st.sampled_from([(), (3,)]), data=st.data())
def test_pack_layout_and_row_invariance(dtype, lengths, extra, feat, data):
    with threads(1):
        L = max(lengths) + extra
        if L == 0:
            L = 1
        seqs = _sequences(lengths, dtype, feat, seed=sum(lengths))
        assert layout_failures(ours, seqs, L) == []
        # row invariance: any subset of the rows, in any order, packs to the same per-sequence bits
        side = data.draw(st.sampled_from(["left", "right"]))
        order = data.draw(st.permutations(range(len(seqs))))[: data.draw(st.integers(1, len(seqs)))]
        full = packing.pack(*_padded(seqs, L, side), padding_side=side)
        sub = packing.pack(*_padded([seqs[i] for i in order], L, side), padding_side=side)
        for k, i in enumerate(order):
            a = sub.values[int(sub.cu_seqlens[k]) : int(sub.cu_seqlens[k + 1])]
            b = full.values[int(full.cu_seqlens[i]) : int(full.cu_seqlens[i + 1])]
            assert same_bits(a, b) and same_bits(a, seqs[i])
            assert torch.equal(sub.position_ids[int(sub.cu_seqlens[k]) : int(sub.cu_seqlens[k + 1])], torch.arange(lengths[i]))


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(lengths=lengths_st, extra=st.integers(0, 3), side=st.sampled_from(["left", "right"]), pad=st.sampled_from([0, -1.5]))
def test_unpack_round_trip_and_reference(dtype, lengths, extra, side, pad):
    with threads(1):
        L = max(max(lengths) + extra, 1)
        seqs = _sequences(lengths, dtype, (2,), seed=len(lengths) + L)
        padded, mask = _padded(seqs, L, side)
        p = packing.pack(padded, mask, padding_side=side)
        back = p.unpack(pad_value=pad)
        want = torch.where(mask.bool()[..., None], padded, torch.full_like(padded, pad))
        assert same_bits(back, want)
        # the vectorised implementation equals the row-by-row reference, bit for bit
        values, cu, pos, idx = ref_packing.pack(padded, mask.sum(1), side)
        for a, b in ((p.values, values), (p.cu_seqlens, cu), (p.position_ids, pos), (p.indices, idx)):
            assert same_bits(a, b)
        assert same_bits(back, ref_packing.unpack(p.values, mask.sum(1), L, side, pad))
        # unpack into a different padding side moves the same bits
        other = "left" if side == "right" else "right"
        q = packing.unpack(p.values, p.cu_seqlens, L, padding_side=other)
        assert same_bits(packing.pack(q, lengths=lengths, padding_side=other).values, p.values)


def test_negative_control_column_position_ids_are_caught():
    seqs = _sequences([3, 5, 1], "float32")
    assert layout_failures(naive_left_pack, seqs, 6) != []
    assert layout_failures(ours, seqs, 6) == []


def test_lengths_argument_and_pack_other():
    seqs = _sequences([2, 0, 4], "bfloat16", (3,))
    padded, mask = _padded(seqs, 5, "left")
    a = packing.pack(padded, mask, padding_side="left")
    b = packing.pack(padded, lengths=[2, 0, 4], padding_side="left")
    c = packing.pack(padded, lengths=torch.tensor([2, 0, 4], dtype=torch.int32), padding_side="left")
    for p in (b, c):
        assert same_bits(p.values, a.values) and same_bits(p.cu_seqlens, a.cu_seqlens)
    assert a.cu_seqlens.dtype == torch.int32 and a.cu_seqlens.tolist() == [0, 2, 2, 6]
    assert a.position_ids.dtype == torch.int64 and a.position_ids.tolist() == [0, 1, 0, 1, 2, 3]
    assert a.lengths.tolist() == [2, 0, 4] and a.max_seqlen == 4 and a.batch_size == 3
    ids = torch.arange(15).reshape(3, 5)
    assert a.pack_other(ids).tolist() == [3, 4, 11, 12, 13, 14]
    assert same_bits(packing.position_ids(a.cu_seqlens), a.position_ids)
    assert packing.padding_mask(torch.tensor([2, 0, 4]), 5, padding_side="left").long().tolist() == mask.tolist()


def test_gradients_flow_exactly():
    seqs = _sequences([3, 1, 4], "float32", (2,))
    padded, mask = _padded(seqs, 4, "right", fill=0.0)
    padded.requires_grad_()
    p = packing.pack(padded, mask)
    up = torch.randn(p.values.shape)
    p.values.backward(up)
    want = torch.zeros_like(padded)
    want[mask.bool()] = up
    assert same_bits(padded.grad, want)
    v = p.values.detach().requires_grad_()
    out = packing.unpack(v, p.cu_seqlens, 4)
    g = torch.randn(out.shape)
    out.backward(g)
    assert same_bits(v.grad, g[mask.bool()])


def test_run_to_run_determinism():
    seqs = _sequences([7, 3, 9, 0, 2], "float32", (4,))
    padded, mask = _padded(seqs, 10, "left")
    first = packing.pack(padded, mask, padding_side="left")
    for _ in range(2):
        again = packing.pack(padded, mask, padding_side="left")
        assert same_bits(again.values, first.values) and same_bits(again.indices, first.indices)


def test_contract_is_exact_and_dispatch_records_provenance():
    for op in ("packing.pack", "packing.unpack"):
        for dt in (torch.float32, torch.bfloat16):
            for q in ("forward", "backward"):
                tol = contracts.tolerance(op, dt, q)
                assert tol.atol == 0 and tol.rtol == 0
    padded, mask = _padded(_sequences([2, 1], "float32"), 3, "right")
    with runtime.provenance.record() as recs:
        p = packing.pack(padded, mask)
        p.unpack()
    assert [(r.op, r.impl_id, r.fallback) for r in recs] == [("packing.pack", "torch.index", False), ("packing.unpack", "torch.index", False)]
    ids = torch.tensor([[5, 6, 0]])
    assert packing.pack(ids, torch.tensor([[1, 1, 0]])).values.tolist() == [5, 6]


def test_empty_batch_and_empty_rows():
    p = packing.pack(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.bool))
    assert p.values.shape == (0,) and p.cu_seqlens.tolist() == [0] and p.max_seqlen == 0
    q = packing.pack(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert q.values.shape == (0,) and q.cu_seqlens.tolist() == [0, 0, 0]
    assert q.unpack().shape == (2, 3)


def test_bad_input_messages_name_the_argument():
    x = torch.randn(2, 4)
    ok = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"^attention_mask: row 1 is not a contiguous run of ones on the left \(padding_side='right'"):
        packing.pack(x, torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]]))
    with pytest.raises(ValueError, match=r"^attention_mask: row 0 is not a contiguous run of ones on the right \(padding_side='left'"):
        packing.pack(x, ok, padding_side="left")
    with pytest.raises(ValueError, match="^attention_mask: expected only 0 and 1"):
        packing.pack(x, ok * 2)
    with pytest.raises(ValueError, match=r"^attention_mask: expected shape \(2, 4\)"):
        packing.pack(x, ok[:, :3])
    with pytest.raises(ValueError, match="^attention_mask: expected dtype bool"):
        packing.pack(x, ok.float())
    with pytest.raises(ValueError, match="^attention_mask: pass exactly one"):
        packing.pack(x)
    with pytest.raises(ValueError, match="^attention_mask: pass exactly one"):
        packing.pack(x, ok, lengths=[2, 1])
    with pytest.raises(ValueError, match=r"^lengths: expected values in \[0, 4\]"):
        packing.pack(x, lengths=[5, 1])
    with pytest.raises(ValueError, match="^lengths: expected 2 lengths"):
        packing.pack(x, lengths=[1])
    with pytest.raises(TypeError, match="^lengths: expected an integer tensor"):
        packing.pack(x, lengths=[1.0, 2.0])
    with pytest.raises(ValueError, match="^padding_side: expected 'left' or 'right'"):
        packing.pack(x, ok, padding_side="both")
    with pytest.raises(ValueError, match="^padded: expected at least 2 dimensions"):
        packing.pack(torch.randn(4), lengths=[1])
    p = packing.pack(x, ok)
    with pytest.raises(ValueError, match="^cu_seqlens: expected 0 followed by non-decreasing"):
        packing.unpack(p.values, torch.tensor([0, 2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="^cu_seqlens: expected the last offset to equal"):
        packing.unpack(p.values, torch.tensor([0, 2, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="^cu_seqlens: expected dtype"):
        packing.unpack(p.values, p.cu_seqlens.float())
    with pytest.raises(ValueError, match=r"^max_len: expected an int >= the longest sequence \(2\)"):
        packing.unpack(p.values, p.cu_seqlens, 1)
    with pytest.raises(ValueError, match=r"^padded: expected leading dims \(2, 4\)"):
        p.pack_other(torch.zeros(2, 5))
