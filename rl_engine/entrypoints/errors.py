"""Errors of the ``rlk`` commands, the ``--json`` error object, and checks of shared options.

* :class:`CommandError` — a command's clear, one-line error with its exit code (``2`` by default:
  a usage or load error), printed on stderr without usage block or traceback.
* :class:`JsonErrorGroup` — the app's click group: when the command line carries ``--json``,
  every error (a usage error found by click, a :class:`CommandError`, a ``typer.Exit`` with a
  non-zero code that printed nothing on stdout, an unexpected exception) also prints one JSON
  object on stdout, ``{"error": <message>, "exit_code": <code>}``, so a caller that parses stdout
  always gets JSON.
* :func:`check_device` / :data:`SEED_MAX` — the ``--device`` and ``--seed`` rules every command
  shares.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import typer
from typer.core import TyperGroup

__all__ = ["CommandError", "JsonErrorGroup", "check_device", "SEED_MAX", "EXIT_USAGE"]

EXIT_USAGE = 2
#: Largest ``--seed``: every generator the commands seed (torch, Python) takes a non-negative int64.
SEED_MAX = 2**63 - 1


class CommandError(Exception):
    """A command failed on its input (a bad device, a model that cannot be loaded, ...).

    :class:`JsonErrorGroup` prints ``message`` as is, one line on stderr (``rlk <command>: <what>
    ...``, no usage block, no traceback), and exits with ``exit_code`` (default 2).
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def _print_json_error(message: str, code: int) -> None:
    sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
    sys.stdout.flush()


class _CountingStdout(io.TextIOBase):
    """Pass-through of stdout that remembers whether anything was written."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.wrote = False

    def write(self, s: str) -> int:
        if s:
            self.wrote = True
        return self.inner.write(s)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")


def _is_exit(exc: BaseException) -> bool:
    """``typer.Exit`` or click's ``Exit`` (typer vendors its own click)."""
    return type(exc).__name__ == "Exit" and isinstance(getattr(exc, "exit_code", None), int)


class JsonErrorGroup(TyperGroup):
    """The ``rlk`` group: a :class:`CommandError` becomes one line on stderr and its exit code;
    with ``--json`` on the command line every error is also a JSON object on stdout."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        as_json = "--json" in (args[: args.index("--")] if "--" in args else args)
        try:
            ctx = super().make_context(info_name, args, parent=parent, **extra)
        except typer.TyperException as exc:  # click's usage errors (typer's vendored click)
            if as_json:
                _print_json_error(exc.format_message(), exc.exit_code)  # type: ignore[attr-defined]
            raise
        ctx.meta["rlk_json"] = as_json
        return ctx

    def invoke(self, ctx: Any) -> Any:
        as_json = bool(ctx.meta.get("rlk_json"))
        previous = sys.stdout
        out = _CountingStdout(previous) if as_json else None
        if out is not None:
            sys.stdout = out
        try:
            return super().invoke(ctx)
        except CommandError as exc:
            sys.stdout = previous
            print(exc.message, file=sys.stderr)
            if as_json:
                _print_json_error(exc.message, exc.exit_code)
            raise typer.Exit(exc.exit_code) from None
        except typer.TyperException as exc:  # usage errors: click prints them on stderr
            sys.stdout = previous
            if as_json:
                _print_json_error(exc.format_message(), exc.exit_code)  # type: ignore[attr-defined]
            raise
        except Exception as exc:
            sys.stdout = previous
            if _is_exit(exc):
                code = exc.exit_code  # type: ignore[attr-defined]
                if as_json and code and out is not None and not out.wrote:
                    _print_json_error(f"exit code {code} (see stderr)", code)
            elif as_json:  # a bug: the traceback still goes to stderr
                _print_json_error(f"internal error: {type(exc).__name__}: {exc}", 1)
            raise
        except KeyboardInterrupt:
            sys.stdout = previous
            if as_json:
                _print_json_error("interrupted", 130)
            raise
        finally:
            if sys.stdout is out:
                sys.stdout = previous


def check_device(device: str, label: str) -> str:
    """``--device``: ``cpu`` or ``cuda[:N]`` with that GPU visible; returns the normalised name.

    Raises:
        CommandError: any other device type (``meta``, ``mps``, ...), a malformed name, or a GPU
            that is not visible — one line, exit 2.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CommandError(f"rlk {label}: --device {device!r} is not a device name ({first}); expected cpu or cuda[:N]") from exc
    if dev.type == "cpu":
        return "cpu" if dev.index is None else str(dev)
    if dev.type != "cuda":
        raise CommandError(f"rlk {label}: --device {device!r}: rlk runs on cpu or cuda[:N] (CUDA or ROCm GPUs), "
                           f"not on {dev.type!r}")
    if not torch.cuda.is_available():
        raise CommandError(f"rlk {label}: --device {device!r}: no CUDA/ROCm device is visible in this process")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CommandError(f"rlk {label}: --device {device!r}: this process sees {torch.cuda.device_count()} GPU(s)")
    return str(dev)

