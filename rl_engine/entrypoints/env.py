"""``rlk env``: the environment report users paste into issues.

Prints :func:`rl_engine.platforms.describe_environment` — rl_engine/python/OS versions, the
default platform (family, arch, torch/triton/CUDA/HIP versions) and every visible device — as a
rich table, or as JSON with ``--json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

__all__ = ["command", "render"]

_PLATFORM_FIELDS = ("family", "arch", "device_name", "torch_version", "triton_version", "cuda_version", "hip_version")


def _text(v: Any) -> str:
    return "-" if v is None else str(v)


def render(report: dict[str, Any], console: Console) -> None:
    """Print ``report`` (the dict of ``describe_environment``) as two rich tables."""
    summary = Table(title="rl-kernel environment", show_header=False)
    summary.add_column("key", style="bold")
    summary.add_column("value", overflow="fold")
    for key in ("rl_engine", "python", "os", "torch_num_threads"):
        summary.add_row(key, _text(report.get(key)))
    default = report.get("default_platform", {})
    for key in _PLATFORM_FIELDS:
        summary.add_row(f"default_platform.{key}", _text(default.get(key)))
    console.print(summary)

    devices = Table(title="devices")
    for header in ("platform", "device", "torch", "triton", "cuda", "hip"):
        devices.add_column(header, overflow="fold")
    for dev in report.get("devices", []):
        devices.add_row(
            f"{dev.get('family')}:{dev.get('arch')}",
            *(_text(dev.get(k)) for k in ("device_name", "torch_version", "triton_version", "cuda_version", "hip_version")),
        )
    console.print(devices)


def command(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
) -> None:
    """Describe the platform: family/arch, torch/triton/CUDA/HIP versions, devices."""
    from rl_engine.platforms import describe_environment

    try:
        report = describe_environment()
    except Exception as exc:  # a broken driver or install: a load error, not a crash
        from rl_engine.entrypoints.errors import CommandError

        raise CommandError(f"rlk env: could not describe the environment: {type(exc).__name__}: {exc}") from exc
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
    else:
        render(report, Console())
