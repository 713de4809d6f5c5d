"""Triton ``logprob.log_softmax`` / ``token_logprobs`` / ``entropy`` (impl ``triton.canonical_lse``):
the one test module of this operator target.

GPU tests (``@pytest.mark.gpu``; the device run must show zero skips): accuracy of values and
logits gradients against float64 (contract tolerances), at temperature 1 and not, with ``-inf``
logits, with a vocabulary that is and is not a multiple of the 1024-column block; the public
equalities on raw bits (token log-prob = log-softmax at the target); 200 hypothesis examples per
dtype of row invariance (forward + grad) for each op; run-to-run determinism; a planted
batch-size-dependent path (``torch.log_softmax`` for small batches) caught by the same checker;
the error for a row without a finite logit; dispatch/provenance; profiler names; bounded
performance. CPU tests: registration, routing, pure eligibility checks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.ops import logprob
from rl_engine.reference.logprob import entropy_f64, log_softmax_f64, token_logprobs_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import make_request, select
from rl_engine.utils.bits import same_bits
from rl_engine.utils.checks import nan_policy
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
    interp,
    interpreter_asserts,
)
from tests.helpers.strategies import row_trials

OPS = ("logprob.log_softmax", "logprob.token_logprobs", "logprob.entropy")
IMPL = "triton.canonical_lse"
MODULE = "rl_engine.backends.triton.logprob"
DTYPES = ("float32", "bfloat16")
gpu = pytest.mark.gpu


def _data(r, v, dtype, seed=0, scale=4.0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(r, v, generator=g) * scale).to(getattr(torch, dtype)).to(device)
    t = torch.randint(0, v, (r,), generator=g).to(device)
    return x, t


def _call(op, x, t, temp):
    if op == "logprob.log_softmax":
        return logprob.log_softmax(x, temp)
    if op == "logprob.token_logprobs":
        return logprob.token_logprobs(x, t, temp)
    return logprob.entropy(x, temp)


def _ref(op, x, t, temp):
    if op == "logprob.log_softmax":
        return log_softmax_f64(x, temp)
    if op == "logprob.token_logprobs":
        return token_logprobs_f64(x, t, temp)
    return entropy_f64(x, temp)


@pytest.mark.parametrize("op", OPS)
def test_registration_declares_cuda_and_untested_rocm(op):
    check_registration(op, IMPL, MODULE, "logprob")


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_route_to_cpu_and_checks_are_pure(op):
    check_cpu_routing(op, IMPL, torch.randn(2, 8))
    check_static_and_fake_gpu(op, IMPL)


@gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r,v,temp", [(1, 7, 1.0), (37, 3000, 0.7), (5, 2048, 1.0), (3, 151936, 1.3)])
def test_accuracy_forward_and_grad(op, dtype, r, v, temp):
    x, t = _data(r, v, dtype, seed=v)
    xx = x.clone().requires_grad_()
    with provenance.record() as recs:
        y = _call(op, xx, t, temp)
    assert recs and recs[0].impl_id == IMPL
    assert y.dtype == torch.float32
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).cuda()
    y.backward(up)
    assert xx.grad.dtype == x.dtype
    x64 = x.cpu().double().requires_grad_()
    y64 = _ref(op, x64, t.cpu(), temp)
    y64.backward(up.cpu().double())
    accuracy(op, x.dtype, "forward", y, y64)
    accuracy(op, x.dtype, "backward", xx.grad, x64.grad, "dlogits")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_neg_inf_logits_and_dead_rows(dtype):
    x, t = _data(4, 2500, dtype, seed=3)
    x[0, :1500] = float("-inf")  # masked vocabulary, incl. a whole block
    t[0] = 2000
    lp = logprob.token_logprobs(x, t)
    ls = logprob.log_softmax(x)
    ent = logprob.entropy(x)
    assert torch.isneginf(ls[0, :1500]).all() and torch.isfinite(ls[0, 1500:]).all()
    accuracy("logprob.token_logprobs", x.dtype, "forward", lp, token_logprobs_f64(x.cpu(), t.cpu()))
    accuracy("logprob.entropy", x.dtype, "forward", ent, entropy_f64(x.cpu()))
    xx = x.clone().requires_grad_()
    logprob.entropy(xx).sum().backward()
    assert torch.isfinite(xx.grad.float()).all() and (xx.grad[0, :1500] == 0).all()
    x[1] = float("-inf")
    with nan_policy("raise"), pytest.raises(ValueError, match=r"^logits: rows \[1\] have no finite entry"):
        logprob.token_logprobs(x, t)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_public_equalities_on_raw_bits(dtype, temp):
    """token_logprobs == log_softmax[target], and every row alone == inside the batch."""
    x, t = _data(64, 5000, dtype, seed=9)
    lp = logprob.token_logprobs(x, t, temp)
    ls = logprob.log_softmax(x, temp)
    assert same_bits(lp, ls.gather(1, t[:, None]).squeeze(1))
    ent = logprob.entropy(x, temp)
    for i in (0, 33, 63):
        assert same_bits(logprob.entropy(x[i : i + 1].contiguous(), temp), ent[i : i + 1])
        assert same_bits(logprob.token_logprobs(x[i : i + 1].contiguous(), t[i : i + 1].contiguous(), temp), lp[i : i + 1])


def _on_gpu(op, temp):
    def fn(x_cpu, t_cpu):
        return _call(op, x_cpu.cuda(), t_cpu.cuda(), temp).cpu()

    return fn


@gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(data=st.data(), r=st.integers(1, 48), v=st.sampled_from([100, 1024, 2500]), temp=st.sampled_from([1.0, 0.8]))
def test_row_invariance_forward_and_grad_hypothesis(op, dtype, data, r, v, temp):
    x, t = _data(r, v, dtype, seed=r * 17 + v)
    rep = check_row_invariance(_on_gpu(op, temp), [x.cpu(), t.cpu()], data.draw(row_trials(r)), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_grads(dtype):
    x = gpu_randn((1024, 151936), 5, getattr(torch, dtype), 4.0)
    t = torch.randint(0, 151936, (1024,), device="cuda")
    runs = []
    for _ in range(3):
        xx = x.clone().requires_grad_()
        lp = logprob.token_logprobs(xx, t)
        ent = logprob.entropy(xx)
        (lp.sum() + 0.1 * ent.sum()).backward()
        runs.append((lp.detach(), ent.detach(), xx.grad))
    for run in runs[1:]:
        for name, a, b in zip(("lp", "entropy", "dlogits"), runs[0], run):
            assert same_bits(a, b), f"{name}: {same_bits(a, b)}"


def _torch_path_when_small(x_cpu, t_cpu):
    """Planted non-invariance: batches of <= 8 rows use torch.log_softmax (another reduction
    algorithm), larger batches the Triton kernel."""
    x, t = x_cpu.cuda(), t_cpu.cuda()
    if x.shape[0] > 8:
        return logprob.token_logprobs(x, t).cpu()
    return torch.log_softmax(x.float(), -1).gather(1, t[:, None]).squeeze(1).cpu()


@gpu
def test_negative_control_batch_dependent_path_is_caught():
    x, t = _data(64, 3000, "float32", seed=7)
    trials = [[0], [5, 17], list(range(0, 64, 9))]
    bad = check_row_invariance(_torch_path_when_small, [x.cpu(), t.cpu()], trials)
    assert not bad.ok, "the checker missed a planted batch-size-dependent log-softmax path"
    good = check_row_invariance(_on_gpu("logprob.token_logprobs", 1.0), [x.cpu(), t.cpu()], trials, grads=True)
    assert good.ok, str(good)


@gpu
@pytest.mark.parametrize("op", OPS)
def test_dispatch_picks_triton_on_cuda_and_records_provenance(op):
    x, t = _data(4, 100, "bfloat16")
    with provenance.record() as recs:
        _call(op, x, t, 1.0)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback and rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(op, x))
    assert rejections == []


@gpu
def test_profiler_kernel_names_carry_the_prefix():
    x = gpu_randn((64, 151936), 0, torch.bfloat16, 4.0)
    t = torch.randint(0, 151936, (64,), device="cuda")

    def call():
        xx = x.clone().requires_grad_()
        total = logprob.token_logprobs(xx, t, 0.9).sum() + logprob.entropy(xx).sum() + logprob.log_softmax(xx)[:, 0].sum()
        total.backward()

    check_profiler_names(
        f"{MODULE}.kernels", call,
        {"rlk_logprob_fwd", "rlk_log_softmax_bwd", "rlk_token_logprobs_bwd", "rlk_entropy_bwd"}, "logprob",
    )


@gpu
def test_bounded_performance_vs_torch():
    """Token log-prob (+ entropy) of bf16 logits [4096, 151936] within 2x of torch's
    ``log_softmax(x.float()).gather`` (+ entropy from it), same device and run (CUDA graphs)."""
    from rl_engine.backends.triton.logprob import kernels

    x = gpu_randn((4096, 151936), 0, torch.bfloat16, 4.0)
    t = torch.randint(0, 151936, (4096,), device="cuda")

    def ref():
        ls = torch.log_softmax(x.float(), -1)
        return ls.gather(1, t[:, None]), -(ls.exp() * ls).sum(-1)

    ours = graph_us(lambda: kernels.forward(x, 1.0, targets=t, entropy=True))
    theirs = graph_us(ref)
    evidence("bounded_perf_logprob", {"shape": [4096, 151936], "ours_us": ours, "torch_us": theirs})
    assert ours <= 2.0 * theirs, f"{ours:.1f} us vs torch {theirs:.1f} us"


# ---------------------------------------------------------------------------------------------
# the processed variant (kept-set records)


def _records(x, temp, seed):
    """Canonical kept-set records of the GPU logits ``x`` at ``temp`` (the rollout's filter, on the
    CPU) and one kept target per row, both on the GPU."""
    from rl_engine.ops.logprob import kept_set, scale_logits

    g = torch.Generator().manual_seed(seed)
    xc = x.cpu()
    kept = kept_set(xc, temp, torch.randint(1, 200, (x.shape[0],), generator=g), 0.9)
    t = torch.multinomial(kept.mask(scale_logits(xc, temp)).float(), 1, generator=g).squeeze(1)
    return kept.to("cuda"), t.cuda()


def _call_kept(op, x, t, temp, kept):
    if op == "logprob.log_softmax":
        return logprob.log_softmax(x, temp, kept=kept)
    if op == "logprob.token_logprobs":
        return logprob.token_logprobs(x, t, temp, kept=kept)
    return logprob.entropy(x, temp, kept=kept)


@gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r,v,temp", [(37, 3000, 0.7), (5, 2048, 1.0), (3, 151936, 1.3)])
def test_processed_equals_full_on_masked_logits_and_is_accurate(op, dtype, r, v, temp):
    """With records, each op gives the bits of the plain op on logits whose dropped entries are
    ``-inf`` (the same masked ``z``), the gradient is ``+0`` at dropped entries, and the values
    meet the contract's tolerances against float64 on the kept set."""
    from rl_engine.ops.logprob import scale_logits
    from rl_engine.reference.logprob import log_softmax_f64

    x, _ = _data(r, v, dtype, seed=v + 1)
    kept, t = _records(x, temp, v)
    keep = kept.mask(scale_logits(x, temp))
    masked = x.masked_fill(~keep, float("-inf"))
    xx = x.clone().requires_grad_()
    y = _call_kept(op, xx, t, temp, kept)
    plain = _call(op, masked, t, temp)
    assert same_bits(y, plain)
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).cuda()
    y.backward(up)
    dropped = xx.grad[~keep]
    assert bool((dropped == 0).all()) and not bool(torch.signbit(dropped).any())
    if op == "logprob.token_logprobs":
        kt, kb = kept.threshold.cpu(), kept.boundary.cpu()
        y64 = token_logprobs_f64(x.cpu(), t.cpu(), temp, kt, kb)
        accuracy(op, x.dtype, "forward", y, y64)
        assert bool(torch.isfinite(log_softmax_f64(x.cpu(), temp, kt, kb).gather(1, t.cpu()[:, None])).all())


@gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), r=st.integers(1, 40), v=st.sampled_from([100, 1024, 2500]), temp=st.sampled_from([1.0, 0.8]))
def test_processed_row_invariance_forward_and_grad_hypothesis(op, dtype, data, r, v, temp):
    from rl_engine.ops.logprob import KeptSet

    x, _ = _data(r, v, dtype, seed=r * 19 + v)
    kept, t = _records(x, temp, r)

    def fn(x_cpu, t_cpu, thr, bnd):
        return _call_kept(op, x_cpu.cuda(), t_cpu.cuda(), temp, KeptSet(thr.cuda(), bnd.cuda())).cpu()

    rep = check_row_invariance(fn, [x.cpu(), t.cpu(), kept.threshold.cpu(), kept.boundary.cpu()],
                               data.draw(row_trials(r)), grads=True)
    assert rep.ok, str(rep)


@gpu
def test_processed_target_outside_its_kept_set_counts_as_kept():
    """Logits that drifted from the record's: the target is counted in the kept set (finite, the
    bits of the plain op on the logits masked to the kept set plus the target)."""
    from rl_engine.ops.logprob import scale_logits

    x, _ = _data(4, 3000, "float32", seed=5)
    kept, t = _records(x, 1.0, 5)
    keep = kept.mask(scale_logits(x, 1.0))
    t[1] = int(torch.nonzero(~keep[1])[0])
    keep[1, t[1]] = True
    lp = logprob.token_logprobs(x, t, kept=kept)
    assert bool(torch.isfinite(lp).all())
    assert same_bits(lp, logprob.token_logprobs(x.masked_fill(~keep, float("-inf")), t))
    with provenance.record() as recs:
        logprob.entropy(x, kept=kept)
    assert [r.impl_id for r in recs] == [IMPL]


@gpu
@pytest.mark.parametrize("temp", [0.7, 1.3, 0.9])
def test_scale_logits_on_the_gpu_is_the_correctly_rounded_division(temp):
    """``scale_logits`` on a GPU tensor gives the CPU's correctly rounded ``x / fl32(τ)`` (the
    kernels' ``div_rn``), where torch's division by a host scalar (its reciprocal) need not: the
    kept-set records and the kernels must read the same ``z``."""
    from rl_engine.ops.logprob import scale_logits

    x = gpu_randn((64, 151936), 3, torch.float32, 4.0)
    want = x.cpu() / temp
    assert same_bits(scale_logits(x, temp).cpu(), want)
    evidence(f"scale_logits_host_scalar_division_{temp}", {"torch_x_div_float": str(same_bits((x / temp).cpu(), want))})


@interp
def test_interpreter_forward_asserts_the_target_range():
    """``rlk_logprob_fwd`` asserts ``0 <= target < V`` where it reads the target
    (``device_index_checks`` of ``logprob.token_logprobs``: its entry point launches no separate
    check on a GPU); in-range targets give the same log-probs with the asserts on (the control).
    The fused LM head's implementation does not declare it, so its entry point keeps the check."""
    from rl_engine.backends.triton.logprob import kernels
    from rl_engine.runtime.registry import implementations

    x = torch.randn(3, 2500)
    good = torch.tensor([0, 2499, 1024])
    want = kernels.forward(x, 1.0, targets=good)[1]
    with interpreter_asserts():
        assert same_bits(kernels.forward(x, 1.0, targets=good)[1], want)
        for bad in ([0, 2500, 1], [-1, 0, 1]):
            with pytest.raises(BaseException, match="targets: expected token ids in"):
                kernels.forward(x, 1.0, targets=torch.tensor(bad))
        assert kernels.forward(x, 1.0)[1] is None  # no targets: nothing to assert
    flags = {op: [i.device_index_checks for i in implementations(op) if i.impl_id == IMPL]
             for op in ("logprob.token_logprobs", "logprob.linear_token_logprobs")}
    assert flags == {"logprob.token_logprobs": [True], "logprob.linear_token_logprobs": [False]}

