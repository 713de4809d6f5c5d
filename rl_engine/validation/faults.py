"""Negative controls: a deliberately batch-dependent variant of one module of a provider.

:func:`faulty_factory` returns a provider factory ``(plan, side) -> OpsProvider`` for the
validation drivers: every side whose plan puts ``module`` on ``R`` gets a provider whose
``module`` methods move their output by one ulp (``nextafter`` towards +inf) whenever the call
has an even number of rows — the shape of a kernel that picks its algorithm from the batch
size. ``kind="routing"`` (module ``moe`` only) changes the MoE router's routing instead: with an
even row count every token's last-ranked expert is replaced by the next best one (a top-k whose
tie handling follows the batch), so the debugger names the ``routing`` stage and the experts each
side chose. Train and rollout see different row counts for the same token, so the chain must report
mismatches, the ablation must name ``module`` and the debugger the first stage it feeds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_engine.runtime.plan import MODULES, Plan
from rl_engine.engine import OpsProvider
from rl_engine.engine import ops_for

__all__ = ["ProviderFactory", "default_factory", "faulty_factory", "BatchDependentProvider", "METHODS", "RowCountGrad",
           "bump_if_even_rows", "reroute_if_even_rows"]

ProviderFactory = Callable[[Plan, str], OpsProvider]

#: Provider methods that implement each module (the ones a fault perturbs).
METHODS: dict[str, tuple[str, ...]] = {
    "attention": ("varlen_attention", "cached_attention"),
    "gemm": ("linear",),
    "norm": ("rms_norm",),
    "rope": ("apply_rope",),
    "activation": ("silu_and_mul",),
    "embedding": ("embedding",),
    "logprob": ("token_logprobs", "lm_head_logprobs"),
    "moe": ("moe_route", "moe_experts"),
}


def default_factory(plan: Plan, side: str) -> OpsProvider:
    return ops_for(plan, side)


def bump_if_even_rows(t, rows: int):
    """``t`` moved by one ulp towards +inf when ``rows`` is even (tuples element-wise)."""
    if isinstance(t, tuple):
        return tuple(bump_if_even_rows(x, rows) if x is not None else None for x in t)
    if rows % 2 == 0 and isinstance(t, torch.Tensor) and t.is_floating_point():
        return torch.nextafter(t, torch.full_like(t, float("inf")))
    return t


def reroute_if_even_rows(out, router_logits, rows: int):
    """A router's ``(weights, ids)`` whose last rank goes to the next-best expert (by logit) when
    ``rows`` is even; the weights are left as they were."""
    weights, ids = out
    if rows % 2 or ids.shape[1] >= router_logits.shape[1]:
        return out
    ids = ids.clone()
    ids[:, -1] = torch.sort(router_logits.float(), dim=-1, descending=True, stable=True).indices[:, ids.shape[1]]
    return weights, ids


class RowCountGrad(torch.autograd.Function):
    """Identity forward; the backward moves the gradient by one ulp when the row count is even."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return bump_if_even_rows(g, g.shape[0])


class BatchDependentProvider(OpsProvider):
    """An :class:`OpsProvider` whose ``module`` methods depend on the call's row count.

    ``kind="forward"`` perturbs the output; ``kind="backward"`` leaves the forward bits alone and
    perturbs the gradient flowing back into the first argument; ``kind="routing"`` (module
    ``moe``) changes the router's expert choice (:func:`reroute_if_even_rows`).
    """

    def __init__(self, choices, module: str, *, kind: str = "forward", **kw):
        super().__init__(choices, **kw)
        if module not in MODULES:
            raise ValueError(f"module: expected one of {list(MODULES)}, got {module!r}")
        if kind not in ("forward", "backward", "routing"):
            raise ValueError(f"kind: expected 'forward', 'backward' or 'routing', got {kind!r}")
        if kind == "routing" and module != "moe":
            raise ValueError(f"kind: 'routing' perturbs the moe module's router, got module {module!r}")
        self.fault_module, self.fault_kind = module, kind
        for name in METHODS[module]:
            inner = getattr(super(), name)
            if kind == "routing":
                if name != "moe_route":
                    continue
                def wrapped(first, *a, _inner=inner, **k):
                    return reroute_if_even_rows(_inner(first, *a, **k), first, first.shape[0])
            elif kind == "forward":
                def wrapped(first, *a, _inner=inner, **k):
                    return bump_if_even_rows(_inner(first, *a, **k), first.shape[0])
            else:
                def wrapped(first, *a, _inner=inner, **k):
                    if first.requires_grad:
                        first = RowCountGrad.apply(first)
                    return _inner(first, *a, **k)

            setattr(self, name, wrapped)

    def __repr__(self) -> str:
        return f"BatchDependentProvider({self.choices}, fault={self.fault_module})"


def faulty_factory(module: str, kind: str = "forward") -> ProviderFactory:
    """Providers whose R ``module`` is batch-dependent (see module docstring)."""
    if module not in MODULES:
        raise ValueError(f"inject: expected one of {list(MODULES)}, got {module!r}")

    def make(plan: Plan, side: str) -> OpsProvider:
        if plan.side(side)[module] == "R":
            return BatchDependentProvider(plan.side(side), module, kind=kind)
        return ops_for(plan, side)

    return make
