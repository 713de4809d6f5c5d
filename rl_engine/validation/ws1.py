"""WS1 operator suite: every registered operator × eligible implementation × dtype.

For each cell (operator, implementation, dtype) four checks run on the workload's operator
inputs (:mod:`rl_engine.validation.operators`):

* ``forward_accuracy`` — outputs vs the float64 reference, tolerance
  ``contracts.tolerance(op, dtype, "forward")``;
* ``gradient_accuracy`` — gradients of every floating input for a fixed upstream gradient vs
  float64 autograd of the reference, tolerance ``"backward"``;
* ``forward_invariance`` — raw bits of each output row across re-batched calls (subsets,
  orders, repeats: the workload's trial layouts), :func:`check_row_invariance`;
* ``gradient_invariance`` — the same for the row arguments' gradients.

Statuses: ``green`` pass, ``red`` fail, ``n.a.`` not applicable (with the reason: no input
generator, implementation not eligible on this device, no gradient w.r.t. row arguments).
**Negative controls** run through the same checkers (a row-count-dependent forward, a
row-count-dependent backward, an inaccurate forward of ``gemm.linear``; an expert-load-dependent
``moe.expert_down_combine``) and must be detected; an undetected control fails the suite.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rl_engine import contracts
from rl_engine.workloads import LoadedWorkload
from rl_engine.runtime import Request, implementations
from rl_engine.validation.common.invariance import check_row_invariance
from rl_engine.validation.faults import RowCountGrad, bump_if_even_rows
from rl_engine.validation.operators import CASES, NOT_COVERED, OpCase

__all__ = ["Cell", "CHECKS", "run_ws1", "trials_for", "check_cell", "NEGATIVE_CONTROLS"]

CHECKS = ("forward_accuracy", "gradient_accuracy", "forward_invariance", "gradient_invariance")
_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Cell:
    op: str
    impl: str
    dtype: str
    check: str
    status: str  # green | red | n.a.
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def trials_for(rows: int, n: int, seed: int) -> list[list[int]]:
    """Re-batchings of ``rows`` rows: singletons, reversed, every other row, a repeated row, the
    first half, then random subsets (odd and even row counts both occur)."""
    rng = random.Random(seed)
    base = [[0], [rows - 1], list(range(rows))[::-1], list(range(0, rows, 2)), [1, 1], list(range(rows // 2))]
    while len(base) < n:
        k = rng.randint(1, rows)
        base.append(rng.sample(range(rows), k))
    return base[:n]


def _tuple(x) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _upstream(outs, seed):
    g = torch.Generator().manual_seed(seed + 7)
    return [torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.dtype) for o in outs]


def _accuracy(case: OpCase, fn: Callable, op: str, dtype: torch.dtype, row_args, shared, seed: int) -> dict[str, tuple[str, str]]:
    """Forward and gradient accuracy against float64; returns ``{check: (status, detail)}``."""
    res: dict[str, tuple[str, str]] = {}
    dname = contracts.dtype_name(dtype)
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in row_args]
    sh = [s.detach().clone().requires_grad_(True) if isinstance(s, torch.Tensor) and s.is_floating_point() else s for s in shared]
    outs = _tuple(case.call(fn, *args, *sh))
    r_args = [a.detach().double().requires_grad_(True) if a.is_floating_point() else a for a in row_args]
    r_sh = [s.detach().double().requires_grad_(True) if isinstance(s, torch.Tensor) and s.is_floating_point() else s for s in shared]
    refs = _tuple(case.reference_f64(*r_args, *r_sh))
    tol = contracts.tolerance(op, dtype, "forward")
    worst = max(tol.max_violation(o, r) for o, r in zip(outs, refs))
    res["forward_accuracy"] = ("green" if worst <= 0 else "red",
                               f"max excess over atol={tol.atol:g}+rtol={tol.rtol:g}·|ref|: {worst:.3e} ({dname})")
    leaves = [a for a in args if a.requires_grad] + [s for s in sh if isinstance(s, torch.Tensor) and s.requires_grad]
    r_leaves = [a for a in r_args if isinstance(a, torch.Tensor) and a.requires_grad] + \
               [s for s in r_sh if isinstance(s, torch.Tensor) and s.requires_grad]
    diff = [(o, r) for o, r in zip(outs, refs) if o.requires_grad]
    if not diff or not leaves:
        res["gradient_accuracy"] = ("n.a.", "no differentiable output or input")
        return res
    up = _upstream([o for o, _ in diff], seed)
    gs = torch.autograd.grad([o for o, _ in diff], leaves, up, allow_unused=True)
    rgs = torch.autograd.grad([r for _, r in diff], r_leaves, [u.double() for u in up], allow_unused=True)
    btol = contracts.tolerance(op, dtype, "backward")
    worst_b = max(btol.max_violation(g if g is not None else torch.zeros_like(l), rg if rg is not None else torch.zeros_like(rl))
                  for g, rg, l, rl in zip(gs, rgs, leaves, r_leaves))
    res["gradient_accuracy"] = ("green" if worst_b <= 0 else "red",
                                f"{len(leaves)} gradient(s); max excess over atol={btol.atol:g}+rtol={btol.rtol:g}·|ref|: {worst_b:.3e}")
    return res


def check_cell(case: OpCase, fn: Callable, op: str, dtype: torch.dtype, rows: int, n_trials: int, seed: int) -> dict[str, tuple[str, str]]:
    """Run the four checks of one cell; ``{check: (status, detail)}``."""
    row_args, shared = case.make_inputs(dtype, rows, seed)
    out = _accuracy(case, fn, op, dtype, row_args, shared, seed)
    trials = trials_for(rows, n_trials, seed)
    call = lambda *a: case.call(fn, *a)  # noqa: E731
    fwd = check_row_invariance(call, row_args, trials, shared, grads=False, seed=seed)
    out["forward_invariance"] = ("green" if fwd.ok else "red", f"raw bits, {fwd}")
    if case.grad_rows:
        bwd = check_row_invariance(call, row_args, trials, shared, grads=True, seed=seed)
        out["gradient_invariance"] = ("green" if bwd.ok else "red", f"raw bits of row gradients, {bwd}")
    else:
        out["gradient_invariance"] = ("n.a.", "no gradient w.r.t. the row arguments (integer ids); the table gradient is shared")
    return out


# --- negative controls -------------------------------------------------------------------------
def _linear_impl() -> Callable:
    from rl_engine.ops.gemm import linear

    return lambda x, w, b=None: linear(x, w, b)


NEGATIVE_CONTROLS: dict[str, tuple[str, Callable[[Callable], Callable]]] = {
    # name: (check that must turn red, wrapper of the gemm.linear implementation)
    "row-count-dependent forward": ("forward_invariance", lambda f: (lambda x, w, b: bump_if_even_rows(f(x, w, b), x.shape[0]))),
    "row-count-dependent backward": ("gradient_invariance", lambda f: (lambda x, w, b: f(RowCountGrad.apply(x), w, b))),
    "inaccurate forward (×(1+2⁻⁶))": ("forward_accuracy", lambda f: (lambda x, w, b: f(x, w, b) * (1 + 2 ** -6))),
}


def _expert_load_dependent(act, w_down, weights, ids):
    """``moe.expert_down_combine`` whose rows move by one ulp when one of their experts received
    more than 2 slots of the call: a grouped GEMM whose tiling follows each expert's load."""
    from rl_engine.ops.moe import expert_down_combine

    out = expert_down_combine(act, w_down, weights, ids)
    busy = (torch.bincount(ids.reshape(-1), minlength=w_down.shape[0]) > 2)[ids].any(-1)
    return torch.where(busy[:, None], torch.nextafter(out, torch.full_like(out, float("inf"))), out)


def run_negative_controls(rows: int, n_trials: int, seed: int) -> list[dict[str, Any]]:
    case = CASES["gemm.linear"]
    out = []
    for name, (check, wrap) in NEGATIVE_CONTROLS.items():
        res = check_cell(case, wrap(_linear_impl()), "gemm.linear", torch.float32, rows, n_trials, seed)
        status, detail = res[check]
        out.append({"name": name, "op": "gemm.linear", "check": check, "detected": status == "red", "detail": detail})
    # the MoE-specific failure: a token's bits that follow how many tokens its experts received
    op = "moe.expert_down_combine"
    status, detail = check_cell(CASES[op], _expert_load_dependent, op, torch.float32, rows, n_trials, seed)["forward_invariance"]
    out.append({"name": "expert-load-dependent forward", "op": op, "check": "forward_invariance",
                "detected": status == "red", "detail": detail})
    return out


def run_ws1(lw: LoadedWorkload, *, device: str = "cpu", progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the operator suite of workload ``lw``; returns the JSON-ready result."""
    from rl_engine.platforms import platform_of
    from rl_engine.utils.checks import nan_policy

    w = lw.workload
    plat = platform_of(torch.empty(0, device=device))
    cells: list[Cell] = []
    ops = sorted(contracts.all_contracts())
    for k, op in enumerate(ops):
        if progress:
            progress(f"ws1 {op}", k, len(ops))
        contract = contracts.load_contract(op)
        case = CASES.get(op)
        impls = implementations(op)
        if case is None or not impls:
            reason = NOT_COVERED.get(op, "no input generator") if case is None else "no registered implementation"
            cells.append(Cell(op, "-", "-", "all", "n.a.", reason))
            continue
        for impl in impls:
            for dname in w.operators.dtypes:
                dt = _DT[dname]
                if dname not in contract.dtypes:
                    cells.append(Cell(op, impl.impl_id, dname, "all", "n.a.", f"dtype not in the contract {list(contract.dtypes)}"))
                    continue
                req = Request(op, plat, dt, contract.guarantees_on(plat.family), {})
                reasons = list(impl.unavailable_reasons())
                if plat.family not in impl.families:
                    reasons.append(f"platform family {plat.family!r} not in {list(impl.families)}")
                if dt not in impl.dtypes:
                    reasons.append(f"dtype {dname} not supported")
                missing = req.requires - impl.guarantees
                if missing:
                    reasons.append(f"does not guarantee {sorted(missing)}")
                if reasons:
                    cells.append(Cell(op, impl.impl_id, dname, "all", "n.a.", "not eligible here: " + "; ".join(reasons)))
                    continue
                try:
                    with nan_policy("propagate"):
                        res = check_cell(case, impl.fn, op, dt, w.operators.rows, w.operators.trials, w.seed)
                except Exception as exc:  # a crash is a red cell with the error, never a skip
                    res = {c: ("red", f"{type(exc).__name__}: {exc}") for c in CHECKS}
                for c in CHECKS:
                    cells.append(Cell(op, impl.impl_id, dname, c, *res[c]))
    if progress:
        progress("ws1 negative controls", len(ops), len(ops))
    controls = run_negative_controls(w.operators.rows, w.operators.trials, w.seed)
    counts = {s: sum(c.status == s for c in cells) for s in ("green", "red", "n.a.")}
    passed = counts["red"] == 0 and counts["green"] > 0 and all(c["detected"] for c in controls)
    return {
        "suite": "ws1",
        "platform": plat.as_dict(),
        "cells": [c.as_dict() for c in cells],
        "counts": counts,
        "negative_controls": controls,
        "passed": passed,
    }
