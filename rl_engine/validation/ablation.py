"""Plans and ablation: attribute train↔rollout drift to modules.

A :class:`~rl_engine.runtime.plan.Plan` puts every module × side on ``P`` (native torch) or
``R`` (rl-kernel). The ablation runs a few chain cells (:data:`ABLATION_CELLS`) under

* ``R/R`` and ``P/P`` (both sides ours / both native),
* ``R/R − m``: module ``m`` switched to native on both sides, every other module on ``R``,
* ``P/P + m``: module ``m`` on rl-kernel on both sides, every other module native,

one module at a time, and attributes drift:

* if ``R/R`` is bitwise equal, the modules whose ``R/R − m`` run mismatches are the ones whose
  native implementation drifts (``R`` of every other module is invariant, so the mismatch can
  only come from ``m``);
* if ``R/R`` mismatches (an rl-kernel module is not invariant — the negative control injects
  exactly this), the modules whose ``R/R − m`` run is bitwise equal are the culprits.

The suite's negative control injects a batch-dependent variant of ``control_module`` into the
R provider (:mod:`rl_engine.validation.faults`) and requires the attribution to name it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl_engine.workloads import LoadedWorkload
from rl_engine.runtime.plan import MODULES, Plan
from rl_engine.validation.chain import build_model, cells_for, run_cell
from rl_engine.validation.faults import ProviderFactory, default_factory, faulty_factory

__all__ = ["ABLATION_CELLS", "ablation_plans", "attribute", "run_ablation_plans", "run_ablation"]

ABLATION_CELLS: tuple[str, ...] = ("packed", "decode/BN-padded")


def ablation_plans() -> dict[str, Plan]:
    rr, pp = Plan.parse("R/R"), Plan.parse("P/P")
    plans = {"R/R": rr, "P/P": pp}
    for m in MODULES:
        plans[f"R/R-{m}"] = rr.with_module(m, train="P", rollout="P")
        plans[f"P/P+{m}"] = pp.with_module(m, train="R", rollout="R")
    return plans


def attribute(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Attribution rule of the module docstring on ``{plan name: {"passed": bool, ...}}``."""
    rr_ok = runs["R/R"]["passed"]
    if rr_ok:
        culprits = [m for m in MODULES if not runs[f"R/R-{m}"]["passed"]]
        basis = "R/R is bitwise equal; modules whose native implementation breaks it"
    else:
        culprits = [m for m in MODULES if runs[f"R/R-{m}"]["passed"]]
        basis = "R/R mismatches; rl-kernel modules whose removal restores bitwise equality"
    return {"modules": culprits, "basis": basis, "determined": bool(culprits) or rr_ok}


def run_ablation_plans(model, lw: LoadedWorkload, factory: ProviderFactory = default_factory,
                       cells: Sequence[str] = ABLATION_CELLS,
                       progress: Callable[[str, int, int], None] | None = None, label: str = "") -> dict[str, Any]:
    w = lw.workload
    chosen = [c for c in cells_for(w) if c.name in cells]
    runs = {}
    plans = ablation_plans()
    for k, (name, plan) in enumerate(plans.items()):
        if progress:
            progress(f"ablation {label}{name}", k, len(plans))
        with torch.no_grad():
            res = [run_cell(model, plan, w, c, factory) for c in chosen]
        runs[name] = {
            "plan": plan.as_dict(),
            "compared_tokens": sum(r["compared_tokens"] for r in res),
            "mismatched_tokens": sum(r["mismatched_tokens"] for r in res),
            "max_abs_diff": max(r["max_abs_diff"] for r in res),
            "passed": all(r["passed"] for r in res),
        }
    return {"runs": runs, "attribution": attribute(runs)}


def run_ablation(lw: LoadedWorkload, *, device: str = "cpu", factory: ProviderFactory = default_factory,
                 control_module: str = "norm", progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Ablation of the workload, plus the injected negative control (must name ``control_module``)."""
    from rl_engine.utils.checks import nan_policy

    model = build_model(lw.workload, device=device)
    with nan_policy("propagate"):
        main = run_ablation_plans(model, lw, factory, progress=progress)
        control = run_ablation_plans(model, lw, faulty_factory(control_module), progress=progress, label="control ")
    detected = control["attribution"]["modules"] == [control_module]
    return {
        "suite": "ablation",
        "cells": list(ABLATION_CELLS),
        "modules": list(MODULES),
        **main,
        "negative_controls": [{"name": f"batch-dependent R {control_module}", "expected": [control_module],
                               "attributed": control["attribution"]["modules"], "detected": detected,
                               "runs": {k: v["passed"] for k, v in control["runs"].items()}}],
        "passed": main["runs"]["R/R"]["passed"] and detected,
    }
