"""The public operators' direct eager path equals their custom-op path, bit for bit.

A plain eager call that records no gradient runs the selected implementation's Python body
without the ``torch.library`` layer (:mod:`rl_engine.runtime.custom_ops`), and so does a
backward pass (its backward ops). Per public operator: the no-grad forward runs no ``rlk::``
custom op and the backward no ``rlk::*_backward`` op (profiler events), while the same calls
under a pass-through ``TorchDispatchMode`` — which keeps the op layer — do run them (the
negative control that the event check can fail); outputs and gradients of the two paths are
equal on raw bits. On the GPU the same cases run the Triton implementations.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rl_engine import ops
from rl_engine.utils.bits import same_bits
from tests.helpers.op_layer import KeepOpLayer, ops_run

# the shapes and dtypes of tests/engine/test_no_host_sync.py, which every GPU implementation serves
H, V, T = 256, 1000, 24
BF16, F32 = torch.bfloat16, torch.float32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _r(dev: str, *shape: int, dtype=BF16, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)


def _ids(dev: str, n: int) -> torch.Tensor:
    return (torch.arange(n) * 37 % V).to(dev)


def _cu(dev: str) -> torch.Tensor:
    return torch.tensor([0, 7, T], dtype=torch.int32, device=dev)


# name -> (inputs on a device, the differentiable ones first; the public call; how many differentiable)
CASES: dict[str, tuple[Callable[[str], list[torch.Tensor]], Callable[..., object], int]] = {
    "linear": (lambda d: [_r(d, T, H), _r(d, H, H, scale=H ** -0.5)], lambda x, w: ops.gemm.linear(x, w), 2),
    "rms_norm": (lambda d: [_r(d, T, H), _r(d, H)], lambda x, w: ops.norm.rms_norm(x, w, 1e-6), 2),
    "fused_add_rms_norm": (lambda d: [_r(d, T, H), _r(d, T, H, scale=0.5), _r(d, H)],
                           lambda x, r, w: ops.norm.fused_add_rms_norm(x, r, w, 1e-6), 3),
    "silu_and_mul": (lambda d: [_r(d, T, 2 * H)], ops.activation.silu_and_mul, 1),
    "apply_rope": (lambda d: [_r(d, T, 4, 64), torch.arange(T, device=d)],
                   lambda x, pos: ops.rope.apply_rope(x, pos, theta=1e6), 1),
    "embedding": (lambda d: [_r(d, V, H), _ids(d, T)], lambda w, ids: ops.embedding.embedding(ids, w), 1),
    "log_softmax": (lambda d: [_r(d, T, V, dtype=F32)], ops.logprob.log_softmax, 1),
    "token_logprobs": (lambda d: [_r(d, T, V, dtype=F32), _ids(d, T)], ops.logprob.token_logprobs, 1),
    "entropy": (lambda d: [_r(d, T, V, dtype=F32)], ops.logprob.entropy, 1),
    "linear_token_logprobs": (lambda d: [_r(d, T, H), _r(d, V, H, scale=H ** -0.5), _ids(d, T)],
                              ops.logprob.linear_token_logprobs, 2),
    "varlen_attention": (lambda d: [_r(d, T, 4, 64), _r(d, T, 2, 64), _r(d, T, 2, 64, scale=0.5), _cu(d)],
                         ops.attention.varlen_attention, 3),
    "moe": (lambda d: [_r(d, T, H), _r(d, 16, 2 * 96, H, scale=H ** -0.5), _r(d, 16, H, 96, scale=96 ** -0.5),
                       _r(d, T, 16)],
            lambda x, wgu, wd, logits: ops.moe.experts(x, wgu, wd, *ops.moe.route(logits, 4, True)), 4),
}


def _flat(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def _run(name: str, dev: str, grad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    make, call, n_diff = CASES[name]
    args = make(dev)
    if grad:
        args = [a.requires_grad_() if i < n_diff else a for i, a in enumerate(args)]
    outs = _flat(call(*args))
    return outs, args[:n_diff]


def _backward(outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    loss = sum(o.float().square().sum() for o in outs if o.requires_grad)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_no_grad_forward_skips_the_op_layer_with_the_same_bits(name, dev):
    _run(name, dev, grad=False)  # warm-up: selections, tables, compilation
    with torch.no_grad():
        direct_events = ops_run(lambda: _run(name, dev, grad=False))
        direct, _ = _run(name, dev, grad=False)
        with KeepOpLayer():
            kept_events = ops_run(lambda: _run(name, dev, grad=False))
            kept, _ = _run(name, dev, grad=False)
    assert direct_events == [], direct_events
    assert kept_events, "control: under a dispatch mode the op layer runs"
    assert len(direct) == len(kept) and all(same_bits(a, b) for a, b in zip(direct, kept))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_backward_runs_its_ops_directly_with_the_same_bits(name, dev):
    outs, leaves = _run(name, dev, grad=True)
    assert any(not e.endswith("_backward") for e in ops_run(lambda: _run(name, dev, grad=True))), \
        "a forward that records a gradient runs the op (autograd needs it)"
    grads_direct: list[torch.Tensor] = []
    direct_events = ops_run(lambda: grads_direct.extend(_backward(outs, leaves)))
    outs, leaves = _run(name, dev, grad=True)
    grads_kept: list[torch.Tensor] = []
    with KeepOpLayer():
        kept_events = ops_run(lambda: grads_kept.extend(_backward(outs, leaves)))
    assert not [e for e in direct_events if e.endswith("_backward")], direct_events
    assert [e for e in kept_events if e.endswith("_backward")], "control: under a dispatch mode the backward ops run"
    assert len(grads_direct) == len(grads_kept)
    assert all(same_bits(a, b) for a, b in zip(grads_direct, grads_kept))
