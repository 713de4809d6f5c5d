"""Triton ``activation.silu_and_mul`` (impl ``triton.elementwise``): the one test module of this
operator target.

GPU tests (``@pytest.mark.gpu``; the device run must show zero skips): accuracy of y and dx
against float64 (contract tolerances); 200 hypothesis examples per dtype of row invariance
(forward + grad); feature-chunk invariance; run-to-run determinism; a planted batch-size-
dependent ``sigmoid`` path caught by the same checker; dispatch/provenance; profiler names;
bounded performance. CPU tests: registration, routing, pure eligibility checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.ops import activation
from rl_engine.reference.activation import silu_and_mul_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import make_request, select
from rl_engine.utils.bits import same_bits
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

OP = "activation.silu_and_mul"
IMPL = "triton.elementwise"
MODULE = "rl_engine.backends.triton.activation"
DTYPES = ("float32", "bfloat16")
gpu = pytest.mark.gpu


def _data(m, d, dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 2 * d, generator=g) * 3).to(getattr(torch, dtype)).to(device)


def test_registration_declares_cuda_and_untested_rocm():
    check_registration(OP, IMPL, MODULE, "activation")


def test_cpu_tensors_route_to_cpu_and_checks_are_pure():
    check_cpu_routing(OP, IMPL, torch.randn(2, 8))
    check_static_and_fake_gpu(OP, IMPL)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (37, 2 * 1500), (2, 3, 2 * 64), (64, 2 * 12288)])
def test_accuracy_forward_and_grad(dtype, shape):
    *lead, n = shape
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*lead, n, generator=g) * 3).to(dt).cuda().requires_grad_()
    with provenance.record() as recs:
        y = activation.silu_and_mul(x)
    assert recs and recs[0].impl_id == IMPL
    assert y.dtype == dt and y.shape == (*lead, n // 2)
    up = torch.randn(y.shape, generator=g).to(dt).cuda()
    y.backward(up)
    x64 = x.detach().cpu().double().requires_grad_()
    y64 = silu_and_mul_f64(x64)
    y64.backward(up.cpu().double())
    accuracy(OP, dt, "forward", y, y64)
    accuracy(OP, dt, "backward", x.grad, x64.grad, "dx")


def _on_gpu(x_cpu):
    return activation.silu_and_mul(x_cpu.cuda()).cpu()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 64), d=st.sampled_from([8, 100, 1100]))
def test_row_invariance_forward_and_grad_hypothesis(dtype, data, m, d):
    x = _data(m, d, dtype, seed=m * 3 + d)
    rep = check_row_invariance(_on_gpu, [x.cpu()], data.draw(row_trials(m)), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40)
@given(start=st.integers(0, 3000), length=st.integers(1, 2100), m=st.sampled_from([1, 33]))
def test_feature_chunk_invariance_forward_and_grad(dtype, start, length, m):
    """Feature columns j of both halves, taken as their own tensor, give the same bits."""
    d = 3072
    x = _data(m, d, dtype, seed=2)
    stop = min(start + length, d)
    start = min(start, stop - 1)
    xf = x.clone().requires_grad_()
    yf = activation.silu_and_mul(xf)
    up = torch.randn(yf.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype).cuda()
    yf.backward(up)
    xc = torch.cat([x[:, start:stop], x[:, d + start : d + stop]], dim=1).requires_grad_()
    yc = activation.silu_and_mul(xc)
    yc.backward(up[:, start:stop].contiguous())
    w = stop - start
    assert same_bits(yc, yf.detach()[:, start:stop])
    assert same_bits(xc.grad[:, :w], xf.grad[:, start:stop])
    assert same_bits(xc.grad[:, w:], xf.grad[:, d + start : d + stop])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_grad(dtype):
    dt = getattr(torch, dtype)
    x, up = gpu_randn((4096, 2 * 12288), 5, dt, 3.0), gpu_randn((4096, 12288), 9, dt)
    runs = []
    for _ in range(3):
        xx = x.clone().requires_grad_()
        y = activation.silu_and_mul(xx)
        y.backward(up)
        runs.append((y.detach(), xx.grad))
    for y, dx in runs[1:]:
        assert same_bits(y, runs[0][0]) and same_bits(dx, runs[0][1])


def _sigmoid_path_when_small(x_cpu):
    """Planted non-invariance: batches of <= 8 rows take a 'fast' F.silu path (another exp and
    division), larger batches the Triton kernel."""
    x = x_cpu.cuda()
    if x.shape[0] > 8:
        return activation.silu_and_mul(x).cpu()
    d = x.shape[-1] // 2
    return (F.silu(x[:, :d].float()) * x[:, d:].float()).to(x.dtype).cpu()


@gpu
def test_negative_control_batch_dependent_path_is_caught():
    x = _data(64, 1000, "float32", seed=7)
    trials = [[0], [5, 17], list(range(0, 64, 9))]
    bad = check_row_invariance(_sigmoid_path_when_small, [x.cpu()], trials)
    assert not bad.ok, "the checker missed a planted batch-size-dependent silu path"
    good = check_row_invariance(_on_gpu, [x.cpu()], trials, grads=True)
    assert good.ok, str(good)


@gpu
def test_dispatch_picks_triton_on_cuda_and_records_provenance():
    x = _data(4, 64, "bfloat16")
    with provenance.record() as recs:
        activation.silu_and_mul(x)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback and rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(OP, x))
    assert rejections == []


@gpu
def test_profiler_kernel_names_carry_the_prefix():
    x = gpu_randn((512, 2 * 12288), 0, torch.bfloat16, 3.0)

    def call():
        xx = x.clone().requires_grad_()
        activation.silu_and_mul(xx).sum().backward()

    check_profiler_names(f"{MODULE}.kernels", call, {"rlk_silu_and_mul_fwd", "rlk_silu_and_mul_bwd"}, "activation")


@gpu
def test_bounded_performance_vs_torch():
    """Ours within 2x of ``F.silu(a) * b`` (two torch kernels) on the same device and run."""
    from rl_engine.backends.triton.activation import silu_and_mul_triton

    d = 12288
    x = gpu_randn((8192, 2 * d), 0, torch.bfloat16, 3.0)
    ours = graph_us(lambda: silu_and_mul_triton(x))
    ref = graph_us(lambda: F.silu(x[:, :d]) * x[:, d:])
    evidence("bounded_perf_activation", {"shape": [8192, 2 * d], "ours_us": ours, "torch_us": ref})
    assert ours <= 2.0 * ref, f"{ours:.1f} us vs torch {ref:.1f} us"
