"""Triton ``moe.route`` / ``moe.expert_gate_up`` / ``moe.expert_down_combine`` (impl
``triton.grouped``): the one test module of this operator target.

CPU tests: registration (CUDA, untested ROCm), CPU tensors route to the CPU backend, pure
eligibility checks. Triton-interpreter tests (``-k interpreter``, ``TRITON_INTERPRET=1`` in
.venv-vllm; fp32 and tiny shapes — the interpreter's bf16 ``tl.dot`` is not usable): accuracy of
every output and gradient against the CPU implementation, the tie rule, a token's bits
independent of its experts' loads and of the tile shape ``BLOCK_M`` (negative control: a
``BLOCK_K`` that follows the load changes them), the launch variants' bits, tensor-parallel
shards, run-to-run determinism. CPU tests of the tile table (``tiles.py``): selection by load,
validation with negative controls, the shipped tables load.
GPU tests (``@pytest.mark.gpu``, zero skips on the device): accuracy against float64 in fp32 and
bf16, row invariance (Hypothesis) and expert-load independence on raw bits, every shipped tile
configuration's bits, shards, run to run including weight gradients, dispatch, profiler names,
a CUDA-graph capture (no host synchronisation), ``opcheck``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import moe
from rl_engine.reference.moe import expert_down_combine_f64, expert_gate_up_f64, route_f64
from rl_engine.runtime import provenance
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.backends.triton._rowwise_common import (
    accuracy,
    check_cpu_routing,
    check_profiler_names,
    check_registration,
    check_static_and_fake_gpu,
    interp,
)
from tests.helpers.strategies import row_trials
from tests.helpers.tables import assert_each_refused

OPS = ("moe.route", "moe.expert_gate_up", "moe.expert_down_combine")
IMPL = "triton.grouped"
MODULE = "rl_engine.backends.triton.moe"
DTYPES = ("float32", "bfloat16")
gpu = pytest.mark.gpu


def _block(T, H, E, I, K, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    wgu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    wd = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return [t.to(device) for t in (x, wgu, wd, ids, w)]


def _kernels():
    from rl_engine.backends.triton.moe import kernels

    return kernels


# --------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("op", OPS)
def test_registration_declares_cuda_and_untested_rocm(op):
    check_registration(op, IMPL, MODULE, "moe")


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_route_to_cpu_and_checks_are_pure(op):
    check_cpu_routing(op, IMPL, torch.randn(2, 8))
    check_static_and_fake_gpu(op, IMPL)


# --------------------------------------------------------------------------- Triton interpreter


def _cfg(bm=16, bn=16, bk=16):
    return _kernels().GemmConfig(bm, bn, bk, 1)


@interp
@pytest.mark.parametrize("renormalize", [True, False])
def test_interpreter_route_matches_cpu_and_the_tie_rule(renormalize):
    from rl_engine.backends.cpu import moe as cpu

    kern = _kernels()
    z = torch.randn(9, 12, generator=torch.Generator().manual_seed(1))
    z[3] = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0, 0, 0, 0, 0, 0, 0])  # ties go to the lower id
    w, ids = kern.route_forward(z, 3, renormalize)
    w2, ids2 = cpu.moe_route_cpu(z, 3, renormalize)
    assert torch.equal(ids, ids2) and ids[3].tolist() == [1, 2, 4]
    tol = contracts.tolerance("moe.route", torch.float32, "forward")
    assert tol.check(w, w2.double())
    g = torch.randn(9, 3, generator=torch.Generator().manual_seed(2))
    dz, dz2 = kern.route_backward(g, z, ids, renormalize), cpu.moe_route_cpu_backward(g, z, ids, renormalize)
    assert contracts.tolerance("moe.route", torch.float32, "backward").check(dz, dz2.double())


@interp
def test_interpreter_experts_match_cpu_forward_and_backward():
    from rl_engine.backends.cpu import moe as cpu

    kern = _kernels()
    x, wgu, wd, ids, w = _block(7, 24, 5, 12, 2, seed=3)
    act, act_c = kern.gate_up_forward(x, wgu, ids, _cfg()), cpu.moe_expert_gate_up_cpu(x, wgu, ids)
    out, out_c = kern.down_combine_forward(act_c, wd, w, ids, _cfg()), cpu.moe_expert_down_combine_cpu(act_c, wd, w, ids)
    fwd = contracts.tolerance("moe.expert_gate_up", torch.float32, "forward")
    assert fwd.check(act, act_c.double()) and fwd.check(out, out_c.double())
    g = torch.Generator().manual_seed(4)
    ga, go = torch.randn(act.shape, generator=g), torch.randn(out.shape, generator=g)
    bwd = contracts.tolerance("moe.expert_gate_up", torch.float32, "backward")
    for got, want in zip(kern.gate_up_backward(ga, x, wgu, ids, _cfg()), cpu.moe_expert_gate_up_cpu_backward(ga, x, wgu, ids)):
        assert bwd.check(got, want.double())
    for got, want in zip(kern.down_combine_backward(go, act_c, wd, w, ids, _cfg()),
                         cpu.moe_expert_down_combine_cpu_backward(go, act_c, wd, w, ids)):
        assert bwd.check(got, want.double())


def _alone_vs_loaded(cfg_alone, cfg_batch):
    """Token 0's gate/up and down+combine bits alone vs inside a batch whose other tokens load its
    experts with 1 .. 40 slots, each call with its own config."""
    kern = _kernels()
    x, wgu, wd, ids, w = _block(41, 40, 6, 24, 2, seed=5)
    ids[:, 0] = ids[0, 0]  # every token also uses token 0's first expert
    act1 = kern.gate_up_forward(x[:1], wgu, ids[:1], cfg_alone)
    out1 = kern.down_combine_forward(act1, wd, w[:1], ids[:1], cfg_alone)
    act = kern.gate_up_forward(x, wgu, ids, cfg_batch)
    out = kern.down_combine_forward(act, wd, w, ids, cfg_batch)
    return same_bits(act1, act[:1]), same_bits(out1, out[:1])


@interp
@pytest.mark.parametrize("block_m", [16, 32])
def test_interpreter_token_bits_do_not_depend_on_expert_load_or_block_m(block_m):
    a, o = _alone_vs_loaded(_cfg(bm=16), _cfg(bm=block_m))
    assert a and o, (a, o)


@interp
def test_interpreter_load_dependent_block_k_negative_control():
    """A kernel that picks its K step from the expert's load (here: 8 alone, 16 in the batch)
    changes the summation order, and the same comparison catches it."""
    a, o = _alone_vs_loaded(_cfg(bk=8), _cfg(bk=16))
    assert not (a and o)


@interp
def test_interpreter_tensor_parallel_shards_and_run_to_run():
    kern = _kernels()
    x, wgu, wd, ids, w = _block(9, 32, 4, 16, 2, seed=6)
    act = kern.gate_up_forward(x, wgu, ids, _cfg())
    out = kern.down_combine_forward(act, wd, w, ids, _cfg())
    assert same_bits(kern.gate_up_forward(x, wgu, ids, _cfg()), act)
    shard = torch.cat([wgu[:, :8], wgu[:, 16:24]], 1).contiguous()
    assert same_bits(kern.gate_up_forward(x, shard, ids, _cfg()), act[..., :8])
    assert same_bits(kern.down_combine_forward(act, wd[:, 16:].contiguous(), w, ids, _cfg()), out[:, 16:])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    first = kern.down_combine_backward(g, act, wd, w, ids, _cfg())
    again = kern.down_combine_backward(g, act, wd, w, ids, _cfg())
    assert all(same_bits(a, b) for a, b in zip(first, again))


@interp
def test_interpreter_launch_variants_give_the_same_bits():
    """The tile table's launch choices — a transposed copy of the weights for the input
    gradients, operands gathered into slot order for the weight gradients, masked instead of
    clamped edge columns — change where the kernels load from, not what they multiply: every
    backward output keeps its bits (the shapes leave partial edge tiles)."""
    import dataclasses

    kern = _kernels()
    x, wgu, wd, ids, w = _block(11, 40, 4, 12, 2, seed=8)  # 40 and 24 columns: partial 16-wide edge tiles
    act = kern.gate_up_forward(x, wgu, ids, _cfg())
    g = torch.Generator().manual_seed(9)
    ga, go = torch.randn(act.shape, generator=g), torch.randn(11, 40, generator=g)
    plain = _cfg()
    for variant in (dataclasses.replace(plain, w_transposed=True), dataclasses.replace(plain, sorted_operands=True),
                    dataclasses.replace(plain, masked_loads=True)):
        for a, b in zip(kern.gate_up_backward(ga, x, wgu, ids, plain), kern.gate_up_backward(ga, x, wgu, ids, variant)):
            assert same_bits(a, b), variant
        for a, b in zip(kern.down_combine_backward(go, act, wd, w, ids, plain),
                        kern.down_combine_backward(go, act, wd, w, ids, variant)):
            assert same_bits(a, b), variant


@interp
def test_interpreter_saved_gate_up_result_gives_the_recomputed_bits():
    """The custom op keeps the forward's gate/up GEMM result ``h`` for the backward instead of
    recomputing it: the same ``act`` and the same gradients, bit for bit."""
    kern = _kernels()
    x, wgu, _, ids, _ = _block(13, 40, 4, 12, 2, seed=10)
    act, h = kern.gate_up_forward_saving(x, wgu, ids, _cfg())
    assert h.shape == (13 * 2, 24) and same_bits(act, kern.gate_up_forward(x, wgu, ids, _cfg()))
    ga = torch.randn(act.shape, generator=torch.Generator().manual_seed(11))
    for a, b in zip(kern.gate_up_backward(ga, x, wgu, ids, _cfg(), h=h), kern.gate_up_backward(ga, x, wgu, ids, _cfg())):
        assert same_bits(a, b)
    # negative control: a different h changes dx (the backward does read what it is given)
    dx_wrong, _ = kern.gate_up_backward(ga, x, wgu, ids, _cfg(), h=h * 2)
    assert not same_bits(dx_wrong, kern.gate_up_backward(ga, x, wgu, ids, _cfg())[0])


def test_tile_table_selection_by_load_and_its_validation(tmp_path):
    """``tiles.load_table`` / ``tiles.select``: rows ordered by bound, the first row whose bound
    covers the load, the reference configuration beyond the last bound, without a table or off
    the GPU; a malformed table is refused with the field named (negative controls)."""
    import json

    from rl_engine.backends.triton.moe import tiles

    def row(role, bound, bm, **kw):
        return {"role": role, "dtype": "bfloat16", "max_slots_per_expert": bound,
                "config": {"block_m": bm, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 3, **kw}}

    good = {"schema_version": 1, "arch": "smX", "source": {"command": "test"},
            "rows": [row("dx", 1.0, 16), row("dx", 64.0, 64, w_transposed=True), row("dx", None, 128)]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good))
    rows = tiles.load_table(path)[("dx", torch.bfloat16)]
    assert [b for b, _ in rows] == [1.0, 64.0, float("inf")]
    assert rows[1][1] == tiles.GemmConfig(64, 64, 32, 4, 3, w_transposed=True)
    assert tiles.select("dx", torch.bfloat16, 3.0, torch.device("cpu")) == tiles.DEFAULT
    bad_order = dict(good, rows=[row("dx", 64.0, 64), row("dx", 1.0, 16)])
    bad_field = dict(good, rows=[row("dx", 1.0, 16, colour=1)])
    bad_role = dict(good, rows=[row("dy", 1.0, 16)])
    bad_tile = dict(good, rows=[row("dx", 1.0, 24)])
    assert_each_refused(tiles.load_table, {"strictly increasing": bad_order, "colour": bad_field, "role": bad_role,
                                           "block_m": bad_tile}, tmp_path)


def test_tile_table_select_walks_the_rows(monkeypatch):
    from rl_engine.backends.triton.moe import tiles

    small, mid, big = tiles.GemmConfig(16, 64), tiles.GemmConfig(64, 128), tiles.GemmConfig(128, 128, num_warps=8)
    table = {("dw_down", torch.bfloat16): ((0.5, small), (8.0, mid), (float("inf"), big))}
    monkeypatch.setattr(tiles, "_arch_table", lambda arch: table)
    monkeypatch.setattr(tiles, "arch_of", lambda device: "smX" if device.type == "cuda" else None)
    cuda = torch.device("cuda", 0)
    assert [tiles.select("dw_down", torch.bfloat16, spe, cuda) for spe in (0.0625, 0.5, 0.51, 8.0, 1024.0)] == [
        small, small, mid, mid, big]
    assert tiles.select("dw_down", torch.float32, 1024.0, cuda) == tiles.DEFAULT  # no fp32 rows
    table[("dw_down", torch.bfloat16)] = ((0.5, small), (8.0, mid))  # measured up to 8 slots per expert
    assert tiles.select("dw_down", torch.bfloat16, 8.5, cuda) == tiles.DEFAULT  # no extrapolation
    assert tiles.select("dx", torch.bfloat16, 1024.0, cuda) == tiles.DEFAULT
    assert tiles.shipped_configs("smX") == [tiles.DEFAULT, small, mid]
    assert tiles.GemmConfig.from_key(mid.key) == mid and tiles.GemmConfig.from_key("64x64x32w4s3TS") == tiles.GemmConfig(
        w_transposed=True, sorted_operands=True)
    with pytest.raises(ValueError, match="key"):
        tiles.GemmConfig.from_key("64x64x32")
    assert tiles.GemmConfig.from_key("64x64x32w4s3SM") == tiles.GemmConfig(sorted_operands=True, masked_loads=True)


def test_shipped_tile_tables_load():
    """Every table in the package validates, and names the architecture of its file."""
    import json

    from rl_engine.backends.triton.moe import tiles

    paths = sorted(tiles.table_path("x").parent.glob("*.json"))
    for path in paths:
        assert json.loads(path.read_text())["arch"] == path.stem
        assert tiles.load_table(path)


# --------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64, 8, 32, 2), (37, 256, 16, 128, 4), (300, 1024, 32, 384, 8)])
def test_accuracy_forward_and_every_grad(dtype, shape):
    T, H, E, I, K = shape
    dt = getattr(torch, dtype)
    x, wgu, wd, ids, _ = _block(T, H, E, I, K, dt, seed=8, device="cuda")
    wr = (torch.randn(E, H, generator=torch.Generator().manual_seed(9)) / H**0.5).to(dt).cuda()
    z = (x.float() @ wr.float().T).to(dt)
    leaves = [t.clone().requires_grad_() for t in (x, wgu, wd, z)]
    with provenance.record() as recs:
        w, ids = moe.route(leaves[3], K, True)
        out = moe.experts(leaves[0], leaves[1], leaves[2], w, ids)
    assert {r.impl_id for r in recs} == {IMPL}
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(10)).to(dt).cuda()
    out.backward(up)
    refs = [t.detach().cpu().double().requires_grad_() for t in (x, wgu, wd, z)]
    w64, ids64 = route_f64(refs[3], K, True)
    assert torch.equal(ids.cpu(), ids64) or dt == torch.bfloat16
    w64 = route_f64(refs[3], K, True)[0] if torch.equal(ids.cpu(), ids64) else refs[3].softmax(-1).gather(-1, ids.cpu())
    out64 = expert_down_combine_f64(expert_gate_up_f64(refs[0], refs[1], ids.cpu()), refs[2], w64, ids.cpu())
    out64.backward(up.cpu().double())
    accuracy("moe.expert_down_combine", dt, "forward", out, out64)
    for name, got, want in zip(("x", "w_gate_up", "w_down", "logits"), leaves, refs):
        scale = float(want.grad.abs().max())
        accuracy("moe.expert_down_combine", dt, "backward", got.grad.double() / scale, want.grad / scale, name)


def _on_gpu_experts(x, ids, w, wgu, wd):
    return moe.experts(x.cuda(), wgu.cuda(), wd.cuda(), w.cuda(), ids.cuda()).cpu()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60)
@given(data=st.data(), T=st.integers(1, 64), K=st.sampled_from([1, 2, 8]))
def test_row_invariance_forward_and_grads_hypothesis(dtype, data, T, K):
    x, wgu, wd, ids, w = _block(T, 256, 16, 96, K, getattr(torch, dtype), seed=T * 5 + K)
    rep = check_row_invariance(_on_gpu_experts, [x, ids, w], data.draw(row_trials(T)), (wgu, wd), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_bits_do_not_depend_on_expert_load(dtype):
    dt = getattr(torch, dtype)
    x, wgu, wd, ids, w = _block(4097, 2048, 128, 768, 8, dt, seed=11, device="cuda")
    ids[:, 0] = ids[0, 0]
    alone = moe.experts(x[:1], wgu, wd, w[:1], ids[:1])
    for n in (2, 17, 300, 4097):
        assert same_bits(moe.experts(x[:n], wgu, wd, w[:n], ids[:n])[:1], alone), n


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_parallel_shards_and_run_to_run_with_weight_grads(dtype):
    dt = getattr(torch, dtype)
    x, wgu, wd, ids, w = _block(513, 1024, 32, 512, 4, dt, seed=12, device="cuda")
    act = moe.expert_gate_up(x, wgu, ids)
    out = moe.expert_down_combine(act, wd, w, ids)
    shard = torch.cat([wgu[:, 128:256], wgu[:, 512 + 128:512 + 256]], 1).contiguous()
    assert same_bits(moe.expert_gate_up(x, shard, ids), act[..., 128:256])
    assert same_bits(moe.expert_down_combine(act, wd[:, 256:512].contiguous(), w, ids), out[:, 256:512])
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, wgu, wd, w)]
        moe.experts(leaves[0], leaves[1], leaves[2], leaves[3], ids).sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(same_bits(a, b) for a, b in zip(*grads))


@gpu
def test_profiler_names_and_graph_capture():
    x, wgu, wd, ids, w = _block(64, 512, 16, 256, 4, torch.bfloat16, seed=13, device="cuda")
    z = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16).requires_grad_()
    xx = x.clone().requires_grad_()

    def call():
        ww, ii = moe.route(z, 4, True)
        moe.experts(xx, wgu, wd, ww, ii).sum().backward()

    check_profiler_names(f"{MODULE}.kernels", call, {"rlk_moe_route_fwd", "rlk_moe_route_bwd", "rlk_moe_grouped_gemm",
                                                      "rlk_moe_wgrad", "rlk_moe_combine", "rlk_moe_slot_dot"}, "moe")
    # a decode step in a CUDA graph: no host synchronisation anywhere in the forward
    from rl_engine.utils.checks import nan_policy

    xs, zs = x[:8].clone(), z.detach()[:8].clone()
    with torch.no_grad(), nan_policy("propagate"):
        ref = moe.experts(xs, wgu, wd, *moe.route(zs, 4, True))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe.experts(xs, wgu, wd, *moe.route(zs, 4, True))
        graph.replay()
    torch.cuda.synchronize()
    assert same_bits(y, ref)


@gpu
@pytest.mark.parametrize("shape", [(300, 512, 16, 256, 4), (97, 264, 8, 72, 2)])
def test_every_shipped_tile_configuration_gives_the_reference_bits(shape):
    """Each configuration the device's tile table can launch (``tiles.shipped_configs``), and the
    launch variants on the reference tile, give the reference configuration's bits for every
    forward output and gradient (bf16; the token counts cross several tiles per expert; the second
    shape leaves partial edge tiles in every dimension)."""
    import dataclasses

    from rl_engine.backends.triton.moe import tiles

    kern = _kernels()
    T, H, E, I, K = shape
    x, wgu, wd, ids, w = _block(T, H, E, I, K, torch.bfloat16, seed=15, device="cuda")
    g = torch.Generator().manual_seed(16)
    ga = torch.randn(T, K, I, generator=g).to(torch.bfloat16).cuda()
    go = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()

    def run(cfg):
        act = kern.gate_up_forward(x, wgu, ids, cfg)
        return (act, kern.down_combine_forward(act, wd, w, ids, cfg), *kern.gate_up_backward(ga, x, wgu, ids, cfg),
                *kern.down_combine_backward(go, act, wd, w, ids, cfg))

    ref = run(tiles.DEFAULT)
    configs = tiles.shipped_configs(tiles.arch_of(torch.device("cuda")))
    configs += [dataclasses.replace(tiles.DEFAULT, w_transposed=True), dataclasses.replace(tiles.DEFAULT, sorted_operands=True),
                dataclasses.replace(tiles.DEFAULT, masked_loads=True)]
    for cfg in configs:
        for i, (a, b) in enumerate(zip(run(cfg), ref)):
            assert same_bits(a, b), (cfg.key, i)


@gpu
def test_public_backward_with_the_saved_gate_up_result_matches_the_recomputing_kernels():
    """Autograd through ``moe.expert_gate_up`` reads the forward's saved ``h``: its gradients are
    the bits of the backward kernels that recompute ``h``."""
    kern = _kernels()
    x, wgu, _, ids, _ = _block(70, 256, 8, 96, 2, torch.bfloat16, seed=17, device="cuda")
    xx, ww = x.clone().requires_grad_(), wgu.clone().requires_grad_()
    act = moe.expert_gate_up(xx, ww, ids)
    ga = torch.randn(act.shape, generator=torch.Generator().manual_seed(18)).to(torch.bfloat16).cuda()
    act.backward(ga)
    dx, dw = kern.gate_up_backward(ga, x, wgu, ids)
    assert same_bits(act.detach(), kern.gate_up_forward(x, wgu, ids))
    assert same_bits(xx.grad, dx) and same_bits(ww.grad, dw)


@gpu
def test_custom_ops_pass_opcheck():
    x, wgu, wd, ids, w = _block(5, 64, 4, 32, 2, torch.bfloat16, seed=14, device="cuda")
    z = torch.randn(5, 4, device="cuda")
    act = moe.expert_gate_up(x, wgu, ids).detach()
    torch.library.opcheck(torch.ops.rlk.moe_route_triton.default, (z.requires_grad_(), 2, True))
    torch.library.opcheck(torch.ops.rlk.moe_expert_gate_up_triton.default, (x.requires_grad_(), wgu.requires_grad_(), ids))
    torch.library.opcheck(torch.ops.rlk.moe_expert_down_combine_triton.default,
                          (act.requires_grad_(), wd.requires_grad_(), w.requires_grad_(), ids))


def test_kernels_module_is_not_imported_by_registration():
    assert importlib.util.find_spec(MODULE) is not None
