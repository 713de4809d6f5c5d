"""Run-to-run determinism on raw bits: forward outputs and every gradient, repeated calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl_engine.utils.bits import same_bits


def outputs_and_grads(fn: Callable[..., object], inputs: Sequence[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Call ``fn`` on fresh copies of ``inputs`` (floating ones require grad), backpropagate a
    fixed random upstream gradient; returns the outputs followed by the input gradients."""
    args = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, ups)
    return [o.detach() for o in outs] + [a.grad for a in args if a.is_floating_point()]


def run_to_run_failures(fn: Callable[..., object], inputs: Sequence[torch.Tensor], runs: int = 3) -> list[str]:
    """Raw-bit differences between ``runs`` repeated calls (empty: deterministic)."""
    first = outputs_and_grads(fn, inputs)
    failures = []
    for r in range(1, runs):
        again = outputs_and_grads(fn, inputs)
        for k, (a, b) in enumerate(zip(first, again)):
            d = same_bits(b, a)
            if not d.equal:
                failures.append(f"run {r}, tensor {k}: {d}")
    return failures


def thread_count_failures(fn: Callable[..., object], inputs: Sequence[torch.Tensor], counts: Sequence[int] = (1, 2, 3)) -> list[str]:
    """Raw-bit differences of outputs and gradients between intra-op thread counts (empty:
    independent). Inputs should be large enough (> 32768 elements) for torch to split work."""
    from tests.helpers.threads import threads

    results = []
    for n in counts:
        with threads(n):
            results.append(outputs_and_grads(fn, inputs))
    failures = []
    for n, res in zip(counts[1:], results[1:]):
        for k, (a, b) in enumerate(zip(results[0], res)):
            d = same_bits(b, a)
            if not d.equal:
                failures.append(f"{n} threads vs {counts[0]}, tensor {k}: {d}")
    return failures
