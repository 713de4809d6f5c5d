"""Launch configurations, selection rules and tuning switches of the Triton attention kernels
(``rl_engine/backends/triton/attention/configs.py``, ``tuning.py``): every configuration the
launchers can select is in the list the GPU tests prove raw-bit equal; the value-slicing, paired
and four-block walk and few-pairs decode tile rules; the switches are context-scoped and restored
when their block raises.

Triton-interpreter tests (``TRITON_INTERPRET=1`` and triton importable, CPU tensors, small
shapes, D = 32, fp32): the rules' answers are what the launchers use, and the rows are the same
bits whichever they pick.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.backends.triton.attention.tuning import attention_tuning, current_tuning
from rl_engine.utils.bits import same_bits
from tests.backends.triton.attention._attention_common import interp, make_qkv
from tests.helpers.tables import assert_each_refused


def test_config_tables_are_data_per_architecture(tmp_path):
    """The tiles come from ``config_tables/<arch>.json`` (CPU, pure): the shipped sm90 file loads
    with every table, the selections read it, an architecture without a file and ``arch=None``
    (the interpreter) take the fallback's tiles. A file missing a table, lacking a (dtype, head
    dim) of a complete table, repeating a row or carrying an unknown field is refused, naming
    what is wrong."""
    import json

    from rl_engine.backends.triton.attention import configs as C

    assert "sm90" in C.shipped_arches() and C.FALLBACK_ARCH == "sm90"
    tables = C.load_tables(C.table_path("sm90"))
    assert set(tables) == set(C.TABLE_NAMES)
    assert C.select_prefill(torch.bfloat16, 128, arch="sm90") == tables["prefill"][(torch.bfloat16, 128)]
    assert C.select_prefill(torch.bfloat16, 128, 16, arch="sm90") == tables["paged_prefill"][(torch.bfloat16, 128)]
    assert C.select_prefill(torch.float32, 64, 16, arch="sm90") == tables["prefill"][(torch.float32, 64)]  # no paged row
    assert C.select_decode(torch.float16, 64, 16, few=True, arch="sm90") == tables["few_paged_decode"][(torch.float16, 64)]
    assert C.select_decode(torch.float16, 64, many=True, arch="sm90") == tables["many_decode"][(torch.float16, 64)]
    assert C.select_backward(torch.float32, 32, arch="sm100") == tables["backward"][(torch.float32, 32)]  # fallback
    assert C.select_decode(torch.bfloat16, 128) == tables["decode"][(torch.bfloat16, 128)]  # arch None: the fallback
    with pytest.raises(ValueError, match="name"):
        C.table("sideways")
    good = json.loads(C.table_path("sm90").read_text())
    no_table = {k: v for k, v in good["tables"].items() if k != "backward"}
    gap = dict(good["tables"], decode=dict(good["tables"]["decode"], rows=good["tables"]["decode"]["rows"][1:]))
    twice = dict(good["tables"], prefill=dict(good["tables"]["prefill"],
                                              rows=good["tables"]["prefill"]["rows"] + good["tables"]["prefill"]["rows"][:1]))
    cases = {"missing": dict(good, tables=no_table), "expected a row for every": dict(good, tables=gap),
             "appears twice": dict(good, tables=twice), "extra": dict(good, extra_field=1)}
    assert_each_refused(C.load_tables, cases, tmp_path)


@interp
def test_interpreter_shipped_configs_cover_every_selection(monkeypatch):
    """Every configuration the launchers can select — prefill and decode on a contiguous or a
    paged cache, decode with many or few (sequence, kv head) pairs — is in ``shipped_forward_configs``, the
    list the GPU test proves raw-bit equal; ``few_programs`` compares the pairs with the SM count
    and is False off CUDA; the few-programs tiles come with every value slicing ``value_slices``
    can choose and every block walk ``pair_blocks`` and ``quad_blocks`` can choose; the
    many-pairs decode tile is listed. Negative controls: the list without the few-programs
    variants, without the paged prefill tile, without the value slicings and multi-block tiles,
    without the paired tiles, without the four-block tiles, without the many-pairs tile, is
    caught."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C

    assert not C.few_programs(1, 8, torch.device("cpu"))
    monkeypatch.setattr(C, "sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda", 0)

    def uncovered():
        missing = []
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            for d in C.HEAD_DIMS:
                shipped = C.shipped_forward_configs(dt, d)
                chosen = [C.select_prefill(dt, d, page) for page in (None, 16, 64, 256)]
                chosen += [C.select_decode(dt, d, page, few=few, many=many) for page in (None, 16, 64, 256)
                           for few in (False, True) for many in (False, True)]
                slicings = {C.value_slices(n, d, cuda, small) for n in range(1, 300) for small in (False, True)}
                for page in (None, 16, 64, 256):  # cached_forward: the few tile, sliced, paired by pair_blocks
                    multi = C.multi_block_steps(d)
                    unrolls = {2 if multi and C.pair_blocks(n, page is not None, cuda) else 1 for n in range(1, 300)}
                    few = C.select_decode(dt, d, page, few=True)
                    chosen += [replace(C.quad_tile(few) if multi and C.quad_blocks(v) else replace(few, unroll=u),
                                       v_slices=v)
                               for v in slicings for u in unrolls]  # cached_forward's order
                missing += [(dt, d, c) for c in chosen if c not in shipped]
        return missing

    assert uncovered() == []
    # D = 256 walks one block a step: two or four blocks' keys and values a stage exceed an SM's
    # shared memory, so none of its shipped tiles walks more
    assert C.HEAD_DIMS[-1] == 256 and not C.multi_block_steps(256) and C.multi_block_steps(128)
    assert all(c.unroll == 1 for dt in (torch.float32, torch.bfloat16) for c in C.shipped_forward_configs(dt, 256))
    shipped = C.shipped_forward_configs
    assert C.few_programs(16, 8, torch.device("cuda")) and not C.few_programs(17, 8, torch.device("cuda"))
    assert C.few_programs(1, 8, torch.device("cuda", 0))
    # the few-programs tile only where its programs fit one wave (two per SM)
    assert C.one_wave(264, cuda) and not C.one_wave(265, cuda) and not C.one_wave(1, torch.device("cpu"))
    # negative controls: the list as it was before the few-programs variants, and before the
    # paged prefill tile (each misses selections)
    monkeypatch.setattr(C, "shipped_forward_configs", lambda dt, d: [
        C.select_prefill(dt, d), C.select_decode(dt, d), C.select_decode(dt, d, page_size=1)])
    assert uncovered(), "an unlisted selection was not caught"
    monkeypatch.setattr(C, "shipped_forward_configs", lambda dt, d: [
        C.select_prefill(dt, d), *(C.select_decode(dt, d, p, few=f) for p in (None, 1) for f in (False, True))])
    assert any(c == C.table("paged_prefill")[(torch.bfloat16, 128)] for _, _, c in uncovered())
    monkeypatch.setattr(C, "shipped_forward_configs", lambda dt, d: [
        C.select_prefill(dt, d), C.select_prefill(dt, d, 1),
        *(C.select_decode(dt, d, p, few=f, many=m) for p in (None, 1) for f in (False, True) for m in (False, True))])
    assert uncovered() and all(c.v_slices > 1 or c.unroll > 1 for _, _, c in uncovered())
    # ... without the paired few-programs tiles (pair_blocks), without the four-block tiles
    # (quad_blocks), and without the many-pairs tile
    monkeypatch.setattr(C, "shipped_forward_configs", lambda dt, d: [c for c in shipped(dt, d) if c.unroll != 2])
    assert uncovered() and all(c.unroll == 2 for _, _, c in uncovered())
    monkeypatch.setattr(C, "shipped_forward_configs", lambda dt, d: [c for c in shipped(dt, d) if c.unroll != 4])
    assert uncovered() and all(c.unroll == 4 and c.v_slices > 1 for _, _, c in uncovered())
    monkeypatch.setattr(C, "shipped_forward_configs", lambda dt, d: [
        c for c in shipped(dt, d) if c != C.table("many_decode")[(dt, d)]])
    assert any(c == C.table("many_decode")[(dt, 128)] for dt, _, c in uncovered())


@interp
def test_interpreter_plain_launches_are_scoped():
    """``attention_tuning(pdl=False)`` turns programmatic dependent launch off inside its block only,
    and restores it when the block raises; off CUDA (and in the interpreter) it is never used."""
    from rl_engine.backends.triton.attention import eligibility as E

    assert current_tuning().pdl is True and not E.use_pdl(torch.device("cpu"))
    with attention_tuning(pdl=False):
        assert current_tuning().pdl is False
    assert current_tuning().pdl is True
    with pytest.raises(RuntimeError, match="inside"):
        with attention_tuning(pdl=False):
            raise RuntimeError("inside")
    assert current_tuning().pdl is True


@interp
def test_interpreter_value_slices_rule(monkeypatch):
    """``value_slices``: doubled while the doubled grid fits in one wave of SMs, at most 4,
    slices of at least 32 columns; 1 off CUDA (the picks of the H200's batch-1 rows).
    Over pages shorter than a key block: doubled while the doubled grid fits two programs per SM,
    at most 2. ``cached_forward`` asks it for few-programs decode steps unless
    ``attention_tuning(auto_value_slices=False)``, which restores the switch on the way out, an exception
    included, and tells it whether the pages are shorter than a key block; the rows are the same
    bits either way. Negative control: with the switch off the rule is never asked."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    assert C.value_slices(1, 128, torch.device("cpu")) == 1
    monkeypatch.setattr(C, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # batch 1, 8 kv heads: 512 keys (1 split), 4096 (4), 32768 (32); batch 16 at 4096 keys
    assert [C.value_slices(8 * s, 128, cuda) for s in (1, 4, 32)] == [4, 4, 1]
    assert C.value_slices(16 * 8 * 4, 128, cuda) == 1
    assert C.value_slices(8, 32, cuda) == 1 and C.value_slices(8, 64, cuda) == 2
    # 16-token pages: batch 1 at 512 / 4096 / 32768 keys, batch 4 at 4096 (128 programs)
    assert [C.value_slices(8 * s, 128, cuda, True) for s in (1, 4, 32)] == [2, 2, 1]
    assert C.value_slices(4 * 8 * 4, 128, cuda, True) == 2 and C.value_slices(133, 128, cuda, True) == 1
    assert C.value_slices(4 * 8 * 4, 128, cuda) == 1 and C.value_slices(8, 32, cuda, True) == 1
    assert current_tuning().auto_value_slices

    asked = []
    monkeypatch.setattr(C, "few_programs", lambda *a: True)  # the interpreter's CPU tensors: pretend few SMs' worth
    monkeypatch.setattr(C, "value_slices", lambda n, d, dev, small_pages=False: asked.append((n, small_pages)) or 2)
    q, k, v, cu = make_qkv([1100], 1, 2, 32, "float32", seed=13)
    args = (q[-1:].contiguous(), k, v, torch.zeros((1, 1), dtype=torch.int64), 2048, torch.zeros(1, dtype=torch.int64),
            torch.tensor([1099]), 0.2, None)
    with attention_tuning(auto_value_slices=False):
        plain = L.cached_forward(*args, decode_only=True)
    assert asked == [] and current_tuning().auto_value_slices
    sliced = L.cached_forward(*args, decode_only=True)
    assert asked == [(2, False)] and same_bits(sliced, plain)  # 1 sequence x 1 kv head x 2 splits
    for page, small in ((16, True), (64, False)):  # the same rows in pages (in order) of 16 and 64 keys
        rows = (torch.arange(-(-1100 // page)) * page)[None, :]
        paged = L.cached_forward(args[0], k, v, rows, page, *args[5:], decode_only=True)
        assert asked[-1] == (2, small) and same_bits(paged, plain)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_tuning(auto_value_slices=False):
            raise RuntimeError("boom")
    assert current_tuning().auto_value_slices


@interp
def test_interpreter_pair_blocks_rule(monkeypatch):
    """``pair_blocks``: two blocks per step for a decode step on the few-programs tile: over a
    contiguous cache with at most one program per SM (value slices counted; one KV split
    included), over pages with at most two programs per SM; False off CUDA.
    ``cached_forward`` asks it for the few-programs tile and the rows are the same bits either
    way; steps of many pairs take the 2-warp tile. Negative control: a rule answering True pairs
    the walk (the config the kernels get has ``unroll = 2``), one answering False does not."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    assert not C.pair_blocks(1, False, torch.device("cpu"))
    monkeypatch.setattr(C, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # contiguous: batch 1 / 4 at 4096 keys (128 programs), batch 1 at 32768 (256), batch 16 at 512 (one split)
    assert C.pair_blocks(128, False, cuda) and not C.pair_blocks(256, False, cuda)
    assert C.pair_blocks(132, False, cuda) and not C.pair_blocks(133, False, cuda)
    # pages: up to two programs per SM; batch 4 at 32768 keys (1024) not
    assert C.pair_blocks(32, True, cuda) and C.pair_blocks(264, True, cuda)
    assert not C.pair_blocks(265, True, cuda) and not C.pair_blocks(1024, True, cuda)
    # the many-pairs tile on both cache kinds (paged steps of 2-4 splits included)
    assert all(C.select_decode(torch.bfloat16, 128, p, many=True) == C.AttnConfig(16, 2, 2) for p in (None, 16))
    assert C.select_decode(torch.bfloat16, 128, 16) == C.AttnConfig(16, 4, 2)
    assert C.select_decode(torch.bfloat16, 128, None, few=True, many=False) == C.AttnConfig(16, 4, 3)

    seen, asked = [], []
    attend = L.attend
    monkeypatch.setattr(L, "attend", lambda *a, **kw: seen.append(kw["config"]) or attend(*a, **kw))
    monkeypatch.setattr(C, "few_programs", lambda *a: True)
    monkeypatch.setattr(C, "one_wave", lambda *a: True)
    q, k, v, cu = make_qkv([1100], 1, 2, 32, "float32", seed=13)

    def step(rule):
        monkeypatch.setattr(C, "pair_blocks", lambda n, paged, dev: asked.append((n, paged)) or rule)
        return L.cached_forward(q[-1:].contiguous(), k, v, torch.zeros((1, 1), dtype=torch.int64), 2048,
                                torch.zeros(1, dtype=torch.int64), torch.tensor([1099]), 0.2, None, decode_only=True)

    with attention_tuning(auto_value_slices=False):
        plain, paired = step(False), step(True)
    assert asked == [(2, False), (2, False)] and [c.unroll for c in seen] == [1, 2]  # 1 seq x 1 kv head x 2 splits
    assert same_bits(plain, paired)


@interp
def test_interpreter_quad_blocks_rule(monkeypatch, tuned):
    """``quad_blocks``: four blocks a step exactly where ``value_slices`` sliced a decode step on
    the few-programs tile (``v_slices >= 2``) and ``AttentionTuning.four_block_steps`` is on
    (``attention_tuning`` restores it, also when its block raises); ``cached_forward`` asks it before ``pair_blocks``,
    launches ``quad_tile`` (4 warps) and the rows are the same bits either way (the three-run walk forced on, so the four-block
    steps run). A four-block config on a tile other than 16 rows is rejected with the reason.
    Negative control: with the rule off the kernels get the paired walk (``unroll = 2``)."""
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    assert C.quad_blocks(2) and C.quad_blocks(4) and not C.quad_blocks(1)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_tuning(four_block_steps=False):
            assert not C.quad_blocks(4)
            raise RuntimeError("boom")
    assert current_tuning().four_block_steps and C.quad_blocks(2)
    seen = []
    attend = L.attend
    monkeypatch.setattr(L, "attend", lambda *a, **kw: seen.append(kw["config"]) or attend(*a, **kw))
    monkeypatch.setattr(C, "few_programs", lambda *a: True)
    monkeypatch.setattr(C, "one_wave", lambda *a: True)
    monkeypatch.setattr(C, "value_slices", lambda *a, **kw: 2)
    monkeypatch.setattr(C, "pair_blocks", lambda *a: True)
    tuned(split_runs=True)
    q, k, v, cu = make_qkv([1100], 1, 2, 32, "float32", seed=17)

    def step():
        return L.cached_forward(q[-1:].contiguous(), k, v, torch.zeros((1, 1), dtype=torch.int64), 2048,
                                torch.zeros(1, dtype=torch.int64), torch.tensor([1099]), 0.2, None, decode_only=True)

    quad = step()
    assert (seen[-1].unroll, seen[-1].v_slices, seen[-1].num_warps) == (4, 2, 4)
    with attention_tuning(four_block_steps=False):
        paired = step()
    assert (seen[-1].unroll, seen[-1].v_slices) == (2, 2)
    # the paged few-programs tile (2 warps) takes 4 warps for four blocks a step (quad_tile)
    paged_few = C.select_decode(torch.bfloat16, 128, 16, few=True)
    assert paged_few.num_warps == 2 and C.quad_tile(paged_few) == replace(paged_few, num_warps=4, unroll=4)
    assert same_bits(quad, paired)
    ref = L.varlen_forward(q, k, v, cu, 0.2, None)[0]
    assert same_bits(quad, ref[-1:])
    with pytest.raises(ValueError, match="unroll=4 takes 16-row tiles"):
        L.varlen_forward(q, k, v, cu, 0.2, None, config=C.AttnConfig(64, 4, 2, unroll=4))


@interp
def test_interpreter_few_pairs_decode_tile_rule(monkeypatch):
    """``cached_forward``'s decode tile for a step with few (sequence, kv head) pairs: the
    few-programs tile when its programs fit one wave (``one_wave``, False off CUDA), whatever the
    number of KV splits, else
    the many-programs tile; with many pairs always the latter. The rows are the same bits whichever
    is picked (GPU: every shipped config). Negative control: the rule's answer is what decides (a
    ``one_wave`` answering True takes the few-programs tile at every split count)."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    asked = []
    select = C.select_decode
    monkeypatch.setattr(C, "select_decode", lambda *a, few=False, many=False, arch=None: asked.append((few, many)) or select(
        *a, few=few, many=many, arch=arch))
    q, k, v, cu = make_qkv([1100], 1, 2, 32, "float32", seed=13)

    def step(bound):
        return L.cached_forward(q[-1:].contiguous(), k, v, torch.zeros((1, 1), dtype=torch.int64), bound,
                                torch.zeros(1, dtype=torch.int64), torch.tensor([1099]), 0.2, None, decode_only=True)

    monkeypatch.setattr(C, "few_programs", lambda *a: True)
    bounds = (2048, 4096, 5120, 8192)  # 2, 4, 5, 8 splits
    rows = {bound: step(bound) for bound in bounds}  # one_wave: False off CUDA
    # (few, many): past one wave the many-pairs tile, at every split count
    assert asked == [(False, True)] * 4
    monkeypatch.setattr(C, "one_wave", lambda *a: True)
    asked.clear()
    rows.update({-bound: step(bound) for bound in bounds})
    assert asked == [(True, False)] * 4
    assert all(same_bits(r, rows[2048]) for r in rows.values())
    monkeypatch.setattr(C, "few_programs", lambda *a: False)
    asked.clear()
    step(8192)
    assert asked == [(False, True)]


@interp
def test_interpreter_head_dim_256_decode_walks_one_block_a_step(monkeypatch):
    """``launch.cached_forward`` on the few-programs decode tile (forced on the CPU: fewer pairs
    than SMs, one wave, two value slices) walks one key block a step at ``D = 256``
    (``configs.multi_block_steps``: two or four blocks' keys and values a stage exceed an SM's
    shared memory) and gives the rows of the varlen forward; the control: at ``D = 32`` the same
    step takes the four-block walk (``quad_blocks``)."""
    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention import launch as L

    monkeypatch.setattr(C, "few_programs", lambda seqs, heads, device: True)
    monkeypatch.setattr(C, "one_wave", lambda programs, device: True)
    monkeypatch.setattr(C, "value_slices", lambda programs, d, device, small_pages=False: 2)
    seen = []
    attend = L.attend
    monkeypatch.setattr(L, "attend", lambda *a, **kw: seen.append(kw["config"]) or attend(*a, **kw))
    for d in (256, 32):
        lens = [40, 70]
        q, k, v, cu = make_qkv(lens, 1, 2, d, "float32", seed=d)
        ref = L.varlen_forward(q, k, v, cu, d**-0.5, None)[0]
        last = (cu[1:] - 1).long()
        out = L.cached_forward(q[last].contiguous(), k, v, cu[:-1].to(torch.int64)[:, None].contiguous(), 128,
                               torch.arange(2), torch.tensor(lens) - 1, d**-0.5, None, path="decode",
                               decode_only=True)
        assert same_bits(out, ref[last]), d
        assert seen[-1].v_slices == 2 and seen[-1].unroll == (1 if d == 256 else 4), (d, seen[-1])
    # negative control: without the rule, D = 256 would take the four-block walk
    monkeypatch.setattr(C, "multi_block_steps", lambda d: True)
    q, k, v, cu = make_qkv([40, 70], 1, 2, 256, "float32", seed=256)
    last = (cu[1:] - 1).long()
    L.cached_forward(q[last].contiguous(), k, v, cu[:-1].to(torch.int64)[:, None].contiguous(), 128, torch.arange(2),
                     torch.tensor([39, 69]), 256**-0.5, None, path="decode", decode_only=True)
    assert seen[-1].unroll == 4
