"""The host path shared by every Triton operator (``rl_engine/backends/triton/__init__.py``):
when an eager call skips the ``torch.library`` custom-op layer (``direct_call_ok`` / ``call_op``)
and the device guard.

CPU tests: the decision in every case that must keep the op (gradient, fake / functional
tensors, dispatch and function modes, ``torch.compile``), observed through the profiler (the
op's own event appears exactly when the op layer ran), on a test custom op. GPU tests: the
direct path and the op path of the registered operators give the same raw bits, and a plain
no-grad call of the public op skips the layer.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine.backends.triton import call_op, device_guard, direct_call_ok, eager_entry
from rl_engine.utils.bits import same_bits
from tests.backends.triton._rowwise_common import interp

gpu = pytest.mark.gpu


@torch.library.custom_op("rlk_test::host_path_scale", mutates_args=(), device_types="cpu")
def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


_scale.register_fake(lambda x, w: torch.empty_like(x))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    x, w = ctx.saved_tensors
    return g * w, g * x


_scale.register_autograd(_backward, setup_context=_setup)


def _op_layer_ran(fn) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.name == "rlk_test::host_path_scale" for e in prof.events())


class _Log(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_no_grad_call_skips_the_op_layer():
    x, w = torch.randn(4), torch.randn(4)
    assert direct_call_ok((x, w, 3, None))
    assert not _op_layer_ran(lambda: call_op(_scale, x, w))
    assert torch.equal(call_op(_scale, x, w), _scale(x, w))
    p = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():  # a Parameter is a plain tensor; no grad mode: nothing to record
        assert direct_call_ok((x, p))
        assert not _op_layer_ran(lambda: call_op(_scale, x, p))


def test_every_case_that_needs_the_op_keeps_it():
    x, w = torch.randn(4), torch.randn(4)
    xg = x.clone().requires_grad_()
    assert not direct_call_ok((xg, w))  # negative control: autograd must see the op
    assert _op_layer_ran(lambda: call_op(_scale, xg, w))
    y = call_op(_scale, xg, w)
    y.sum().backward()
    assert torch.equal(xg.grad, w)
    with _Log():
        assert not direct_call_ok((x, w))
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not direct_call_ok((x, w))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
    assert not direct_call_ok((fx, w))

    seen = []

    @torch.compile(backend=lambda gm, example_inputs: (seen.append(gm), gm)[1], fullgraph=True)
    def f(a, b):
        return call_op(_scale, a, b)

    assert torch.equal(f(x, w), x * w)
    ops = [n.target for gm in seen for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.rlk_test.host_path_scale.default in ops, ops  # traced as the op, not its body


def test_eager_entry_keeps_the_implementing_module():
    entry = eager_entry(_scale)
    assert entry._init_fn.__module__ == __name__
    assert entry.__name__ == "_scale"
    x, w = torch.randn(3), torch.randn(3)
    assert torch.equal(entry(x, w), x * w)


def test_device_guard_is_a_no_op_off_gpu_and_on_the_current_gpu():
    with device_guard(torch.zeros(1)):
        pass
    if torch.cuda.is_available():
        t = torch.zeros(1, device="cuda")
        assert device_guard(t).__class__.__name__ == "nullcontext"


@interp
def test_interpreter_every_kernel_module_imports():
    """Every module holding ``@triton.jit`` code imports (names it takes from the shared host
    helpers resolve) — the CPU suite cannot see this, it has no triton."""
    import rl_engine.backends.triton as pkg

    names = []
    for fam in pkgutil.iter_modules(pkg.__path__):
        sub = importlib.import_module(f"{pkg.__name__}.{fam.name}")
        for mod in pkgutil.iter_modules(sub.__path__):
            if mod.name != "__init__":
                names.append(importlib.import_module(f"{sub.__name__}.{mod.name}").__name__)
    assert {"rl_engine.backends.triton.logprob.fused", "rl_engine.backends.triton.gemm.kernels"} <= set(names)


# --------------------------------------------------------------------------- GPU


@gpu
def test_public_ops_direct_path_equals_op_path_on_gpu():
    """Same bits through both paths; the no-grad public call skips ``rlk::linear_triton``."""
    from rl_engine.ops import gemm
    from rl_engine.ops.norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 256, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(96, 256, device="cuda", generator=g) / 16).to(torch.bfloat16)
    nw = torch.randn(256, device="cuda", generator=g).to(torch.bfloat16)
    with torch.no_grad():
        y_direct = gemm.linear(x, w)
        n_direct = rms_norm(x, nw, 1e-6)
    xg = x.clone().requires_grad_()
    y_op = gemm.linear(xg, w)
    n_op = rms_norm(xg, nw, 1e-6)
    assert same_bits(y_direct, y_op.detach()) and same_bits(n_direct, n_op.detach())
    # attention: the no-grad call also skips the backward's extra outputs (fp32 output, lse)
    from rl_engine.ops.attention import varlen_attention

    q = torch.randn(70, 8, 64, device="cuda", generator=g).to(torch.bfloat16)
    kv = [torch.randn(70, 2, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    cu = torch.tensor([0, 5, 70], device="cuda", dtype=torch.int32)
    with torch.no_grad():
        a_direct = varlen_attention(q, *kv, cu)
    a_op = varlen_attention(q.clone().requires_grad_(), *kv, cu)
    assert same_bits(a_direct, a_op.detach())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            gemm.linear(x, w)
    assert not any(e.name.startswith("rlk::linear_triton") for e in prof.events())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gemm.linear(xg, w)
    assert any(e.name.startswith("rlk::linear_triton") for e in prof.events())
