"""The Hopper warpgroup kernels (``hopper_warpgroup``: the train path's forward
``rlk_attn_fwd_wg`` and the paged decode split kernel ``rlk_attn_split_wg``, Gluon, sm90) and
their eligibility rules: both give the portable Triton kernels' bits, raw, on every shipped and
alternative launch configuration; the paged decode kernel takes exactly its band of launch sizes;
the forward under programmatic dependent launch waits for its tile table.

Triton-interpreter tests (``TRITON_INTERPRET=1``, CPU tensors): the rules are pure (nothing
touches a device), the switches are scoped, ``attend`` refuses the variant on a call the kernel
does not take, and importing the launchers imports no Gluon module. GPU tests on the H200.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from rl_engine.backends.triton.attention.configs import Variant
from rl_engine.backends.triton.attention.tuning import attention_tuning, current_tuning
from rl_engine.utils.bits import same_bits
from tests.backends.triton.attention._attention_common import (
    assert_a_key_moves_its_sequence,
    assert_pdl_race_caught,
    decode_caches,
    decode_rows,
    gpu,
    graph_replay,
    interp,
    make_qkv,
)


# --------------------------------------------------------------------------- Triton interpreter subset (CPU)


@interp
def test_interpreter_warpgroup_decode_rule_is_pure(monkeypatch):
    """``wg_decode_eligible`` is a pure rule: CPU tensors, a contiguous cache, a window, 64-key or
    8-key pages, fp32 and other head dims, and the switch off all give False without touching a
    device; ``attention_tuning(wg_decode=False)`` restores the switch; ``wg_decode_programs``
    takes launches of half a program to two programs per SM (``attention_tuning(wg_decode_band=...)``
    widens it and restores it); ``attend`` refuses ``Variant.WARPGROUP_PAGED_DECODE`` on a step the
    kernel does not take (naming the variant)."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    q, k, v, _ = make_qkv([70], 2, 2, 128, "bfloat16")
    assert not E.wg_decode_eligible(q, k, v, 16, True, None)  # CPU tensors
    q32, k32, v32, _ = make_qkv([70], 2, 2, 128, "float32")
    assert not E.wg_decode_eligible(q32, k32, v32, 16, True, None)
    with attention_tuning(wg_decode=False):
        assert current_tuning().wg_decode is False
    assert current_tuning().wg_decode is True
    cuda_like = types.SimpleNamespace(dtype=torch.bfloat16, shape=q.shape, device=torch.device("cuda", 0))
    for args in ((16, False, None), (16, True, 300), (64, True, None), (8, True, None)):
        assert not E.wg_decode_eligible(cuda_like, k, v, *args), args
    # the launch-size band: half a program to two programs per SM (a 132-SM device)
    monkeypatch.setattr(C, "sm_count", lambda index: 132)
    cuda0 = torch.device("cuda", 0)
    assert [C.wg_decode_programs(n, cuda0) for n in (64, 65, 66, 132, 256, 264, 265, 2048)] == [
        False, False, True, True, True, True, False, False]
    assert not C.wg_decode_programs(256, torch.device("cpu"))
    with attention_tuning(wg_decode_band=(0, float("inf"))):
        assert C.wg_decode_programs(1, cuda0) and C.wg_decode_programs(10**6, cuda0)
    assert current_tuning().wg_decode_band == (0.5, 2.0)
    counts = torch.tensor([70])
    with pytest.raises(ValueError, match="warpgroup_paged_decode"):
        L.attend(q, k, v, torch.zeros((1, 1), dtype=torch.int64), 70, counts, counts * 0, counts * 0, 70, 0.1, None,
                 path="decode", variant=Variant.WARPGROUP_PAGED_DECODE)


@interp
def test_interpreter_warpgroup_rule_and_import_are_pure():
    """``wg_eligible`` is a pure rule (CPU tensors, fp32, other head dims, a forced config and the
    switch off all give False without touching a device), and ``import rl_engine`` plus the
    launchers (``launch``, and with it every portable kernel module) never import a Gluon module
    (the ``hopper_*`` modules are imported by the first launch that runs them)."""
    import subprocess
    import sys

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E

    q, k, v, _ = make_qkv([70], 2, 2, 128, "bfloat16")
    assert not E.wg_eligible(q, k, v, None)  # CPU tensors
    q32, k32, v32, _ = make_qkv([70], 2, 2, 128, "float32")
    assert not E.wg_eligible(q32, k32, v32, None)
    q64, k64, v64, _ = make_qkv([70], 2, 2, 64, "bfloat16")
    assert not E.wg_eligible(q64, k64, v64, None)
    assert not E.wg_eligible(q, k, v, C.select_prefill(torch.bfloat16, 128))
    with attention_tuning(wg_forward=False):
        assert current_tuning().wg_forward is False
    assert current_tuning().wg_forward is True
    code = ("import sys, rl_engine; import rl_engine.backends.triton.attention.launch; "
            "print(int('triton.experimental.gluon' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0", out


@interp
def test_interpreter_warpgroup_ring_configs_are_scoped():
    """``attention_tuning(wg_forward_rings=..., wg_forward_block_m=...)`` sets every warpgroup forward
    launch's ring slots and register cap and the tile rows inside its block, and restores the
    shipped values after it, also when the block raises (the bits test and the probe tool rely on
    it to leave the shipped setting as it was); the launcher module imports (host-side only:
    importing it compiles nothing)."""
    from rl_engine.backends.triton.attention import hopper_warpgroup

    assert hopper_warpgroup.KERNEL_NAMES == ("rlk_attn_fwd_wg", "rlk_attn_split_wg")
    before = current_tuning()
    assert before.wg_forward_rings[0] != (2, 2, None) and before.wg_forward_block_m != 128
    with pytest.raises(RuntimeError, match="inside the block"):
        with attention_tuning(wg_forward_rings=((2, 2, None), (2, 2, None)), wg_forward_block_m=128):
            assert current_tuning().wg_forward_rings == ((2, 2, None), (2, 2, None))
            assert current_tuning().wg_forward_block_m == 128
            raise RuntimeError("inside the block")
    assert current_tuning() == before
    with attention_tuning(wg_forward_rings=((1, 1, 96), (1, 1, 96))):
        tuning = current_tuning()
        assert tuning.wg_forward_rings[0] == tuning.wg_forward_rings[1] == (1, 1, 96)
        assert tuning.wg_forward_block_m == before.wg_forward_block_m
    assert current_tuning() == before


# --------------------------------------------------------------------------- GPU


@gpu
def test_programmatic_dependent_launch_of_the_warpgroup_forward(planted):
    """The train path's Hopper warpgroup forward (``hopper_warpgroup.rlk_attn_fwd_wg``, bf16, D = 128)
    launched under programmatic dependent launch (it starts while ``rlk_attn_varlen_tiles`` runs
    and waits on the device before reading the table) gives the rows of a plain launch: ``out``,
    lse and the fp32 rows, eager and replayed from a CUDA graph, with and without KV-split merges.
    Its page rows are ``cu_seqlens[:-1]`` as given (int32 here, int64 too): no cast kernel.
    Negative control: with the table kernel made slow (its table pre-filled with -1), the kernel
    that waits stays right and a planted copy of the warpgroup module without the wait is caught
    (a race: at least once in twenty tries)."""
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    dev = torch.device("cuda")
    assert E.use_pdl(dev), "programmatic dependent launch is expected on an sm90 device"
    long = [t.cuda() for t in make_qkv([2085, 300, 1], 2, 4, 128, "bfloat16", seed=23)]
    short = [t.cuda() for t in make_qkv([300, 1, 700], 2, 4, 128, "bfloat16", seed=24)]
    assert E.wg_eligible(*long[:3], None), "the warpgroup forward is expected on an sm90 device with Triton 3.6"
    scale = 128**-0.5
    # (q, k, v, cu_seqlens, max_seqlen): KV-split merges; one split (compiled without merges);
    # int64 cu_seqlens
    cases = {"merges": (*long, 2085), "one split": (*short, 700),
             "int64 cu_seqlens": (*long[:3], long[3].to(torch.int64), 2085)}

    def calls(mod):
        return {name: (lambda a=a: mod.varlen_forward(a[0], a[1], a[2], a[3], scale, None, max_seqlen=a[4]))
                for name, a in cases.items()}

    with attention_tuning(pdl=False):
        plain = {name: fn() for name, fn in calls(L).items()}
    for name, fn in calls(L).items():
        for how, got in (("eager", fn()), ("graph", graph_replay(fn))):
            for what, a, b in zip(("out", "lse", "out32"), got, plain[name]):
                assert same_bits(a, b), (name, how, what, same_bits(a, b))
    # negative control: a slow varlen table kernel over a table pre-filled with -1 (a chain of 4000
    # dependent loads of cu_seqlens[0] = 0, which every table row depends on through B)
    slow = {"launch": (("    tab = torch.empty((nt, 4), dtype=torch.int64, device=cu_seqlens.device)\n    if B <= 0",
                        "    tab = torch.full((nt, 4), -1, dtype=torch.int64, device=cu_seqlens.device)\n    if B <= 0"),),
            "tile_tables": (("    rlk_attn_gdc_launch(PDL)  # the attention kernel may launch (it waits for this kernel's end)\n"
                             "    t = tl.program_id(0).to(tl.int64) * TBLOCK",
                             "    rlk_attn_gdc_launch(PDL)  # the attention kernel may launch (it waits for this kernel's end)\n"
                             "    spin = tl.zeros([], tl.int64)\n    for _ in range(0, 4000):\n"
                             "        spin += tl.load(cu_ptr + spin, volatile=True).to(tl.int64)\n"
                             "    B = B + spin.to(tl.int32)\n"
                             "    t = tl.program_id(0).to(tl.int64) * TBLOCK"),)}
    no_wait_hopper = (('        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0"',
                       '        gl.inline_asm_elementwise("// no wait $0"'),)
    waits = planted(slow, "pdl_wg_slow")
    skips = planted({**slow, "hopper_common": no_wait_hopper}, "pdl_wg_nowait")
    assert_pdl_race_caught(calls(waits)["merges"], calls(skips)["merges"], lambda got: got[0],
                           plain["merges"][0], "warpgroup forward")


WG_CASES = {
    # name: (lens, kv heads, G, dtype, window)
    "packed_512": ([512] * 6, 8, 4, "bfloat16", None),
    "long_splits": ([4096, 1025, 2049], 2, 4, "bfloat16", None),
    "ragged": ([1, 63, 64, 65, 1023, 1024, 1025, 3000], 2, 4, "bfloat16", None),
    "fp16_g1": ([77, 1500, 2049], 4, 1, "float16", None),
    "g8_window": ([900, 2500, 31], 2, 8, "bfloat16", 700),
    "g2_narrow_window": ([300, 1100], 2, 2, "bfloat16", 64),
    "g16_large_values": ([1300, 40], 1, 16, "bfloat16", None),
    # every sequence within one KV split (launches without merges: ``AttentionTuning.wg_forward_rings[0]``)
    "short_ragged": ([1, 63, 64, 65, 700, 1023, 1024], 2, 4, "bfloat16", None),
    "short_fp16_g8_window": ([300, 999, 17], 2, 8, "float16", 100),
}


def _wg_configs(which: str):
    """``AttentionTuning.wg_forward_rings`` as shipped, or ``"two_slots"``: every launch with two key
    and two value ring slots and no register cap (two programs per SM)."""
    if which == "two_slots":
        return attention_tuning(wg_forward_rings=((2, 2, None), (2, 2, None)))
    return contextlib.nullcontext()


@gpu
@pytest.mark.parametrize("configs", ["shipped", "two_slots"])
@pytest.mark.parametrize("case", sorted(WG_CASES))
def test_warpgroup_forward_gives_the_triton_kernels_bits(case, configs):
    """``hopper_warpgroup.rlk_attn_fwd_wg`` (asynchronous warpgroup MMAs: the next block's scores in flight
    while this block's ``P`` is converted, this block's ``P·V`` during the next softmax) against the
    Triton kernel
    (``attention_tuning(wg_forward=False)``): ``out``, lse and the fp32 output of the training forward and the
    output of the no-grad forward raw-bit equal, over KV splits (tiles past 1024 and 2048
    positions), ragged lengths at block and split edges, GQA groups 1–16, fp16, windows; with
    ``AttentionTuning.wg_forward_rings`` as shipped (one key and two value slots, 168 registers
    without merges, 160 with) and with two slots each and no register cap, so the bits are shown not to depend on the
    configuration. Negative control: a perturbed key (one element of one row) moves the rows that
    see it."""
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    lens, hkv, g, dtype, window = WG_CASES[case]
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, hkv, g, 128, dtype, seed=len(case),
                                               q_scale=8.0 if "large" in case else 1.5))
    assert E.wg_eligible(q, k, v, None)
    with attention_tuning(wg_forward=False):
        assert not E.wg_eligible(q, k, v, None)
        ref = L.varlen_forward(q, k, v, cu, 128**-0.5, window)
        ref_nograd = L.varlen_forward(q, k, v, cu, 128**-0.5, window, for_backward=False)[0]
    with _wg_configs(configs):
        got = L.varlen_forward(q, k, v, cu, 128**-0.5, window)
        got_nograd = L.varlen_forward(q, k, v, cu, 128**-0.5, window, for_backward=False)[0]
    for name, a, b in (("out", got[0], ref[0]), ("lse", got[1], ref[1]), ("out_f32", got[2], ref[2]),
                       ("no-grad out", got_nograd, ref_nograd)):
        d = same_bits(a, b)
        assert d, f"{case} {name}: {d}"
    assert torch.isfinite(got[0].float()).all()
    row = int(cu[1]) + 37 if len(lens) > 1 else 37  # a key of the second sequence
    k2 = k.clone()
    k2[row, 0, 5] += 0.5
    with _wg_configs(configs):
        moved = L.varlen_forward(q, k2, v, cu, 128**-0.5, window)[0]
    assert not same_bits(moved, got[0])
    seq_rows = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    seq_rows[row:int(cu[2]) if len(lens) > 1 else q.shape[0]] = True
    changed = (moved.view(torch.int16) != got[0].view(torch.int16)).any(dim=2).any(dim=1)
    assert not (changed & ~seq_rows).any(), "a perturbed key moved rows of another sequence or earlier rows"


WGD_CASES = {
    # name: (lens, kv heads, G, dtype, page size, query tokens per sequence in the step)
    "pages16_g4_ragged": ([2085, 300, 1, 1024, 1087, 4097, 64, 63, 1025], 2, 4, "bfloat16", 16, 1),
    "pages32_fp16_g1": ([77, 1500, 2049, 3000], 4, 1, "float16", 32, 1),
    "pages16_g16": ([1300, 40, 2048], 1, 16, "bfloat16", 16, 1),
    "pages16_g8_qwen": ([4096, 2000], 8, 4, "bfloat16", 16, 1),
    "chunk3_g2": ([1500, 2100, 700, 3], 2, 2, "bfloat16", 16, 3),
    "chunk2_pages32_g8": ([2500, 1100, 66], 2, 8, "float16", 32, 2),
    # one KV split (table width <= 1024 keys): the programs finish their rows, no combine
    "one_split_g4": ([1000, 63, 1, 64, 65, 511], 2, 4, "bfloat16", 16, 1),
    "one_split_chunk4_g2": ([700, 300, 4], 2, 2, "float16", 32, 4),
}


@gpu
@pytest.mark.parametrize("case", sorted(WGD_CASES))
def test_warpgroup_paged_decode_gives_the_triton_kernels_bits(case, monkeypatch, tuned):
    """``hopper_warpgroup.rlk_attn_split_wg`` (the splits of a paged decode step as a warpgroup kernel, each
    block's pages arriving as TMA copies into one shared-memory block) against the Triton split
    kernel (``attention_tuning(wg_decode=False)``) and against the varlen rows of the same tokens (the prefill <->
    decode contract), raw bits: ragged lengths at block, page and split edges (1 .. 4097 keys, up
    to 5 KV splits; steps of one split, whose programs finish their rows without the combine),
    GQA groups 1-16, bf16 and fp16, 16- and 32-key pages in shuffled order, steps of one token a
    sequence (no tile table) and of 2-4 tokens a sequence (tile table, masked blocks past the
    unmasked run); the shipped ring depth and value slicing, and 2 / 4 / 6
    ring slots with 1 / 4 / 2 value slices. The cache's unused rows and the page table's unused
    entries hold NaN (a page of NaN), so any read past a sequence's written rows shows.
    Negative control: one key of the first sequence's unmasked run perturbed moves that
    sequence's rows and no other."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import eligibility as E
    from rl_engine.backends.triton.attention import launch as L

    lens, hkv, g, dtype, ps, n = WGD_CASES[case]
    d = 128
    q, k, v, cu = (t.cuda() for t in make_qkv(lens, hkv, g, d, dtype, seed=len(case) + ps))
    scale = d**-0.5
    ref, _, _ = L.varlen_forward(q, k, v, cu, scale, None)
    kc, vc, table = decode_caches(k, v, cu, lens, ps, seed=ps + n)
    rows, q_seq, q_pos = decode_rows(lens, cu, n)
    flags = []
    attend = L.attend
    monkeypatch.setattr(L, "attend",
                        lambda *a, **kw: flags.append(kw["variant"] is Variant.WARPGROUP_PAGED_DECODE) or attend(*a, **kw))

    def step(kk=kc):
        return L.cached_forward(q[rows].contiguous(), kk, vc, table, ps, q_seq, q_pos, scale, None, path="decode",
                                decode_only=n == 1)

    assert E.wg_decode_eligible(q, kc, vc, ps, True, None)
    # every launch size (the rule: a band); the transposed kernel's band takes precedence
    tuned(wg_decode_band=(0.0, float("inf")), wgt_decode=False)
    got = step()
    assert flags[-1] is True
    with attention_tuning(wg_decode=False, wgt_decode=False):
        plain = step()
    assert flags[-1] is False
    assert same_bits(got, plain), (case, same_bits(got, plain))
    assert same_bits(got, ref[rows]), (case, same_bits(got, ref[rows]))
    # other ring depths, one value slice and four (the automatic rule gives one or two here)
    rule = C.value_slices
    for slots, slices in ((2, 1), (4, 4), (6, 2)):
        monkeypatch.setattr(C, "value_slices", lambda *a, n=slices, **kw: n)  # (few pairs: the rule is asked)
        with attention_tuning(wg_decode_slots=slots):
            other = step()
        assert flags[-1] is True and same_bits(other, got), (case, slots, slices, same_bits(other, got))
    monkeypatch.setattr(C, "value_slices", rule)
    assert torch.isfinite(got.float()).all()
    assert_a_key_moves_its_sequence(step, kc, int(table[0, 0]), q_seq, got)


@gpu
def test_warpgroup_paged_decode_takes_the_band_of_half_to_two_programs_per_sm(monkeypatch, tuned):
    """On the device, the shipped selection runs a paged step's splits on the warpgroup kernel
    exactly inside ``AttentionTuning.wg_decode_band``: Qwen3-8B heads (8 kv heads, G = 4), 16-token pages, 4096
    keys: batch 4 (128 programs, two value slices: 256) takes it on a 132-SM H200, batch 1 (32,
    sliced 64) and 16 (512) do not; each step's rows raw-bit equal the Triton split kernel's
    (``attention_tuning(wg_decode=False)``). Negative control: a perturbed visible key moves the rows."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(22)
    hkv, g, d, ps, ctx = 8, 4, 128, 16, 4096
    flags = []
    attend = L.attend
    monkeypatch.setattr(L, "attend",
                        lambda *a, **kw: flags.append(kw["variant"] is Variant.WARPGROUP_PAGED_DECODE) or attend(*a, **kw))
    tuned(wgt_decode=False)  # the transposed kernel's band takes precedence
    for batch in (1, 4, 16):
        kc = torch.randn((batch * ctx, hkv, d), generator=gen).to(torch.bfloat16).cuda()
        vc = torch.randn((batch * ctx, hkv, d), generator=gen).to(torch.bfloat16).cuda()
        q = torch.randn((batch, hkv * g, d), generator=gen).to(torch.bfloat16).cuda()
        table = (torch.randperm(batch * ctx // ps, generator=gen).view(batch, ctx // ps) * ps).cuda()
        q_seq, q_pos = torch.arange(batch).cuda(), torch.full((batch,), ctx - 1).cuda()

        def step(kk, q=q, vc=vc, table=table, q_seq=q_seq, q_pos=q_pos):
            return L.cached_forward(q, kk, vc, table, ps, q_seq, q_pos, d**-0.5, None, decode_only=True)

        got = step(kc)
        programs = batch * hkv * C.num_splits(ctx)
        slices = C.value_slices(programs, d, q.device, small_pages=True)
        assert flags[-1] is C.wg_decode_programs(programs * slices, q.device)
        assert flags[-1] is (sm / 2 <= programs * slices <= 2 * sm)
        if sm == 132:  # the H200
            assert flags[-1] is (batch == 4), (batch, programs, slices)
        with attention_tuning(wg_decode=False, wgt_decode=False):
            assert same_bits(step(kc), got), batch
        k2 = kc.clone()
        k2[table[0, 3] + 1, 2] += 0.5
        assert not same_bits(step(k2)[:1], got[:1])
