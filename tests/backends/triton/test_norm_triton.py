"""Triton ``norm.rms_norm`` / ``norm.fused_add_rms_norm`` (impl ``triton.row_program``): the one
test module of this operator target.

GPU tests (``@pytest.mark.gpu``; CPU CI skips them with the reason from tests/conftest.py, the
device run must show zero skips): accuracy of y, dx, dweight (and the fused op's two outputs and
gradients) against float64 with the contract tolerances, for one-block and chunked rows;
200 hypothesis examples per dtype of row invariance (forward + dx); the fused op equal bit for
bit to add-then-norm; run-to-run determinism of y/dx/dweight; a planted batch-size-dependent
reduction caught by the same checker; dispatch/provenance; profiler names; bounded performance.
CPU tests (always run): registration, routing and rejection reasons, kernels not imported.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.ops import norm
from rl_engine.reference.norm import fused_add_rms_norm_f64, rms_norm_f64
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

OPS = ("norm.rms_norm", "norm.fused_add_rms_norm")
IMPL = "triton.row_program"
MODULE = "rl_engine.backends.triton.norm"
DTYPES = ("float32", "bfloat16")
gpu = pytest.mark.gpu


def _data(m, h, dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = (torch.randn(m, h, generator=g) * 2).to(dt).to(device)
    res = torch.randn(m, h, generator=g).to(dt).to(device)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dt).to(device)
    return x, res, w


# ------------------------------------------------------------------------------------------
# CPU: registration, routing, rejection reasons


@pytest.mark.parametrize("op", OPS)
def test_registration_declares_cuda_and_untested_rocm(op):
    check_registration(op, IMPL, MODULE, "norm")


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_route_to_cpu_and_checks_are_pure(op):
    check_cpu_routing(op, IMPL, torch.randn(2, 8))
    check_static_and_fake_gpu(op, IMPL)


# ------------------------------------------------------------------------------------------
# GPU: accuracy


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (37, 4096), (3, 5, 1000), (4, 12000)])
def test_rms_norm_accuracy_forward_and_grads(dtype, shape):
    *lead, h = shape
    x, _, w = _data(int(torch.tensor(lead).prod()), h, dtype)
    x = x.reshape(*lead, h).requires_grad_()
    w = w.requires_grad_()
    with provenance.record() as recs:
        y = norm.rms_norm(x, w, 1e-6)
    assert recs and recs[0].impl_id == IMPL
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype).cuda()
    y.backward(up)
    x64, w64 = (t.detach().cpu().double().requires_grad_() for t in (x, w))
    y64 = rms_norm_f64(x64, w64, 1e-6)
    y64.backward(up.cpu().double())
    dt = getattr(torch, dtype)
    assert y.dtype == dt and x.grad.dtype == dt and w.grad.dtype == dt
    accuracy("norm.rms_norm", dt, "forward", y, y64)
    accuracy("norm.rms_norm", dt, "backward", x.grad, x64.grad, "dx")
    accuracy("norm.rms_norm", dt, "backward", w.grad, w64.grad, "dweight")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,h", [(5, 64), (48, 2048), (3, 9000)])
def test_fused_add_rms_norm_accuracy_and_equals_add_then_norm(dtype, m, h):
    x, res, w = _data(m, h, dtype, seed=3)
    xx, rr, ww = (t.clone().requires_grad_() for t in (x, res, w))
    out, new_res = norm.fused_add_rms_norm(xx, rr, ww, 1e-6)
    # bit for bit: new_residual = round(x + r), out = rms_norm(new_residual)
    assert same_bits(new_res, (x.float() + res.float()).to(x.dtype))
    assert same_bits(out, norm.rms_norm(new_res.detach(), w, 1e-6))
    gen = torch.Generator().manual_seed(4)
    g_out = torch.randn(m, h, generator=gen).to(x.dtype).cuda()
    g_res = torch.randn(m, h, generator=gen).to(x.dtype).cuda()
    torch.autograd.backward([out, new_res], [g_out, g_res])
    assert same_bits(xx.grad, rr.grad)
    x64, r64, w64 = (t.detach().cpu().double().requires_grad_() for t in (x, res, w))
    o64, n64 = fused_add_rms_norm_f64(x64, r64, w64, 1e-6)
    torch.autograd.backward([o64, n64], [g_out.cpu().double(), g_res.cpu().double()])
    dt = x.dtype
    accuracy("norm.fused_add_rms_norm", dt, "forward", out, o64, "out")
    accuracy("norm.fused_add_rms_norm", dt, "forward", new_res, n64, "new_residual")
    accuracy("norm.fused_add_rms_norm", dt, "backward", xx.grad, x64.grad, "dx")
    accuracy("norm.fused_add_rms_norm", dt, "backward", ww.grad, w64.grad, "dweight")


# ------------------------------------------------------------------------------------------
# GPU: invariance (raw bits)


def _rms_on_gpu(w):
    def fn(x_cpu):
        return norm.rms_norm(x_cpu.cuda(), w, 1e-6).cpu()

    return fn


def _fused_on_gpu(w):
    def fn(x_cpu, r_cpu):
        out, new_res = norm.fused_add_rms_norm(x_cpu.cuda(), r_cpu.cuda(), w, 1e-6)
        return out.cpu(), new_res.cpu()

    return fn


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 64), h=st.sampled_from([64, 200, 1024]))
def test_rms_norm_row_invariance_forward_and_grad_hypothesis(dtype, data, m, h):
    x, _, w = _data(m, h, dtype, seed=m * 7 + h)
    rep = check_row_invariance(_rms_on_gpu(w), [x.cpu()], data.draw(row_trials(m)), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), m=st.integers(1, 64), h=st.sampled_from([64, 200]))
def test_fused_add_rms_norm_row_invariance_forward_and_grad_hypothesis(dtype, data, m, h):
    x, res, w = _data(m, h, dtype, seed=m * 5 + h)
    rep = check_row_invariance(_fused_on_gpu(w), [x.cpu(), res.cpu()], data.draw(row_trials(m)), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_equal_across_batch_sizes_at_model_width(dtype):
    """A row alone, in small batches and inside M = 8192 (H = 4096): same bits, y and dx
    (the backward's rows-per-program follows M; a row's arithmetic does not)."""
    dt = getattr(torch, dtype)
    x, w = gpu_randn((8192, 4096), 11, dt, 2.0), gpu_randn((4096,), 12, dt, 0.1) + 1
    up = gpu_randn((8192, 4096), 2, dt)
    xf = x.clone().requires_grad_()
    yf = norm.rms_norm(xf, w)
    yf.backward(up)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 2, 17, 264, 265, 1000, 4099):
        idx = torch.randperm(8192, generator=gen)[:m].cuda()
        xs = x[idx].clone().requires_grad_()
        ys = norm.rms_norm(xs, w)
        ys.backward(up[idx])
        assert same_bits(ys, yf.detach()[idx]), f"M={m}: {same_bits(ys, yf.detach()[idx])}"
        assert same_bits(xs.grad, xf.grad[idx]), f"dx M={m}: {same_bits(xs.grad, xf.grad[idx])}"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_grads(dtype):
    dt = getattr(torch, dtype)
    x, res, w = gpu_randn((4096, 4096), 5, dt), gpu_randn((4096, 4096), 6, dt), gpu_randn((4096,), 7, dt, 0.1) + 1
    up = gpu_randn((4096, 4096), 9, dt)
    runs = []
    for _ in range(3):
        xx, rr, ww = (t.clone().requires_grad_() for t in (x, res, w))
        out, new_res = norm.fused_add_rms_norm(xx, rr, ww)
        y = norm.rms_norm(new_res, ww)
        (out.float() * up.float()).sum().backward(retain_graph=True)
        y.backward(up)
        runs.append((out.detach(), y.detach(), xx.grad, ww.grad))
    for run in runs[1:]:
        for name, a, b in zip(("out", "y", "dx", "dweight"), runs[0], run):
            assert same_bits(a, b), f"{name}: {same_bits(a, b)}"


def _split_sum_when_small(w):
    """Planted non-invariance: batches of <= 8 rows reduce the sum of squares in two halves
    (an M-dependent reduction split, like split-K); larger batches use the Triton kernel."""

    def fn(x_cpu):
        x = x_cpu.cuda()
        if x.shape[0] > 8:
            return norm.rms_norm(x, w, 1e-6).cpu()
        h = x.float()
        half = h.shape[-1] // 2
        ss = (h[:, :half] * h[:, :half]).sum(-1) + (h[:, half:] * h[:, half:]).sum(-1)
        r = 1.0 / torch.sqrt(ss / h.shape[-1] + 1e-6)
        n = (h * r[:, None]).to(x.dtype)
        return (w.float() * n.float()).to(x.dtype).cpu()

    return fn


@gpu
def test_negative_control_split_reduction_is_caught():
    x, _, w = _data(64, 1000, "float32", seed=7)
    trials = [[0], [5, 17], list(range(0, 64, 9))]
    bad = check_row_invariance(_split_sum_when_small(w), [x.cpu()], trials)
    assert not bad.ok, "the checker missed a planted batch-size-dependent reduction split"
    good = check_row_invariance(_rms_on_gpu(w), [x.cpu()], trials, grads=True)
    assert good.ok, str(good)


# ------------------------------------------------------------------------------------------
# GPU: dispatch, profiler names, bounded performance


@gpu
@pytest.mark.parametrize("op", OPS)
def test_dispatch_picks_triton_on_cuda_and_records_provenance(op):
    x, res, w = _data(4, 64, "bfloat16")
    with provenance.record() as recs:
        if op == "norm.rms_norm":
            norm.rms_norm(x, w)
        else:
            norm.fused_add_rms_norm(x, res, w)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback and rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(op, x))
    assert rejections == []


@gpu
def test_profiler_kernel_names_carry_the_prefix():
    x, res, w = _data(512, 4096, "bfloat16")

    def call():
        xx, rr, ww = (t.clone().requires_grad_() for t in (x, res, w))
        out, new_res = norm.fused_add_rms_norm(xx, rr, ww)
        y = norm.rms_norm(new_res, ww)
        torch.autograd.backward([out, y], [torch.ones_like(out), torch.ones_like(y)])

    check_profiler_names(f"{MODULE}.kernels", call, {"rlk_rms_norm_fwd", "rlk_rms_norm_bwd", "rlk_rms_norm_dw"}, "norm")


@gpu
def test_bounded_performance_vs_torch_composite():
    """Ours within 2x of the HF-style composite (fp32 pow/mean/rsqrt/mul, several kernels) on the
    same device and run (CUDA-graph replay): forward and forward + backward."""
    from rl_engine.backends.triton.norm import rms_norm_triton

    x, w = gpu_randn((8192, 4096), 0, torch.bfloat16), gpu_randn((4096,), 1, torch.bfloat16, 0.1) + 1

    def hf(xx, ww):
        h = xx.float()
        return ww * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(xx.dtype)

    ours = graph_us(lambda: rms_norm_triton(x, w, 1e-6))
    ref = graph_us(lambda: hf(x, w))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    up = torch.ones_like(x)
    ours_bwd = graph_us(lambda: torch.autograd.grad(rms_norm_triton(xg, wg, 1e-6), (xg, wg), up))
    ref_bwd = graph_us(lambda: torch.autograd.grad(hf(xg, wg), (xg, wg), up))
    evidence("bounded_perf_norm", {"shape": [8192, 4096], "ours_us": ours, "torch_us": ref,
                                   "ours_fwd_bwd_us": ours_bwd, "torch_fwd_bwd_us": ref_bwd})
    assert ours <= 2.0 * ref, f"forward {ours:.1f} us vs torch {ref:.1f} us"
    assert ours_bwd <= 2.0 * ref_bwd, f"forward+backward {ours_bwd:.1f} us vs torch {ref_bwd:.1f} us"
