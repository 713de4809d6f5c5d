"""``rlk report RUN_DIR``: verify a run directory's seals and render its summary and plots.

The run directory is append-only: the rendering goes to a new ``RUN_DIR/rendered-<n>/``
(``summary.md`` and ``plots/*.png``); the Markdown summary is printed (``--json``: the paths).

Exit codes: ``0`` rendered; ``1`` a seal does not match (a file or field changed after the run,
an empty or partial manifest, a path outside the run directory); ``2`` not a run directory, an
interrupted run (no COMPLETE marker), a malformed COMPLETE or report.json, or a rendering that
cannot be written. With ``--json`` an error is also ``{"error": ..., "exit_code": ...}`` on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

__all__ = ["command"]


def command(
    run_dir: Path = typer.Argument(..., help="A run directory written by rlk validate/debug --out."),
    as_json: bool = typer.Option(False, "--json", help="Print the rendered paths and the verdict as JSON."),
) -> None:
    """Verify and render a validation run. Exit: 0 ok, 1 seal mismatch, 2 not a complete run directory."""
    from rl_engine.entrypoints.errors import CommandError
    from rl_engine.validation.reports import ReportError, SealError, render, verify_run

    try:
        report = verify_run(run_dir)
    except SealError as exc:
        raise CommandError(f"rlk report: {exc}", 1) from exc
    except ReportError as exc:
        raise CommandError(f"rlk report: {exc}") from exc
    except OSError as exc:
        raise CommandError(f"rlk report: cannot read {str(run_dir)!r}: {exc}") from exc
    try:
        dest = render(run_dir, verify=False)
    except OSError as exc:
        raise CommandError(f"rlk report: cannot write the rendering into {str(run_dir)!r}: {exc}") from exc
    plots = sorted(str(p) for p in (dest / "plots").glob("*.png")) if (dest / "plots").is_dir() else []
    if as_json:
        sys.stdout.write(json.dumps({"run_dir": str(run_dir), "suite": report["suite"], "passed": report["passed"],
                                     "rendered": str(dest), "summary": str(dest / "summary.md"), "plots": plots},
                                    indent=2) + "\n")
    else:
        sys.stdout.write((dest / "summary.md").read_text() + "\n")
        print(f"rendered: {dest}")
