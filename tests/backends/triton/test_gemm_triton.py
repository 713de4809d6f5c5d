"""Triton gemm.linear (impl ``triton.tile_gemm``), the one test module of this operator target.

GPU tests (``@pytest.mark.gpu``; CPU CI skips them with the reason from tests/conftest.py, the
device run must show zero skips): accuracy against float64 (contract tolerances), raw-bit
equality of every shipped tile configuration, row invariance across M buckets (forward and dx),
column-chunk invariance, run-to-run determinism of y/dx/dW/db, a planted non-invariant negative
control, dispatch/provenance, the profiler-name rule (``rlk_`` prefix) and a bounded-performance
smoke. CPU tests (always run): ``import`` compiles/imports nothing, registration and strict
rejection reasons on CPU tensors.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine import contracts
from rl_engine.ops import gemm
from rl_engine.reference.gemm import linear_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import Request, implementations, make_request, select
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.backends.triton._rowwise_common import (defined_kernel_names, evidence, gpu_kernel_events, graph_us, interp,
                                                   run_py)
from tests.helpers.strategies import row_trials
from tests.helpers.tables import assert_each_refused

OP = "gemm.linear"
IMPL = "triton.tile_gemm"
GPU_DTYPES = ("float32", "bfloat16", "float16")
gpu = pytest.mark.gpu


def _dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def _data(m, k, n, dtype, seed=0, bias=True, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    dt = _dt(dtype)
    x = torch.randn(m, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dt)
    b = torch.randn(n, generator=g).to(dt) if bias else None
    mv = (lambda t: t.to(device) if t is not None else None)
    return mv(x), mv(w), mv(b)


def _kernels():
    from rl_engine.backends.triton.gemm import kernels

    return kernels


# ------------------------------------------------------------------------------------------
# CPU: import hygiene, registration, rejection reasons


def test_import_rl_engine_imports_no_triton():
    run_py("import sys, rl_engine\nbad = [m for m in sys.modules if m.split('.')[0] == 'triton']\nassert not bad, bad\n")


def test_registration_and_cpu_dispatch_do_not_load_our_kernels():
    """Listing implementations and running a CPU call registers the Triton backend without
    importing its kernel module, so nothing of ours is compiled (torch itself may import triton
    on a GPU build; that is not our compile)."""
    run_py(
        "import sys, torch\n"
        "from rl_engine.runtime.registry import implementations\n"
        "ids = [i.impl_id for i in implementations('gemm.linear')]\n"
        "assert 'triton.tile_gemm' in ids, ids\n"
        "from rl_engine.ops import gemm\n"
        "gemm.linear(torch.randn(2, 8), torch.randn(3, 8))\n"
        "assert 'rl_engine.backends.triton.gemm' in sys.modules\n"
        "assert 'rl_engine.backends.triton.gemm.kernels' not in sys.modules\n"
    )


def test_registration_declares_cuda_and_untested_rocm():
    impl = next(i for i in implementations(OP) if i.impl_id == IMPL)
    assert impl.families == ("cuda", "rocm")
    assert impl.untested_families == ("rocm",)
    assert set(impl.dtypes) == {torch.float32, torch.bfloat16, torch.float16}
    assert impl.guarantees >= contracts.load_contract(OP).guarantees
    assert impl.module == "rl_engine.backends.triton.gemm"


def test_cpu_tensors_route_to_cpu_with_sane_rejection_reasons():
    req = make_request(OP, torch.randn(4, 8))
    chosen, _ = select(req)
    assert chosen is not None and chosen.impl_id == "cpu.exact_sum"
    impl = next(i for i in implementations(OP) if i.impl_id == IMPL)
    assert "platform family 'cpu' not in ['cuda', 'rocm']" in impl.reject_reasons(req)
    # fp16 is GPU-only: the entry point rejects it on CPU tensors, naming the argument
    with pytest.raises(ValueError, match="^x: expected dtype"):
        gemm.linear(torch.randn(2, 8).half(), torch.randn(3, 8).half())


def test_static_and_arch_checks_are_pure_and_specific():
    from rl_engine.backends.triton import arch_reasons

    impl = next(i for i in implementations(OP) if i.impl_id == IMPL)
    before = set(sys.modules)
    impl.unavailable_reasons()
    assert not any(m == "triton" or m.startswith("triton.") for m in set(sys.modules) - before)
    assert arch_reasons("cuda", "sm75") and "sm80" in arch_reasons("cuda", "sm75")[0]
    assert arch_reasons("cuda", "sm90") == [] and arch_reasons("rocm", "gfx942") == []
    cpu = make_request(OP, torch.randn(1, 1)).platform
    fake_gpu = type(cpu)(family="cuda", arch="sm90", device_name="x", torch_version="t", triton_version=None,
                         cuda_version=None, hip_version=None)
    reasons = impl.reject_reasons(Request(OP, fake_gpu, torch.float64, frozenset({"row"})))
    assert any("dtype torch.float64 not in" in r for r in reasons)


def test_tail_split_runs_a_half_full_last_wave_as_half_tiles():
    """``configs.tail_split`` (pure, CPU): the full waves' tile count when the last wave is at most
    half full, else None; ``tail_config`` halves the tile's width. Qwen3-8B on 132 SMs: 3072
    tiles of 128 x 256 (qkv M = 16384, gate_up M = 4096) split at 23 waves; 19008 (lm_head
    M = 4096, 144 waves exactly) and 768 (qkv M = 4096, the last wave 82 % full) do not."""
    from rl_engine.backends.triton.gemm.configs import (forward_table, select_forward, shipped_configs, tail_config,
                                                        tail_split)

    assert tail_split(3072, 132) == 3036
    assert tail_split(12288, 132) == 12276  # gate_up M = 16384: 93 waves and 12 tiles
    assert tail_split(19008, 132) is None and tail_split(768, 132) is None
    assert tail_split(100, 132) is None  # one partial wave: nothing to move
    assert tail_split(132 + 66, 132) == 132 and tail_split(132 + 67, 132) is None  # "at most half full"
    assert tail_split(12, 8) == 8  # the GPU test's shape: 3 x 4 tiles on 8 programs
    for bad in ((0, 132), (10, 0), (-1, 4)):
        with pytest.raises(ValueError, match="positive counts"):
            tail_split(*bad)
    big = select_forward(torch.bfloat16, 16384, 6144)
    half = tail_config(big)
    assert (half.block_m, half.block_n, half.block_k, half.num_warps, half.num_stages, half.group_m) == (
        big.block_m, big.block_n // 2, big.block_k, big.num_warps, big.num_stages, big.group_m)
    assert half.persistent and half.epilogue_subtile == big.epilogue_subtile
    with pytest.raises(ValueError, match="persistent"):
        tail_config(select_forward(torch.bfloat16, 1, 4096))
    for dt in (torch.bfloat16, torch.float16):
        persistent = [cfg for *_, cfg in forward_table(dt) if cfg.persistent]
        assert persistent and all(tail_config(c) in shipped_configs(dt) for c in persistent)


def test_tile_table_is_data_per_architecture(tmp_path):
    """The forward tiles come from ``tile_tables/<arch>.json`` (CPU, pure): the shipped sm90 table
    loads, selects by (M, N) with the first matching row, serves an architecture without a table
    (its fallback) and the CPU interpreter's calls; every configuration it can launch is in
    ``shipped_configs`` (which the GPU bits tests walk). A table whose last row is bounded, that
    lacks a weight-gradient row, or that has an unknown field is refused, naming what is wrong."""
    import json

    from rl_engine.backends.triton.gemm import configs

    assert "sm90" in configs.shipped_arches() and configs.FALLBACK_ARCH == "sm90"
    forward, wgrad = configs.load_table(configs.table_path("sm90"))
    assert set(forward) == set(wgrad) == {torch.bfloat16, torch.float16, torch.float32}
    bf = forward[torch.bfloat16]
    assert bf[-1][:2] == (None, None) and bf[0][:2] == (1, 4096)
    sel = configs.select_forward
    assert sel(torch.bfloat16, 1, 4096, "sm90") == bf[0][2]
    assert sel(torch.bfloat16, 1, 4097, "sm90") == next(c for m, n, c in bf if m >= 1 and (n is None or n >= 4097))
    assert sel(torch.bfloat16, 16384, 151936, "sm90") == bf[-1][2]
    assert sel(torch.bfloat16, 64, 6144, "sm120") == sel(torch.bfloat16, 64, 6144, "sm90")  # no table: the fallback's
    assert configs.select_weight_grad(torch.float16, "gfx942") == wgrad[torch.float16]
    shipped = configs.shipped_configs(torch.bfloat16)
    assert all(c in shipped for *_, c in bf) and wgrad[torch.bfloat16] in shipped
    # negative controls: malformed tables are refused with the reason
    good = json.loads(configs.table_path("sm90").read_text())
    cases = {
        "last row unbounded": dict(good, forward=[r for r in good["forward"] if not (r["max_m"] is None and r["max_n"] is None
                                                                                    and r["dtype"] == "float32")]),
        "weight_grad": dict(good, weight_grad=[r for r in good["weight_grad"] if r["dtype"] != "float16"]),
        "extra": dict(good, extra_field=1),
    }
    assert_each_refused(configs.load_table, cases, tmp_path)


@interp
def test_interpreter_calls_select_from_the_fallback_table(monkeypatch):
    """Off the GPU (the interpreter) ``kernels.forward`` selects from :data:`FALLBACK_ARCH`'s table:
    the launched configuration is the table's row for (M, N)."""
    from rl_engine.backends.triton.gemm import configs

    kern = _kernels()
    seen = []
    real = kern._launch_abt
    monkeypatch.setattr(kern, "_launch_abt", lambda *a, **k: seen.append(a[11]) or real(*a, **k))
    x, w, _ = _data(3, 32, 24, "float32", device="cpu", bias=False)
    kern.forward(x, w, None)
    assert seen == [configs.select_forward(torch.float32, 3, 24, configs.FALLBACK_ARCH)]


@interp
@pytest.mark.parametrize("programs", [0, -3, 2.0, True])
def test_interpreter_forward_rejects_a_grid_size_that_is_not_a_positive_int(programs):
    """``kernels.forward(programs=...)`` is checked before anything is launched (the check comes
    first, so CPU tensors show it; the kernels module needs triton: the interpreter environment)."""
    x, w, _ = _data(4, 8, 8, "float32", device="cpu", bias=False)
    with pytest.raises(ValueError, match="programs: expected a positive int"):
        _kernels().forward(x, w, None, programs=programs)


# ------------------------------------------------------------------------------------------
# GPU: accuracy


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64, 10), (65, 128, 1030), (3, 7, 5, 33), (300, 1000, 264), (2048, 4096, 512)])
def test_accuracy_forward_and_grads(dtype, shape):
    *lead, k, n = shape
    g = torch.Generator().manual_seed(0)
    dt = _dt(dtype)
    x = torch.randn(*lead, k, generator=g).to(dt).cuda().requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dt).cuda().requires_grad_()
    b = torch.randn(n, generator=g).to(dt).cuda().requires_grad_()
    with provenance.record() as recs:
        y = gemm.linear(x, w, b)
    assert recs and recs[0].impl_id == IMPL
    up = torch.randn(y.shape, generator=g).to(dt).cuda()
    y.backward(up)
    x64, w64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, w, b))
    y64 = linear_f64(x64, w64, b64)
    y64.backward(up.cpu().double())
    fwd = contracts.tolerance(OP, dt, "forward")
    bwd = contracts.tolerance(OP, dt, "backward")
    assert y.dtype == dt
    assert fwd.check(y.cpu(), y64), fwd.max_violation(y.cpu(), y64)
    for name, got, want in (("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad), ("db", b.grad, b64.grad)):
        assert got.dtype == dt, name
        assert bwd.check(got.cpu(), want), (name, bwd.max_violation(got.cpu(), want))


@gpu
def test_no_bias_and_no_grad_paths():
    x, w, _ = _data(70, 96, 40, "bfloat16", bias=False)
    y = gemm.linear(x, w)
    ref = linear_f64(x.cpu(), w.cpu())
    tol = contracts.tolerance(OP, torch.bfloat16)
    assert tol.check(y.cpu(), ref)
    ww = w.clone().requires_grad_()
    gemm.linear(x, ww).sum().backward()  # x needs no grad: only dW is computed
    assert ww.grad is not None and ww.grad.shape == w.shape
    assert gemm.linear(x[:0], w).shape == (0, 40)


# ------------------------------------------------------------------------------------------
# GPU: invariance (raw bits)


def _all_forward_variants(dtype: torch.dtype):
    from rl_engine.backends.triton.gemm.configs import shipped_configs

    for cfg in shipped_configs(dtype):
        yield cfg, False
        if cfg.tma and dtype != torch.float32:
            yield cfg, True


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("k", [4096, 1000])
@pytest.mark.parametrize("n", [264, 263])
def test_every_shipped_config_gives_identical_bits(dtype, k, n):
    """The configuration may follow M only because all of them compute the same bits. N = 263
    (a 526-byte output row) runs the TMA configurations with pointer stores of the output."""
    kern = _kernels()
    dt = _dt(dtype)
    x, w, b = _data(300, k, n, dtype, seed=k)
    gy = torch.randn(300, n, generator=torch.Generator().manual_seed(1)).to(dt).cuda()
    variants = list(_all_forward_variants(dt))
    assert len(variants) >= 2
    base_cfg, _ = variants[0]
    y0 = kern.forward(x, w, b, config=base_cfg, allow_tma=False)
    dx0 = kern.grad_input(gy, w, config=base_cfg)
    for cfg, tma in variants[1:]:
        y = kern.forward(x, w, b, config=cfg, allow_tma=tma)
        assert same_bits(y, y0), f"forward {cfg.key} tma={tma} vs {base_cfg.key}: {same_bits(y, y0)}"
        dx = kern.grad_input(gy, w, config=cfg)
        assert same_bits(dx, dx0), f"dx {cfg.key} vs {base_cfg.key}: {same_bits(dx, dx0)}"


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n", [1024, 800])
@pytest.mark.parametrize("bias", [True, False])
def test_tail_split_launch_gives_the_same_bits(dtype, n, bias):
    """A persistent launch whose last wave runs as half-width tiles (``configs.tail_split``) equals,
    raw bits, the same configuration in one launch and the pointer-load reference tile. 300 x
    1000 x N with 128 x 256 tiles is 3 x 4 tiles; on 8 programs the split runs 8 tiles, then the
    last 4 as 8 half tiles (N = 800: the last tile's second half lies past column N, loaded as
    zeros and not stored). The profiler shows the two launches, so the split path is the one
    tested; a planted split that gives the tail its own K order (split-K halves) is caught."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from rl_engine.backends.triton.gemm.configs import TileConfig, select_forward

    kern = _kernels()
    dt = _dt(dtype)
    x, w, b = _data(300, 1000, n, dtype, seed=n, bias=bias)
    cfg = select_forward(dt, 16384, 6144)
    assert cfg.persistent and cfg.block_m == 128 and cfg.block_n == 256
    ref = kern.forward(x, w, b, config=TileConfig(64, 64, 64, 4, 3), allow_tma=False)
    one = kern.forward(x, w, b, config=cfg, programs=8, tail=False)
    kern.forward(x, w, b, config=cfg, programs=8)  # compile outside the profiled region
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        split = kern.forward(x, w, b, config=cfg, programs=8)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA and e.name.startswith("rlk_")]
    assert launches == ["rlk_linear_fwd_tma_persistent"] * 2, launches
    assert same_bits(one, ref), f"one launch vs reference: {same_bits(one, ref)}"
    assert same_bits(split, ref), f"split launch vs reference: {same_bits(split, ref)}"
    # negative control: the tail's columns from two K halves added in fp32 (a different order)
    half = 512
    planted = split.clone()
    tail_cols = slice(512, n)  # the last wave's tiles (grouped order: tiles 8..11) lie in these columns
    acc = (x[:, :half].float() @ w[tail_cols, :half].float().T) + (x[:, half:].float() @ w[tail_cols, half:].float().T)
    planted[:, tail_cols] = (acc + (b[tail_cols].float() if bias else 0.0)).to(dt)
    assert not same_bits(planted, ref), "a tail computed in another K order was not caught"


@interp
@pytest.mark.parametrize("n,out_dtype,store_tma", [(40, None, True), (37, None, False), (40, torch.float32, None)])
@pytest.mark.parametrize("persistent", [False, True])
def test_interpreter_tma_loads_store_by_tma_or_by_pointer(monkeypatch, n, out_dtype, store_tma, persistent):
    """TMA configurations load by TMA whenever the inputs allow it; the output goes by TMA only
    where TMA can address it: a ragged N (37 float16 columns: a 74-byte row) is stored by pointer
    from the same kernel; the fp32 output runs the pointer-load kernel (``store_tma=None``: no
    TMA launch). Each path equals the pointer-load kernel's bits (float16 in the interpreter, a K
    tail, a bias; the persistent configuration with a tail split into half tiles and its
    warp-specialised, subtiled epilogue, which pointer stores turn off); the launch records which
    store ran; a product in another K order is caught (on the fp32 accumulator: a 16-bit rounding
    can hide it)."""
    from rl_engine.backends.triton.gemm.configs import TileConfig

    kern = _kernels()
    monkeypatch.setattr(kern, "tma_supported", lambda *ts: all(kern._tma_addressable(t) for t in ts))
    stores = []
    real_output_arg = kern._output_arg
    monkeypatch.setattr(kern, "_output_arg", lambda y, cfg, bn, tma: stores.append(tma) or real_output_arg(y, cfg, bn, tma))
    g = torch.Generator().manual_seed(n)
    x = torch.randn(33, 72, generator=g).half()
    w, b = (torch.randn(n, 72, generator=g) * 0.2).half(), torch.randn(n, generator=g).half()
    ref = kern.forward(x, w, b, config=TileConfig(16, 16, 32, 4, 2), allow_tma=False, out_dtype=out_dtype)
    cfg = (TileConfig(16, 32, 32, 4, 2, tma=True, persistent=True, warp_specialize=True, epilogue_subtile=True)
           if persistent else TileConfig(16, 16, 32, 4, 2, tma=True))
    y = kern.forward(x, w, b, config=cfg, out_dtype=out_dtype, programs=4)  # 6 tiles on 4 programs: a tail split
    if store_tma is None:
        assert stores == [], stores  # no TMA launch at all
    else:
        assert stores and set(stores) == {store_tma}, stores
    assert y.dtype == (out_dtype or x.dtype) and same_bits(y, ref), same_bits(y, ref)
    # negative control on the unrounded accumulator (a 16-bit rounding can hide a K order)
    acc = kern.forward(x, w, b, config=TileConfig(16, 16, 32, 4, 2), allow_tma=False, out_dtype=torch.float32)
    split_k = (x[:, :40].float() @ w[:, :40].float().T) + (x[:, 40:].float() @ w[:, 40:].float().T) + b.float()
    assert not same_bits(split_k, acc), "a product in another K order was not caught"


@interp
def test_interpreter_grad_input_chained_over_n_is_one_product():
    """The chained dx of the fused LM head's backward in the Triton interpreter (fp32, a 16x16x32
    tile): three chunks (64, 96 and a ragged 40 columns) through the fp32 accumulator equal one
    product over N = 200, raw bits; summing the per-chunk products does not; a partial chunk of 40
    columns (not a multiple of BLOCK_K = 32) is refused. The GPU test below covers every shipped
    configuration and the 16-bit dtypes."""
    from rl_engine.backends.triton.gemm.configs import TileConfig

    kern = _kernels()
    cfg = TileConfig(16, 16, 32, 4, 2)
    M, N, K = 20, 200, 24
    g = torch.Generator().manual_seed(0)
    gy, w = torch.randn(M, N, generator=g), torch.randn(N, K, generator=g)
    one = kern.grad_input(gy, w, config=cfg)
    acc = torch.empty(M, K)
    bounds = (0, 64, 160, N)
    for i in range(3):
        last = i == 2
        out = kern.grad_input(gy[:, bounds[i]:bounds[i + 1]], w[bounds[i]:bounds[i + 1]], config=cfg,
                              acc=acc if i else None, out=None if last else acc, partial=not last)
    assert same_bits(out, one)
    summed = sum(kern.grad_input(gy[:, a:b], w[a:b], config=cfg) for a, b in zip(bounds[:-1], bounds[1:]))
    assert not same_bits(summed, one), "per-chunk products summed were not caught"
    with pytest.raises(ValueError, match="partial chunk"):
        kern.grad_input(gy[:, 160:], w[160:], config=cfg, out=torch.empty(M, K), partial=True)



@interp
def test_interpreter_grad_weight_into_rows_of_a_larger_gradient():
    """``grad_weight(..., out=)`` writes ``dW`` into rows of a larger gradient (the fused LM
    head's ``dweight[c0:c1]``) with the bits of a fresh output, leaving the other rows alone; an
    ``out`` of the wrong shape, dtype or layout is refused before anything is written."""
    kern = _kernels()
    g = torch.Generator().manual_seed(0)
    gy, x = torch.randn(24, 40, generator=g), torch.randn(24, 16, generator=g)
    whole = torch.full((100, 16), 7.0)
    got = kern.grad_weight(gy, x, out=whole[30:70])
    assert got.data_ptr() == whole[30:70].data_ptr() and same_bits(got, kern.grad_weight(gy, x))
    assert bool((whole[:30] == 7).all()) and bool((whole[70:] == 7).all())
    for bad in (torch.empty(40, 15), torch.empty(40, 16, dtype=torch.float64), torch.empty(16, 40).t()):
        with pytest.raises(ValueError, match="out: expected a contiguous"):
            kern.grad_weight(gy, x, out=bad)
    assert bool((whole[:30] == 7).all())

@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_grad_input_chained_over_n_is_one_product(dtype):
    """``dx = dy W`` over N = 5000 in chunks of 1024, 1024, 2048 and a ragged 904 (a K tail),
    chained through the fp32 accumulator (``partial=True`` / ``acc=``, the fused LM head's
    backward), is raw-bit equal to one ``grad_input`` over all N — and the unrounded accumulator
    after 4096 columns to one unrounded product over them — for every shipped configuration.
    Negative control: the per-chunk products summed in fp32 (chunking the reduction naively)
    differ. A partial chunk that is not a multiple of BLOCK_K is refused."""
    kern = _kernels()
    dt = _dt(dtype)
    M, N, K = 300, 5000, 264
    g = torch.Generator().manual_seed(5)
    gy = torch.randn(M, N, generator=g).to(dt).cuda()
    w = (torch.randn(N, K, generator=g) / N**0.5).to(dt).cuda()
    bounds = (0, 1024, 2048, 4096, N)

    def f32():
        return torch.empty((M, K), dtype=torch.float32, device="cuda")

    for cfg in dict.fromkeys(c for c, _ in _all_forward_variants(dt)):
        one = kern.grad_input(gy, w, config=cfg)
        one32 = kern.grad_input(gy[:, :4096], w[:4096], config=cfg, out=f32(), partial=True)
        acc = f32()
        for i in range(len(bounds) - 1):
            a, b = bounds[i], bounds[i + 1]
            last = b == N
            if last:
                assert same_bits(acc, one32), f"{cfg.key} fp32 accumulator: {same_bits(acc, one32)}"
            out = kern.grad_input(gy[:, a:b], w[a:b], config=cfg, acc=acc if i else None,
                                  out=None if last else acc, partial=not last)
        assert same_bits(out, one), f"{cfg.key}: {same_bits(out, one)}"
        parts = [kern.grad_input(gy[:, a:b], w[a:b], config=cfg, out=f32(), partial=True)
                 for a, b in zip(bounds[:3], bounds[1:4])]
        assert not same_bits((parts[0] + parts[1]) + parts[2], one32), f"{cfg.key}: summed chunk products not caught"
        with pytest.raises(ValueError, match="partial chunk"):
            kern.grad_input(gy[:, :1000], w[:1000], config=cfg, out=f32(), partial=True)
    with pytest.raises(ValueError, match="acc: expected float32"):
        kern.grad_input(gy, w, acc=torch.empty((M, K), dtype=torch.bfloat16, device="cuda"))


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rows_equal_across_every_m_bucket(dtype):
    """A row computed in a batch of M equals the same row in M=16384 (every bucket, fwd + dx)."""
    dt = _dt(dtype)
    full_m, k, n = 16384, 1024, 512
    x, w, b = _data(full_m, k, n, dtype, seed=11)
    up = torch.randn(full_m, n, generator=torch.Generator().manual_seed(2)).to(dt).cuda()
    xf = x.clone().requires_grad_()
    yf = gemm.linear(xf, w, b)
    yf.backward(up)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 2, 15, 16, 17, 32, 33, 63, 64, 65, 255, 256, 257, 1024, 4096, 9999):
        idx = torch.randperm(full_m, generator=gen)[:m].cuda()
        xs = x[idx].clone().requires_grad_()
        ys = gemm.linear(xs, w, b)
        ys.backward(up[idx])
        assert same_bits(ys, yf.detach()[idx]), f"M={m}: {same_bits(ys, yf.detach()[idx])}"
        assert same_bits(xs.grad, xf.grad[idx]), f"dx M={m}: {same_bits(xs.grad, xf.grad[idx])}"


@gpu
def test_decode_row_equals_prefill_row_on_down_proj_shape():
    """K = 12288 (Qwen3-8B down_proj), where cuBLAS rows at M=1 differ from M=16384 (design §4)."""
    x, w, _ = _data(4096, 12288, 1024, "bfloat16", seed=5, bias=False)
    full = gemm.linear(x, w)
    for i in (0, 1234, 4095):
        one = gemm.linear(x[i : i + 1].contiguous(), w)
        assert same_bits(one, full[i : i + 1]), str(same_bits(one, full[i : i + 1]))
    cublas_equal = all(same_bits(F.linear(x[i : i + 1], w), F.linear(x, w)[i : i + 1]).equal for i in (0, 1234, 4095))
    evidence("cublas_row_invariance_k12288", {"cublas_rows_equal": cublas_equal})


def _on_gpu(w, b):
    def fn(x_cpu):
        return gemm.linear(x_cpu.cuda(), w, b).cpu()

    return fn


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 300), k=st.sampled_from([64, 96]), n=st.sampled_from([24, 40]), bias=st.booleans())
def test_row_invariance_forward_and_grad_hypothesis(dtype, data, m, k, n, bias):
    x, w, b = _data(m, k, n, dtype, seed=m * 7 + n, bias=bias)
    trials = data.draw(row_trials(m))
    rep = check_row_invariance(_on_gpu(w, b), [x.cpu()], trials, grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@settings(max_examples=30)
@given(start=st.integers(0, 1500), length=st.integers(1, 1100), m=st.sampled_from([1, 70, 600]))
def test_output_feature_chunk_invariance(dtype, start, length, m):
    x, w, _ = _data(m, 256, 2100, dtype, seed=1, bias=False)
    full = gemm.linear(x, w)
    stop = min(start + length, 2100)
    part = gemm.linear(x, w[start:stop].contiguous())
    assert same_bits(part, full[:, start:stop]), "column chunk differs from the full product"


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_run_to_run_determinism_forward_and_all_grads(dtype):
    x, w, b = _data(4096, 1024, 1024, dtype, seed=5)
    up = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(9)).to(_dt(dtype)).cuda()
    outs = []
    for _ in range(3):
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        y = gemm.linear(xx, ww, bb)
        y.backward(up)
        outs.append((y.detach(), xx.grad, ww.grad, bb.grad))
    for run in outs[1:]:
        for name, a, b_ in zip(("y", "dx", "dW", "db"), outs[0], run):
            assert same_bits(a, b_), f"{name}: {same_bits(a, b_)}"


def _split_k_when_small(w, b):
    """Planted non-invariance: rows of small batches are reduced in 4 K-chunks (split-K)."""

    def fn(x_cpu):
        x = x_cpu.cuda()
        if x.shape[0] > 8:
            return gemm.linear(x, w, b).cpu()
        k4 = x.shape[1] // 4
        parts = [gemm.linear(x[:, i * k4 : (i + 1) * k4].contiguous(), w[:, i * k4 : (i + 1) * k4].contiguous()).float() for i in range(4)]
        return ((parts[0] + parts[1]) + (parts[2] + parts[3]) + b.float()).to(x.dtype).cpu()

    return fn


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_negative_control_split_k_is_caught(dtype):
    x, w, b = _data(64, 4096, 256, dtype, seed=7)
    trials = [[0], [5, 17], list(range(0, 64, 3))]
    bad = check_row_invariance(_split_k_when_small(w, b), [x.cpu()], trials)
    assert not bad.ok, "the checker missed a planted M-dependent split-K"
    good = check_row_invariance(_on_gpu(w, b), [x.cpu()], trials)
    assert good.ok, str(good)
    # the config-equality comparator sees the same planted difference
    assert not same_bits(_split_k_when_small(w, b)(x[:4].cpu()), gemm.linear(x[:4], w, b).cpu()).equal


# ------------------------------------------------------------------------------------------
# GPU: dispatch, profiler names, bounded performance


@gpu
def test_dispatch_picks_triton_on_cuda_and_records_provenance():
    x, w, b = _data(8, 64, 16, "bfloat16")
    with provenance.record() as recs:
        gemm.linear(x, w, b)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback
    assert rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(OP, x))
    assert rejections == []  # the first candidate on CUDA is ours


@gpu
@pytest.mark.parametrize("m", [64, 4096])
def test_profiler_kernel_names_carry_the_prefix(m):
    defined = defined_kernel_names("rl_engine.backends.triton.gemm.kernels")
    launchable = {n for n in defined if not n.startswith("_")} - set(_kernels().DEVICE_FUNCTIONS)
    assert launchable == set(_kernels().KERNEL_NAMES)
    assert all(n.startswith("rlk_") for n in launchable), launchable

    x, w, b = _data(m, 1024, 512, "bfloat16")
    up = torch.randn(m, 512, device="cuda").to(torch.bfloat16)

    def call():
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        gemm.linear(xx, ww, bb).backward(up)

    names = gpu_kernel_events(call)
    assert names, "profiler recorded no GPU events"
    ours = sorted(n for n in names if n in defined or n.startswith("rlk"))
    evidence(f"profiler_gemm_triton_m{m}", {"all_gpu_events": names, "ours": ours})
    assert ours, f"none of our kernels appeared; GPU events: {names}"
    assert all(n.startswith("rlk_") for n in ours), ours
    assert {"rlk_linear_dx", "rlk_linear_dw", "rlk_linear_dbias"} <= set(ours), ours
    assert {"rlk_linear_fwd", "rlk_linear_fwd_tma", "rlk_linear_fwd_tma_persistent"} & set(ours), ours
    libs = [n for n in names if any(s in n.lower() for s in ("gemm", "xmma", "nvjet", "cutlass"))]
    assert not libs, f"a library GEMM ran inside the public call: {libs}"


@gpu
@pytest.mark.parametrize("m,k,n", [(16, 4096, 6144), (4096, 4096, 4096)])
def test_bounded_performance_vs_cublas(m, k, n):
    """Not an absolute budget: ours within 3x of cuBLAS on the same device, same run, same
    method (CUDA-graph replay, so host overhead and other processes' launches matter less)."""
    from rl_engine.backends.triton.gemm import linear_triton

    x, w, _ = _data(m, k, n, "bfloat16", bias=False)
    ours = graph_us(lambda: linear_triton(x, w, None))
    ref = graph_us(lambda: F.linear(x, w))
    evidence(f"bounded_perf_m{m}", {"ours_us": ours, "cublas_us": ref, "ratio": ours / ref})
    assert ours <= 3.0 * ref, f"{ours:.1f} us vs cuBLAS {ref:.1f} us"


# ---------------------------------------------------------------------------------------------
# the fp32-output variant (the fp32 LM head's logits)


@interp
def test_interpreter_fp32_output_stores_the_accumulator():
    """The fp32-output variant stores the fp32 accumulator: float16 inputs in the interpreter
    (which reads bf16 storage wrongly), every row and column chunk equal to the full product's."""
    from rl_engine.backends.triton.gemm import kernels as gk

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 64, generator=g).half(), (torch.randn(300, 64, generator=g) * 0.3).half()
    y = gk.forward(x, w, None, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert same_bits(gk.forward(x[3:5], w[100:220], None, out_dtype=torch.float32), y[3:5, 100:220])
    ref = x.double() @ w.double().T
    assert float((y.double() - ref).abs().max()) < 1e-5


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 7, 64, 300, 2048])
def test_fp32_output_rows_and_column_chunks_are_invariant(dtype, m):
    """``out_dtype=float32``: the same per-element arithmetic as the 16-bit output (rounding it
    gives the 16-bit bits), row and column-chunk invariant across M buckets; the backward is the
    16-bit backward of the gradient rounded once."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(2048, 256, generator=g).to(dt).cuda()
    w = (torch.randn(5000, 256, generator=g) * 0.1).to(dt).cuda()
    full = gemm.linear(x, w, out_dtype=torch.float32)
    part = gemm.linear(x[:m].contiguous(), w[1024:3072].contiguous(), out_dtype=torch.float32)
    assert full.dtype == torch.float32 and same_bits(part, full[:m, 1024:3072])
    assert same_bits(full.to(dt), gemm.linear(x, w))
    up = torch.randn(m, 5000, generator=g).cuda()
    xa, wa = x[:m].clone().requires_grad_(), w.clone().requires_grad_()
    gemm.linear(xa, wa, out_dtype=torch.float32).backward(up)
    xb, wb = x[:m].clone().requires_grad_(), w.clone().requires_grad_()
    gemm.linear(xb, wb).backward(up.to(dt))
    assert same_bits(xa.grad, xb.grad) and same_bits(wa.grad, wb.grad)
