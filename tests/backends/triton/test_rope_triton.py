"""Triton ``rope.apply_rope`` (impl ``triton.exact_table``): the one test module of this
operator target.

GPU tests (``@pytest.mark.gpu``; the device run must show zero skips): the GPU cos/sin table
raw-bit equal to the CPU's (the table is defined bit for bit); accuracy of out and dx against
float64 (contract tolerances), full and partial rotary dims; 200 hypothesis examples per dtype
of row invariance over tokens with their positions (forward + grad); a decode token equal to its
row of a long prefill; run-to-run determinism; a planted fp32-angle path caught by the same
checker; dispatch/provenance; profiler names; bounded performance. CPU tests: registration,
routing, pure eligibility checks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.ops import rope
from rl_engine.ops.rope import rope_cos_sin
from rl_engine.reference.rope import apply_rope_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import make_request, select
from rl_engine.utils.bits import same_bits
from rl_engine.utils.checks import nan_policy
from rl_engine.utils.rope_tables import DEVICE_TABLE_POSITIONS
from rl_engine.validation.common import check_row_invariance
from tests.backends.triton._rowwise_common import (
    accuracy,
    check_cpu_routing,
    check_profiler_names,
    check_registration,
    check_static_and_fake_gpu,
    evidence,
    gpu_randn,
    graph_us,
)
from tests.helpers.strategies import row_trials

OP = "rope.apply_rope"
IMPL = "triton.exact_table"
MODULE = "rl_engine.backends.triton.rope"
DTYPES = ("float32", "bfloat16")
gpu = pytest.mark.gpu


def _data(t, nh, d, dtype, seed=0, max_pos=40000, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, nh, d, generator=g).to(getattr(torch, dtype)).to(device)
    pos = torch.randint(0, max_pos, (t,), generator=g).to(device)
    return x, pos


def test_registration_declares_cuda_and_untested_rocm():
    check_registration(OP, IMPL, MODULE, "rope")


def test_cpu_tensors_route_to_cpu_and_checks_are_pure():
    check_cpu_routing(OP, IMPL, torch.randn(2, 2, 8))
    check_static_and_fake_gpu(OP, IMPL)


@gpu
@pytest.mark.parametrize("positions", [[0, 1, 2, 4095, 4096, 131071], list(range(0, 2**31, 2**27)) + [2**31 - 1]])
def test_gpu_table_equals_cpu_table_bit_for_bit(positions):
    """Under the checking policy (the maximum read back: every position up to 2^31 - 1) and, for
    the positions it covers, through the default policy's device table (no host read)."""
    pos = torch.tensor(positions)
    inside = pos[pos < DEVICE_TABLE_POSITIONS]
    for rdim, theta in ((128, 1e6), (64, 10000.0), (10, 500.0)):
        c_cpu, s_cpu = rope_cos_sin(pos, rdim, theta)
        with nan_policy("raise"):
            c_gpu, s_gpu = rope_cos_sin(pos.cuda(), rdim, theta)
        assert same_bits(c_gpu.cpu(), c_cpu) and same_bits(s_gpu.cpu(), s_cpu)
        c_dev, s_dev = rope_cos_sin(inside.cuda(), rdim, theta)
        c_in, s_in = rope_cos_sin(inside, rdim, theta)
        assert same_bits(c_dev.cpu(), c_in) and same_bits(s_dev.cpu(), s_in)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,d,rdim", [(1, 1, 2, None), (37, 8, 128, None), (5, 32, 128, 64), (300, 4, 80, 48)])
def test_accuracy_forward_and_grad(dtype, t, nh, d, rdim):
    x, pos = _data(t, nh, d, dtype)
    x.requires_grad_()
    kw = {} if rdim is None else {"rotary_dim": rdim}
    with provenance.record() as recs:
        y = rope.apply_rope(x, pos, theta=1e6, **kw)
    assert recs and recs[0].impl_id == IMPL
    dt = getattr(torch, dtype)
    assert y.dtype == dt and y.shape == x.shape
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dt).cuda()
    y.backward(up)
    x64 = x.detach().cpu().double().requires_grad_()
    y64 = apply_rope_f64(x64, pos.cpu(), theta=1e6, **kw)
    y64.backward(up.cpu().double())
    accuracy(OP, dt, "forward", y, y64)
    accuracy(OP, dt, "backward", x.grad, x64.grad, "dx")
    if rdim is not None:  # features past rotary_dim are copied bit for bit
        assert same_bits(y.detach()[..., rdim:], x.detach()[..., rdim:])


def _on_gpu(theta, rdim):
    def fn(x_cpu, pos_cpu):
        return rope.apply_rope(x_cpu.cuda(), pos_cpu.cuda(), theta=theta, rotary_dim=rdim).cpu()

    return fn


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), t=st.integers(1, 64), shape=st.sampled_from([(2, 64, 64), (3, 128, 96), (1, 10, 10)]))
def test_row_invariance_forward_and_grad_hypothesis(dtype, data, t, shape):
    nh, d, rdim = shape
    x, pos = _data(t, nh, d, dtype, seed=t * 11 + d)
    rep = check_row_invariance(_on_gpu(1e6, rdim), [x.cpu(), pos.cpu()], data.draw(row_trials(t)), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_token_equals_its_prefill_row(dtype):
    """Prefill of 8192 tokens at positions 0..8191, then each sampled token alone (decode) or in
    a chunk of 512 (chunked prefill): the same bits, forward and dx."""
    x = gpu_randn((8192, 32, 128), 4, getattr(torch, dtype))
    pos = torch.arange(8192, device="cuda")
    full = rope.apply_rope(x, pos, theta=1e6)
    for p in (0, 1, 777, 4096, 8191):
        one = rope.apply_rope(x[p : p + 1].contiguous(), pos[p : p + 1].contiguous(), theta=1e6)
        assert same_bits(one, full[p : p + 1]), f"position {p}"
    chunk = rope.apply_rope(x[1024:1536].contiguous(), pos[1024:1536].contiguous(), theta=1e6)
    assert same_bits(chunk, full[1024:1536])
    g = gpu_randn((8192, 32, 128), 8, x.dtype)
    xf = x.clone().requires_grad_()
    rope.apply_rope(xf, pos, theta=1e6).backward(g)
    xs = x[4000:4001].clone().requires_grad_()
    rope.apply_rope(xs, pos[4000:4001].contiguous(), theta=1e6).backward(g[4000:4001])
    assert same_bits(xs.grad, xf.grad[4000:4001])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_grad(dtype):
    x, pos = gpu_randn((4096, 32, 128), 5, getattr(torch, dtype)), torch.randint(0, 40000, (4096,), device="cuda")
    g = gpu_randn((4096, 32, 128), 9, x.dtype)
    runs = []
    for _ in range(3):
        xx = x.clone().requires_grad_()
        y = rope.apply_rope(xx, pos, theta=1e6)
        y.backward(g)
        runs.append((y.detach(), xx.grad))
    for y, dx in runs[1:]:
        assert same_bits(y, runs[0][0]) and same_bits(dx, runs[0][1])


def _fp32_angles_when_small(theta):
    """Planted non-invariance: batches of <= 8 tokens build cos/sin from fp32 angles with
    torch.cos/sin (a common 'decode cache' shortcut); larger batches use the exact table."""

    def fn(x_cpu, pos_cpu):
        x, pos = x_cpu.cuda(), pos_cpu.cuda()
        if x.shape[0] > 8:
            return rope.apply_rope(x, pos, theta=theta).cpu()
        d = x.shape[-1]
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
        ang = pos.float()[:, None] * inv[None, :]
        c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype).cpu()

    return fn


@gpu
def test_negative_control_fp32_angle_path_is_caught():
    x, pos = _data(64, 4, 128, "float32", seed=7)
    trials = [[0], [5, 17], list(range(0, 64, 9))]
    bad = check_row_invariance(_fp32_angles_when_small(1e6), [x.cpu(), pos.cpu()], trials)
    assert not bad.ok, "the checker missed a planted batch-size-dependent cos/sin path"
    good = check_row_invariance(_on_gpu(1e6, 128), [x.cpu(), pos.cpu()], trials, grads=True)
    assert good.ok, str(good)


@gpu
def test_dispatch_picks_triton_on_cuda_and_records_provenance():
    x, pos = _data(4, 2, 64, "bfloat16")
    with provenance.record() as recs:
        rope.apply_rope(x, pos)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback and rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(OP, x))
    assert rejections == []


@gpu
def test_profiler_kernel_names_carry_the_prefix():
    x, pos = _data(512, 32, 128, "bfloat16")

    def call():
        xx = x.clone().requires_grad_()
        rope.apply_rope(xx, pos, theta=1e6).sum().backward()

    check_profiler_names(f"{MODULE}.kernels", call, {"rlk_rope"}, "rope")


@gpu
def test_bounded_performance_vs_torch_rotate_half():
    """The rotation kernel within 2x of HF's ``x*cos + rotate_half(x)*sin`` (torch kernels, cos/sin
    precomputed for both) on the same device and run (CUDA-graph replay)."""
    from rl_engine.backends.triton.rope import kernels

    x, pos = gpu_randn((8192, 32, 128), 0, torch.bfloat16), torch.randint(0, 40000, (8192,), device="cuda")
    c, s = rope_cos_sin(pos, 128, 1e6)
    cc = torch.cat([c, c], -1)[:, None, :].to(x.dtype)
    ss = torch.cat([s, s], -1)[:, None, :].to(x.dtype)

    def hf():
        x1, x2 = x[..., :64], x[..., 64:]
        return x * cc + torch.cat([-x2, x1], -1) * ss

    ours = graph_us(lambda: kernels.rotate(x, c, s, 128, False))
    ref = graph_us(hf)
    evidence("bounded_perf_rope", {"shape": [8192, 32, 128], "ours_us": ours, "torch_us": ref})
    assert ours <= 2.0 * ref, f"{ours:.1f} us vs torch {ref:.1f} us"
