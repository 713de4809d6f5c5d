"""``rlk validate SUITE``: WS1 operator suite, model chain, cross-config scoring, ablation.

WS1 and WS2 name validation scopes: **WS1** is single-device (every operator and the model on
one device and one process), **WS2** is distributed (the same bits across tensor- and
data-parallel layouts). ``SUITE`` is ``ws1`` (every operator × eligible implementation × dtype: accuracy and raw-bit
invariance, forward and gradient), ``chain`` (the Qwen3 model over layout and decode cells,
train↔rollout raw bits, gradient invariance across layouts), ``cross-config`` (one knob at a
time from a baseline on frozen inputs), ``ablation`` (per-module P/R plans; attributes
drift to modules) or ``ws2`` (the model trained at every ``--tp`` × ``--dp`` layout on gloo
ranks it spawns: log-probs, every layer's stages with the first divergence, and gradients
against one process; docs/distributed.md). Each suite runs its negative controls. ``--workload`` names a shipped
workload (``ws1-tiny``, ``ws1-tiny@1``) or a workload JSON file; ``--out DIR`` writes a run
directory (report.json, summary.md, plots, COMPLETE); ``--inject MODULE`` makes that module of
the rl-kernel provider batch-dependent (a negative control you can watch fail).

Exit codes: ``0`` the suite passed; ``1`` a red cell, a mismatch, an unexpected status or an
undetected negative control; ``2`` usage error, a workload that cannot be loaded, a ``--device``
other than cpu or a visible cuda[:N], or an ``--out`` that is not a writable directory (checked
before the suite runs). With ``--json`` an error is also ``{"error": ..., "exit_code": ...}``
on stdout.
"""

from __future__ import annotations

import enum
import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["command", "Suite", "run_suite", "EXIT_FAIL", "EXIT_USAGE"]

EXIT_FAIL = 1
EXIT_USAGE = 2


class Suite(str, enum.Enum):
    ws1 = "ws1"
    chain = "chain"
    cross_config = "cross-config"
    ablation = "ablation"
    ws2 = "ws2"


#: The workload each suite runs when ``--workload`` is not given.
DEFAULT_WORKLOAD = {"ws2": "ws2-tiny"}


def run_suite(suite: str, lw, *, device: str = "cpu", plan: str = "R/R", inject: str | None = None,
              progress=None, rollout_threads: int | None = None,
              train_threads: int | None = None, tp: tuple[int, ...] = (1, 2, 4),
              dp: tuple[int, ...] = (1, 2)) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one suite; returns ``(result, provenance)``."""
    import torch

    from rl_engine.runtime import current_policy
    from rl_engine.runtime import provenance as prov
    from rl_engine.validation.faults import default_factory, faulty_factory

    factory = faulty_factory(inject) if inject else default_factory
    with prov.record() as records:
        if suite == "ws1":
            from rl_engine.validation.ws1 import run_ws1

            result = run_ws1(lw, device=device, progress=progress)
        elif suite == "chain":
            from rl_engine.validation.chain import run_chain

            result = run_chain(lw, plan=plan, device=device, factory=factory, progress=progress,
                               rollout_threads=rollout_threads, train_threads=train_threads)
        elif suite == "cross-config":
            from rl_engine.validation.cross_config import run_cross_config

            result = run_cross_config(lw, device=device, factory=factory, progress=progress)
        elif suite == "ablation":
            from rl_engine.validation.ablation import run_ablation

            result = run_ablation(lw, device=device, factory=factory, progress=progress)
        elif suite == "ws2":
            from rl_engine.validation.ws2 import run_ws2

            result = run_ws2(lw, tp=tp, dp=dp, device=device, progress=progress)
        else:
            raise ValueError(f"suite: expected one of {[s.value for s in Suite]}, got {suite!r}")
    summary = prov.summarize(records)
    provenance = {"policy": current_policy(), "fallback": any(r["fallback"] for r in summary), "operators": summary,
                  "injected_fault": inject, "torch_threads": torch.get_num_threads()}
    return result, provenance


def _progress_bar(err: Console):
    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=True)


def execute(suite: str, *, workload: str, device: str, as_json: bool, out: str | None, options: dict[str, Any],
            runner, label: str) -> None:
    """Shared driver of ``validate`` and ``debug``: load, run with a progress bar, report, exit."""
    import torch

    from rl_engine.workloads import WorkloadError, load_workload
    from rl_engine.entrypoints.errors import CommandError, check_device
    from rl_engine.validation.reports import ReportError, build_report, check_out_dir, write_run

    device = check_device(device, label)
    if out:  # before the suite runs: an unwritable --out must not cost a whole run
        try:
            check_out_dir(out)
        except ReportError as exc:
            raise CommandError(f"rlk {label}: {exc}") from exc
    try:
        lw = load_workload(workload)
    except WorkloadError as exc:
        raise CommandError(f"rlk {label}: {exc}") from exc
    err = Console(stderr=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny workloads: one intra-op thread is fastest and least noisy
    try:
        with _progress_bar(err) as bar:
            task = bar.add_task(f"rlk {label}", total=1)

            def progress(stage: str, done: int, total: int) -> None:
                bar.update(task, description=stage, completed=done, total=total)

            try:
                result, provenance = runner(lw, progress)
            except ValueError as exc:
                raise CommandError(f"rlk {label}: {exc}") from exc
    finally:
        torch.set_num_threads(previous)
    report = build_report(suite, result, lw.header(), options, device, provenance)
    if out:
        try:
            run = write_run(out, report)
        except OSError as exc:
            raise CommandError(f"rlk {label}: --out: cannot write the run directory under {out!r}: {exc}") from exc
        report["run_dir"] = str(run)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    else:
        from rl_engine.validation.reports import markdown

        Console(width=120).print(markdown(report, []), markup=False, highlight=False)
        if out:
            print(f"run directory: {report['run_dir']}")
    if not report["passed"]:
        raise typer.Exit(EXIT_FAIL if suite != "debug" else result.get("exit_code", 1))


def command(
    suite: Suite = typer.Argument(..., help="ws1 (WS1, the single-device scope: every operator x implementation x dtype) | chain (the model, train vs rollout) | cross-config | ablation | ws2 (WS2, the distributed scope: TP x DP layouts)"),
    workload: str | None = typer.Option(None, "--workload", help="Shipped workload name[@version] or a workload JSON file (default: ws2-tiny for ws2, ws1-tiny otherwise)."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda:0."),
    plan: str = typer.Option("R/R", "--plan", help="chain: train/rollout plan (R/R, P/P, P/R, R/P)."),
    inject: str | None = typer.Option(None, "--inject", help="Negative control (chain, cross-config, ablation): make this module of the R provider batch-dependent (attention, gemm, norm, rope, activation, embedding, logprob, moe)."),
    rollout_threads: int | None = typer.Option(None, "--rollout-threads", min=1, help="chain: torch intra-op threads of the rollout side (the bits must not depend on it)."),
    train_threads: int | None = typer.Option(None, "--train-threads", min=1, help="chain: torch intra-op threads of the train side."),
    tp: str | None = typer.Option(None, "--tp", help="ws2: tensor-parallel sizes, comma-separated powers of two (default 1,2,4)."),
    dp: str | None = typer.Option(None, "--dp", help="ws2: data-parallel sizes, comma-separated powers of two (default 1,2)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    out: str | None = typer.Option(None, "--out", help="Write a run directory (report.json, summary.md, plots, COMPLETE) under DIR."),
) -> None:
    """Run a validation suite with its negative controls. Exit codes: 0 pass, 1 fail, 2 usage or load error.

    WS1 is the single-device validation scope (operators and the model on one device); WS2 is the
    distributed scope (bits that do not depend on the tensor- or data-parallel layout)."""
    from rl_engine.runtime.plan import MODULES, Plan, PlanError

    try:
        Plan.parse(plan)
    except PlanError as exc:
        raise typer.BadParameter(str(exc), param_hint="--plan") from exc
    if inject is not None and inject not in MODULES:
        raise typer.BadParameter(f"expected one of {list(MODULES)}, got {inject!r}", param_hint="--inject")
    if inject is not None and suite is Suite.ws1:
        raise typer.BadParameter("ws1 calls each implementation directly (it has its own negative controls); "
                                 "--inject applies to chain, cross-config and ablation", param_hint="--inject")
    if (rollout_threads or train_threads) and suite is not Suite.chain:
        raise typer.BadParameter("--rollout-threads and --train-threads apply to the chain suite (a rollout and a "
                                 "train side)", param_hint="--rollout-threads")
    if (tp or dp) and suite is not Suite.ws2:
        raise typer.BadParameter("--tp and --dp apply to the ws2 suite (tensor- and data-parallel layouts)",
                                 param_hint="--tp")
    if inject is not None and suite is Suite.ws2:
        raise typer.BadParameter("ws2 runs its own negative controls (the native row-parallel and DP reductions)",
                                 param_hint="--inject")
    from rl_engine.validation.ws2 import parse_sizes

    from rl_engine.distributed.launch import MAX_LOCAL_WORLD

    try:
        tps = parse_sizes(tp if tp is not None else "1,2,4", "--tp")
        dps = parse_sizes(dp if dp is not None else "1,2", "--dp")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tp" if "--tp" in str(exc) else "--dp") from exc
    if suite is Suite.ws2 and max(tps) * max(dps) > MAX_LOCAL_WORLD:
        raise typer.BadParameter(f"the layout tp={max(tps)} x dp={max(dps)} needs {max(tps) * max(dps)} ranks; at most "
                                 f"{MAX_LOCAL_WORLD} run on one host", param_hint="--tp")
    workload = workload or DEFAULT_WORKLOAD.get(suite.value, "ws1-tiny")
    options = {"suite": suite.value, "device": device, "plan": plan, "inject": inject,
               "rollout_threads": rollout_threads, "train_threads": train_threads}
    if suite is Suite.ws2:
        options.update(tp=list(tps), dp=list(dps))
    execute(suite.value, workload=workload, device=device, as_json=as_json, out=out, options=options, label=f"validate {suite.value}",
            runner=lambda lw, progress: run_suite(suite.value, lw, device=device, plan=plan, inject=inject, progress=progress,
                                                  rollout_threads=rollout_threads, train_threads=train_threads,
                                                  tp=tps, dp=dps))
