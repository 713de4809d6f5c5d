"""The host path shared by every Triton operator (``rl_engine/backends/triton/__init__.py``):
the device guard, and on the GPU the direct eager path past the custom-op layer
(:mod:`rl_engine.runtime.custom_ops`, whose decision is tested on the CPU in
``tests/runtime/test_custom_ops.py``): the direct path and the op path of the registered
operators give the same raw bits, and a plain no-grad call of the public op skips the layer.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rl_engine.backends.triton import device_guard
from rl_engine.utils.bits import same_bits
from tests.backends.triton._rowwise_common import interp

gpu = pytest.mark.gpu


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
            varlen_attention(q, *kv, cu)
    named = [e for e in prof.events() if e.name == "rlk::varlen_attention_triton"]
    assert named and all(e.is_user_annotation for e in named)  # the direct forward's range, not the op
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            gemm.linear(x, w)
    ops = [e for e in prof.events() if e.name.startswith("rlk::linear_triton")]
    assert ops and all(e.is_user_annotation for e in ops)  # the direct call's named range, not the op
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gemm.linear(xg, w)
    assert any(e.name.startswith("rlk::linear_triton") and not e.is_user_annotation for e in prof.events())
