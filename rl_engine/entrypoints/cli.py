"""The ``rlk`` command line: a typer app with one module per command.

Adding a command: write ``rl_engine/entrypoints/<name>.py`` exposing a plain function
``command(...)`` whose typer-annotated parameters are the options, then add **one line** to the
registration block below, e.g. ``app.command("check")(check.command)``, and update the frozen CLI
surface in ``tests/entrypoints/test_cli.py``.

Exit codes (every command): ``0`` success, ``2`` usage error (unknown command or option, bad
value) or load error (a contract or backend that cannot be loaded); a command may define other
non-zero codes for "ran, and the result is a failure" and documents them in its help. With
``--json``, an error also prints ``{"error": ..., "exit_code": ...}`` on stdout
(:class:`~rl_engine.entrypoints.errors.JsonErrorGroup`).
"""

from __future__ import annotations

import sys

import typer

from rl_engine.entrypoints import check, debug, env, ops, report, validate
from rl_engine.entrypoints.errors import JsonErrorGroup

#: Exit code of a usage or load error (the same code click uses for usage errors).
EXIT_USAGE = 2

app = typer.Typer(
    name="rlk",
    cls=JsonErrorGroup,
    help="rl-kernel: operators whose numerics are written, tested contracts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """rl-kernel: operators whose numerics are written, tested contracts."""


# ---- command registration: one line per command -------------------------------------------
app.command("env")(env.command)
app.command("ops")(ops.command)
app.command("check")(check.command)
app.command("validate")(validate.command)
app.command("debug")(debug.command)
app.command("report")(report.command)
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``rlk``): runs the app and returns its exit code."""
    try:
        app(args=argv, prog_name="rlk", standalone_mode=True)
    except SystemExit as exc:  # click always ends with SystemExit in standalone mode
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
