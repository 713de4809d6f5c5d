"""The transposed Hopper decode split kernel (``hopper_transposed_decode.rlk_attn_split_wgt``,
Gluon, sm90) and its rules: it gives the portable Triton kernels' bits, raw, over contiguous and
paged caches, one and four blocks a step, every ring depth and value slicing; it takes exactly its
band of launch sizes (four blocks a step exactly where ``wgt_quad_blocks`` says).

Triton-interpreter tests (``TRITON_INTERPRET=1``, CPU tensors): the rules are pure, the switches
are scoped, ``attend`` refuses the variant on a call the kernel does not take, and the Gluon
launchers' host layouts are built once. GPU tests on the H200.
"""

from __future__ import annotations

import types

import pytest
import torch

from rl_engine.backends.triton.attention.configs import Variant
from rl_engine.backends.triton.attention.tuning import attention_tuning, current_tuning
from rl_engine.utils.bits import same_bits
from tests.backends.triton.attention._attention_common import (
    assert_a_key_moves_its_sequence,
    decode_caches,
    decode_rows,
    gpu,
    interp,
    make_qkv,
)


# --------------------------------------------------------------------------- Triton interpreter subset (CPU)


@interp
def test_interpreter_transposed_decode_rule_is_pure(monkeypatch):
    """``wgt_decode_eligible`` is a pure rule: CPU tensors, fp32, other head dims, a window, 64-key
    or 8-key pages, tiles of more than 16 rows and the switch off all give False without touching a
    device; ``attention_tuning`` restores ``wgt_decode``, ``wgt_decode_bands``,
    ``wgt_value_slices`` and ``wgt_quad_programs`` (and refuses value slices of fewer than 64
    columns); the bands of ``wgt_decode_programs`` and ``wgt_quad_blocks``; ``wgt_tile_rows`` sizes
    the tile's ``N``; ``attend`` refuses ``Variant.TRANSPOSED_DECODE`` on a step the kernel does not
    take (naming the variant)."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, _ = make_qkv([70], 2, 2, 128, "bfloat16")
    assert not E.wgt_decode_eligible(q, k, v, 16, True, None, True, 16)  # CPU tensors
    q32, k32, v32, _ = make_qkv([70], 2, 2, 128, "float32")
    assert not E.wgt_decode_eligible(q32, k32, v32, 16, True, None, True, 16)
    cuda_like = types.SimpleNamespace(dtype=torch.bfloat16, shape=q.shape, device=torch.device("cuda", 0))
    for args in ((16, True, 300, True, 16), (64, True, None, True, 16), (8, True, None, True, 16),
                 (70, False, None, False, 32)):
        assert not E.wgt_decode_eligible(cuda_like, k, v, *args), args
    def switches():
        tuning = current_tuning()
        return tuning.wgt_decode, tuning.wgt_decode_bands, tuning.wgt_value_slices, tuning.wgt_quad_programs

    shipped = (True, ((0.0, 4.0), (0.0, 4.0)), 2, 1.0)
    with attention_tuning(wgt_decode=False, wgt_decode_bands=((1.0, 2.0), (1.0, 2.0)), wgt_value_slices=1,
                          wgt_quad_programs=0.0):
        assert switches() == (False, ((1.0, 2.0), (1.0, 2.0)), 1, 0.0)
    assert switches() == shipped
    with pytest.raises(ValueError, match="wgt_value_slices"):
        with attention_tuning(wgt_value_slices=4):
            pass
    # the bands on a 132-SM device: up to 4 programs an SM, either cache
    monkeypatch.setattr(C, "sm_count", lambda index: 132)
    cuda0 = torch.device("cuda", 0)
    sizes = (1, 64, 98, 99, 132, 528, 529)
    for paged in (False, True):
        assert [C.wgt_decode_programs(n, paged, cuda0) for n in sizes] == [True] * 6 + [False], paged
    assert not C.wgt_decode_programs(8, False, torch.device("cpu"))
    # four blocks a step: two value slices, at most one program an SM, either cache
    for paged in (False, True):
        assert [C.wgt_quad_blocks(n, paged, cuda0) for n in (1, 132, 133)] == [True, True, False], paged
    assert not C.wgt_quad_blocks(64, False, torch.device("cpu"))
    with attention_tuning(wgt_value_slices=1):
        assert not C.wgt_quad_blocks(64, False, cuda0) and not C.wgt_quad_blocks(64, True, cuda0)
    assert [C.wgt_tile_rows(True, g, 16) for g in (1, 4, 8, 16)] == [8, 8, 8, 16]
    assert C.wgt_tile_rows(False, 4, 16) == 16
    with pytest.raises(ValueError, match="tile_rows"):
        C.wgt_tile_rows(False, 4, 32)
    counts = torch.tensor([70])
    with pytest.raises(ValueError, match="transposed_decode"):
        L.attend(q, k, v, torch.zeros((1, 1), dtype=torch.int64), 70, counts, counts * 0, counts * 0, 70, 0.1, 300,
                 path="decode", variant=Variant.TRANSPOSED_DECODE)


@interp
def test_interpreter_hopper_host_layouts_are_built_once():
    """The Gluon launchers' host-side layouts (the transposed kernel's exchange layouts, the TMA
    boxes' shared layouts) are built once per shape and reused: building them cost more host time
    than a launch (``tools/benchmarking/host_overhead_gpu.py``). Each cached value equals a freshly built one, so the
    constexpr arguments — and the compiled kernels — are the same; another shape or dtype gets
    its own value (a planted cache keyed on ``nq`` alone would hand ``16`` the ``8`` layouts)."""
    from rl_engine.backends.triton.attention.hopper_common import smem_layout
    from rl_engine.backends.triton.attention.hopper_transposed_decode import exchange_layouts

    x8, f8 = exchange_layouts(8)
    assert exchange_layouts(8)[0] is x8 and exchange_layouts(8)[1] is f8
    fresh = exchange_layouts.__wrapped__(8)
    assert fresh == (x8, f8) and fresh[0] is not x8
    x16, f16 = exchange_layouts(16)
    assert x16 != x8 and f16 != f8 and list(x16.shape) == [4, 16] and list(f16.shape) == [4, 16, 16]
    a = smem_layout(64, 128, torch.bfloat16)
    assert smem_layout(64, 128, torch.bfloat16) is a
    assert a == smem_layout.__wrapped__(64, 128, torch.bfloat16)
    for rows, cols, dt in ((64, 32, torch.bfloat16), (64, 128, torch.float16), (16, 128, torch.bfloat16)):
        b = smem_layout(rows, cols, dt)
        assert b is not a and b == smem_layout.__wrapped__(rows, cols, dt)
    assert smem_layout(64, 32, torch.bfloat16).swizzle_byte_width < a.swizzle_byte_width


# --------------------------------------------------------------------------- GPU


WGT_CASES = {
    # name: (lens, kv heads, G, dtype, page size (None: a contiguous cache), query tokens per sequence)
    "contiguous_g4_ragged": ([2085, 300, 1, 1024, 1087, 4097, 64, 63, 1025], 2, 4, "bfloat16", None, 1),
    "contiguous_qwen_4096": ([4096], 8, 4, "bfloat16", None, 1),
    "contiguous_g16": ([1300, 40, 2048], 1, 16, "bfloat16", None, 1),
    "contiguous_chunk3_g2_fp16": ([1500, 2100, 700, 3], 2, 2, "float16", None, 3),
    "pages16_g4_ragged": ([2085, 300, 1, 1024, 1087, 4097, 64, 63, 1025], 2, 4, "bfloat16", 16, 1),
    "pages32_fp16_g1": ([77, 1500, 2049, 3000], 4, 1, "float16", 32, 1),
    "pages16_chunk2_g8": ([2500, 1100, 66], 2, 8, "bfloat16", 16, 2),
    # one KV split (table width <= 1024 keys): the programs finish their rows, no combine
    "one_split_contiguous_g4": ([1000, 63, 1, 64, 65, 511], 2, 4, "bfloat16", None, 1),
    "one_split_pages32_chunk4_g2": ([700, 300, 4], 2, 2, "float16", 32, 4),
}


@gpu
@pytest.mark.parametrize("case", sorted(WGT_CASES))
def test_transposed_decode_gives_the_triton_kernels_bits(case, monkeypatch, tuned):
    """``hopper_transposed_decode.rlk_attn_split_wgt`` (a decode step's splits with the products transposed: scores
    ``k·qᵀ`` with the tile's query rows as the ``wgmma``'s ``N = 8`` or ``16``, ``accᵀ = Vᵀ·Pᵀ +
    accᵀ·α``) against the Triton kernels (``attention_tuning(wg_decode=False, wgt_decode=False)``) and against
    the varlen rows of the same tokens (the prefill <-> decode contract), raw bits: contiguous
    caches (64-row block copies; 70 stale NaN rows after each sequence) and 16- / 32-key pages in
    shuffled order (NaN in every unused page and table entry), ragged lengths at block, page and
    split edges (1 .. 4097 keys, up to 5 KV splits; steps of one split, whose programs finish
    their rows), GQA groups 1-16, bf16 and fp16, steps of one token a sequence (no tile table)
    and of 2-4 tokens (tile table, masked blocks); the shipped ring depth and value slices, one
    block a step at 3 / 4 ring slots with 1 / 2 value slices, and four blocks a step
    (``AttentionTuning.wgt_quad_programs``) at 2 / 1 four-block slots (over a contiguous cache one 256-row copy a slot,
    over pages a loader partition's page copies). Negative control: one key of the first sequence's
    unmasked run perturbed moves that sequence's rows and no other."""
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    lens, hkv, g, dtype, ps, n = WGT_CASES[case]
    d = 128
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, hkv, g, d, dtype, seed=len(case) + (ps or 0)))
    scale = d**-0.5
    ref, _, _ = L.varlen_forward(q, k, v, cu, scale, None)
    kc, vc, page_rows = decode_caches(k, v, cu, lens, ps, seed=n + (ps or 0))
    size = ps or max(lens)  # a contiguous cache: its capacity
    rows, q_seq, q_pos = decode_rows(lens, cu, n)
    flags = []
    attend = L.attend
    monkeypatch.setattr(L, "attend", lambda *a, **kw: flags.append(kw["variant"].transposed) or attend(*a, **kw))

    def step(kk=kc):
        return L.cached_forward(q[rows].contiguous(), kk, vc, page_rows, size, q_seq, q_pos, scale, None,
                                path="decode", decode_only=n == 1)

    assert E.wgt_decode_eligible(q, kc, vc, size, ps is not None, None, n == 1, 16)
    tuned(wgt_decode_bands=((0.0, float("inf")), (0.0, float("inf"))))  # every size
    with attention_tuning(wg_decode=False):
        got = step()
        assert flags[-1] is True
        with attention_tuning(wgt_decode=False):
            plain = step()
        assert flags[-1] is False
        assert same_bits(got, plain), (case, same_bits(got, plain))
        assert same_bits(got, ref[rows]), (case, same_bits(got, ref[rows]))
        # one block a step at 3 / 4 ring slots, 1 / 2 value slices; four blocks a step at 2 / 1 slots
        for slots, slices, quad in ((3, 1, 0), (4, 2, 0), (2, 2, float("inf")), (1, 2, float("inf"))):
            with attention_tuning(wgt_decode_slots=slots, wgt_quad_slots=slots, wgt_value_slices=slices,
                                  wgt_quad_programs=quad):
                other = step()
            assert flags[-1] is True and same_bits(other, got), (case, slots, slices, quad, same_bits(other, got))
        assert torch.isfinite(got.float()).all()
        assert_a_key_moves_its_sequence(step, kc, int(page_rows[0, 0]), q_seq, got)


@gpu
def test_transposed_decode_takes_its_band(monkeypatch):
    """On the device, the shipped selection runs a decode step's splits on the transposed kernel
    exactly inside ``AttentionTuning.wgt_decode_bands`` (two value slices counted), four blocks a step exactly where
    ``wgt_quad_blocks`` says: Qwen3-8B heads (8 kv heads, G = 4), 4096 keys; on a 132-SM H200 a
    contiguous cache at batch 1 (64 programs: four blocks a step) and 16 (1024: neither), 16-key
    pages at batch 1 (64: four blocks a step, the loader partition's copies) and 4 (256: one block
    a step). Each step's rows raw-bit equal the
    Triton kernels' (``attention_tuning(wg_decode=False, wgt_decode=False)``). Negative control: a perturbed
    visible key moves the rows."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(23)
    hkv, g, d, ps, ctx = 8, 4, 128, 16, 4096
    flags = []
    attend = L.attend
    monkeypatch.setattr(L, "attend",
                        lambda *a, **kw: flags.append((kw["variant"].transposed,
                                                       kw["variant"] is Variant.TRANSPOSED_DECODE_QUAD)) or attend(*a, **kw))
    for paged, batch in ((False, 1), (False, 16), (True, 1), (True, 4)):
        kc = torch.randn((batch * ctx, hkv, d), generator=gen).to(torch.bfloat16).cuda()
        vc = torch.randn((batch * ctx, hkv, d), generator=gen).to(torch.bfloat16).cuda()
        q = torch.randn((batch, hkv * g, d), generator=gen).to(torch.bfloat16).cuda()
        if paged:
            table, size = (torch.randperm(batch * ctx // ps, generator=gen).view(batch, ctx // ps) * ps).cuda(), ps
        else:
            table, size = (torch.arange(batch) * ctx)[:, None].cuda(), ctx
        q_seq, q_pos = torch.arange(batch).cuda(), torch.full((batch,), ctx - 1).cuda()

        def step(kk, q=q, vc=vc, table=table, size=size, q_seq=q_seq, q_pos=q_pos):
            return L.cached_forward(q, kk, vc, table, size, q_seq, q_pos, d**-0.5, None, decode_only=True)

        got = step(kc)
        programs = batch * hkv * C.num_splits(ctx) * current_tuning().wgt_value_slices
        assert flags[-1][0] is C.wgt_decode_programs(programs, paged, q.device), (paged, batch)
        assert flags[-1][1] is (flags[-1][0] and C.wgt_quad_blocks(programs, paged, q.device)), (paged, batch)
        if sm == 132:  # the H200
            assert flags[-1] == {(False, 1): (True, True), (False, 16): (False, False), (True, 1): (True, True),
                                 (True, 4): (True, False)}[(paged, batch)], (paged, batch, flags[-1])
        with attention_tuning(wg_decode=False, wgt_decode=False):
            assert same_bits(step(kc), got), (paged, batch)
        k2 = kc.clone()
        k2[int(table[0, 0]) + 1, 2] += 0.5
        assert not same_bits(step(k2)[:1], got[:1])
