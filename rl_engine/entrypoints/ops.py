"""``rlk ops``: every operator with a contract, its implementations and what runs here.

For each operator shipped with a contract (:func:`rl_engine.contracts.all_contracts`) it lists
the registered implementations (:func:`rl_engine.runtime.implementations`, which imports that
operator family's backends) with their declared families, dtypes and guarantees, whether they
are available in this process, and whether they are **eligible on the chosen device** for each
dtype of the contract — judged by the runtime itself on a
``Request(op, platform, dtype, requires=<contract's forward invariances>, features={})``, so
the answer is the one the strict policy would give. ``selected`` is what
:func:`rl_engine.runtime.select` picks per dtype (``null``: nothing eligible, the strict policy
would raise — or the choice depends on per-call features, see below).

Per-call checks (shapes, layout) are not exercised: ``features`` is empty. A per-call check that
needs a feature to decide is reported as a rejection reason ending in "needs per-call features"
rather than a crash, and if it comes first in priority order ``selected`` is ``null`` (no claim).

JSON (``--json``), ``schema_version`` 1::

    {"schema_version": 1, "platform": {...Platform.as_dict()...},
     "operators": [{"op": "gemm.linear",
                    "contract": {"version", "summary", "dtypes", "invariances": {"forward", "backward"},
                                 "precision_profile", "tolerance_overrides",
                                 "variants": {name: {"summary", "dtypes", "equality"}}},
                    "implementations": [{"impl_id", "version", "priority", "families", "dtypes",
                                         "guarantees", "untested_families", "variants", "available",
                                         "unavailable_reasons", "eligible": {dtype: bool},
                                         "rejections": {dtype: [reason, ...]}}],
                    "selected": {dtype: impl_id or null}}]}
"""

from __future__ import annotations

import enum
import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["SCHEMA_VERSION", "Device", "LoadError", "collect", "command", "render"]

SCHEMA_VERSION = 1


_NEEDS_FEATURES = "needs per-call features"


class Device(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


class LoadError(RuntimeError):
    """A contract or backend could not be loaded (exit code 2)."""


def _dtype_label(dtype: Any) -> str:
    from rl_engine.contracts import ContractError, dtype_name

    try:
        return dtype_name(dtype)
    except ContractError:
        return str(dtype).removeprefix("torch.")


def _reasons(impl: Any, request: Any) -> list[str]:
    try:
        return list(impl.reject_reasons(request))
    except Exception as exc:  # a per-call check that needs features it was not given
        return [f"eligibility check raised {type(exc).__name__}: {exc} ({_NEEDS_FEATURES})"]


def _select(request: Any) -> str | None:
    from rl_engine import runtime

    try:
        impl, _ = runtime.select(request)
    except Exception:  # the same per-call-check case as in _reasons: nothing selectable without features
        return None
    return impl.impl_id if impl is not None else None


def _resolve_platform(device: Device | None) -> Any:
    import torch

    from rl_engine.platforms import platform_of

    if device is None:
        device = Device.cuda if torch.cuda.is_available() else Device.cpu
    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA/ROCm device is visible in this process", param_hint="'--device'")
    return platform_of(device.value)


#: Contract ids with this prefix describe a model assembly, not an operator (listed separately).
MODEL_PREFIX = "models."


def collect(device: Device | str | None = None) -> dict[str, Any]:
    """The ``rlk ops`` report as a dict (see module docstring for the schema).

    Raises:
        typer.BadParameter: ``device`` is ``cuda`` and no GPU is visible.
        LoadError: a contract or an operator family's backend failed to load.
    """
    import torch

    from rl_engine import contracts, runtime

    platform = _resolve_platform(Device(device) if device is not None else None)
    try:
        all_contracts = contracts.all_contracts()
    except Exception as exc:
        raise LoadError(f"loading the operator contracts failed: {type(exc).__name__}: {exc}") from exc
    operators = []
    model_contracts = []
    for op, contract in all_contracts.items():
        if op.startswith(MODEL_PREFIX):
            # a model-level contract (end-to-end accuracy of an assembly), not a dispatched operator
            model_contracts.append({"id": op, "version": contract.version, "summary": contract.summary})
            continue
        try:
            impls = runtime.implementations(op)
        except Exception as exc:
            raise LoadError(f"{op}: loading its backends failed: {type(exc).__name__}: {exc}") from exc
        requests = {
            name: runtime.Request(
                op=op,
                platform=platform,
                dtype=getattr(torch, name),
                requires=contract.guarantees_on(platform.family),
                features={},
            )
            for name in contract.dtypes
        }
        rows = []
        for impl in impls:
            rejections = {name: _reasons(impl, req) for name, req in requests.items()}
            unavailable = impl.unavailable_reasons()
            rows.append(
                {
                    "impl_id": impl.impl_id,
                    "version": impl.version,
                    "priority": impl.priority,
                    "families": list(impl.families),
                    "dtypes": [_dtype_label(d) for d in impl.dtypes],
                    "guarantees": sorted(impl.guarantees),
                    "untested_families": list(impl.untested_families),
                    "variants": sorted(impl.variants),
                    "available": not unavailable,
                    "unavailable_reasons": unavailable,
                    "eligible": {name: not reasons for name, reasons in rejections.items()},
                    "rejections": rejections,
                }
            )
        operators.append(
            {
                "op": op,
                "contract": {
                    "version": contract.version,
                    "summary": contract.summary,
                    "dtypes": list(contract.dtypes),
                    "invariances": {
                        "forward": list(contract.invariances.forward),
                        "backward": list(contract.invariances.backward),
                    },
                    "precision_profile": contract.precision_profile,
                    "tolerance_overrides": [o.model_dump() for o in contract.tolerance_overrides],
                    "variants": {name: v.model_dump() for name, v in contract.variants.items()},
                },
                "implementations": rows,
                "selected": {name: _select(req) for name, req in requests.items()},
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "platform": platform.as_dict(),
        "operators": operators,
        "model_contracts": model_contracts,
    }


def _why_none(entry: dict[str, Any], dtype: str) -> str:
    undecided = any(_NEEDS_FEATURES in r for i in entry["implementations"] for r in i["rejections"][dtype])
    return "undetermined without per-call features" if undecided else "none (strict policy raises)"


def render(report: dict[str, Any], console: Console) -> None:
    """Print the report: per operator its contract, a table of implementations, the selection
    per dtype and every rejection reason."""
    plat = report["platform"]
    console.print(f"platform {plat['family']}:{plat['arch']} ({plat['device_name']})", markup=False)
    if not report["operators"]:
        console.print("no operator contracts are shipped")
    for entry in report["operators"]:
        c = entry["contract"]
        dtypes = c["dtypes"]
        console.print()
        console.print(f"[bold]{escape(entry['op'])}[/bold]  {escape(c['summary'])}")
        console.print(
            f"  contract v{c['version']}; dtypes {', '.join(dtypes)}; "
            f"forward invariances: {', '.join(c['invariances']['forward']) or '-'}; "
            f"backward invariances: {', '.join(c['invariances']['backward']) or '-'}; "
            f"precision profile {c['precision_profile']}",
            markup=False,
        )
        table = Table(show_lines=False)
        for col in ("implementation", "families", "dtypes", "guarantees", "available", "eligible here"):
            table.add_column(col, overflow="fold")
        for row in entry["implementations"]:
            eligible = "\n".join(
                f"{n}: " + ("[green]yes[/green]" if row["eligible"][n] else "[red]no[/red]") for n in dtypes
            )
            table.add_row(
                escape(f"{row['impl_id']} v{row['version']}"),
                ", ".join(row["families"]),
                ", ".join(row["dtypes"]),
                ", ".join(row["guarantees"]),
                "yes" if row["available"] else "no",
                eligible,
            )
        if not entry["implementations"]:
            table.add_row("(none registered)", "", "", "", "", "")
        console.print(table)
        selected = ", ".join(f"{n} -> {entry['selected'][n] or _why_none(entry, n)}" for n in dtypes)
        console.print(f"  selected: {selected}", markup=False)
        for row in entry["implementations"]:
            for name, reasons in row["rejections"].items():
                if reasons:
                    console.print(f"  {row['impl_id']} rejected for {name}: " + "; ".join(reasons), markup=False)


def command(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    device: Device = typer.Option(
        None, "--device", help="Judge eligibility for this device (default: cuda if visible, else cpu).",
        case_sensitive=False, show_default=False,
    ),
) -> None:
    """List every operator with a contract, its implementations and their eligibility here."""
    try:
        report = collect(device)
    except LoadError as exc:
        from rl_engine.entrypoints.errors import CommandError

        raise CommandError(f"rlk ops: {exc}") from exc
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        render(report, Console())
