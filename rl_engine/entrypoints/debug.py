"""``rlk debug``: the first stage where two sides diverge for one sample.

Side A is the train path of ``--plan-a``, side B the rollout path of ``--plan-b`` (default: the
same plan), on the frozen tokens of the workload (see :mod:`rl_engine.validation.debugger`).
Reports the first divergence: layer, stage, token position, feature index and both values.

Exit codes: ``0`` every captured stage raw-bit equal; ``1`` diverged; ``2`` not comparable
(unknown sample, a stage captured on one side only) or a usage/load error.
"""

from __future__ import annotations

import typer

from rl_engine.entrypoints.validate import execute

__all__ = ["command"]


def command(
    workload: str = typer.Option("ws1-tiny", "--workload", help="Shipped workload name[@version] or a workload JSON file."),
    sample: int = typer.Option(0, "--sample", min=0, help="Sample id of the workload to compare."),
    plan_a: str = typer.Option("R/R", "--plan-a", help="Plan of side A (its train side runs)."),
    plan_b: str | None = typer.Option(None, "--plan-b", help="Plan of side B (its rollout side runs); default: --plan-a."),
    inject: str | None = typer.Option(None, "--inject", help="Negative control: make this module of the R provider batch-dependent."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda:0."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    out: str | None = typer.Option(None, "--out", help="Write a run directory under DIR (with the per-layer plot)."),
) -> None:
    """Compare per-layer, per-stage values of two sides. Exit: 0 equal, 1 diverged, 2 not comparable."""
    from rl_engine.runtime import current_policy
    from rl_engine.runtime import provenance as prov
    from rl_engine.runtime.plan import MODULES, Plan, PlanError
    from rl_engine.validation.debugger import EXIT_CODES, run_debug
    from rl_engine.validation.faults import default_factory, faulty_factory

    for hint, value in (("--plan-a", plan_a), ("--plan-b", plan_b)):
        if value is not None:
            try:
                Plan.parse(value)
            except PlanError as exc:
                raise typer.BadParameter(str(exc), param_hint=hint) from exc
    if inject is not None and inject not in MODULES:
        raise typer.BadParameter(f"expected one of {list(MODULES)}, got {inject!r}", param_hint="--inject")

    def runner(lw, progress):
        progress("rlk debug: capture both sides", 0, 1)
        with prov.record() as records:
            res = run_debug(lw, sample=sample, plan_a=plan_a, plan_b=plan_b,
                            factory=faulty_factory(inject) if inject else default_factory, device=device)
        res["exit_code"] = EXIT_CODES[res["outcome"]]
        summary = prov.summarize(records)
        return res, {"policy": current_policy(), "fallback": any(r["fallback"] for r in summary), "operators": summary,
                     "injected_fault": inject}

    options = {"sample": sample, "plan_a": plan_a, "plan_b": plan_b, "inject": inject, "device": device}
    execute("debug", workload=workload, device=device, as_json=as_json, out=out, options=options, runner=runner, label="debug")
