"""Numerical contracts as versioned data, and their validating loader.

Each operator has one JSON file under ``contracts/operators/`` declaring

* the **invariances** it guarantees (names from ``profiles/invariance/v1.json``), separately for
  the forward output and for the gradients;
* the **dtypes** it supports;
* its **precision profile** (``profiles/precision/<name>.json``): per dtype and quantity
  (``forward``, ``backward``) an ``atol``/``rtol`` against the float64 reference, each with a
  one-line reason, plus per-operator overrides that carry their own reason.

Invariance is judged on raw bits and has no tolerance; tolerances here apply only to accuracy.
Tests read tolerances only through :func:`tolerance`.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from rl_engine.utils.schema import StrictModel

__all__ = [
    "Tolerance",
    "OperatorContract",
    "ContractVariant",
    "PrecisionProfile",
    "InvarianceDefinition",
    "ContractError",
    "load_contract",
    "all_contracts",
    "invariance_vocabulary",
    "precision_profile",
    "tolerance",
    "dtype_name",
]

Quantity = Literal["forward", "backward"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class ContractError(ValueError):
    """A contract file is missing or invalid, or a contract lookup has no answer."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ContractError(f"dtype: {dtype} has no contract name (expected one of {sorted(_DTYPES)})")


class Tolerance(StrictModel):
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, against float64."""

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    reason: str = Field(min_length=8)

    def max_violation(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """Largest ``|a - e| - (atol + rtol |e|)`` (≤ 0 means within tolerance). NaN anywhere fails."""
        a = actual.detach().to(torch.float64)
        e = expected.detach().to(torch.float64)
        if a.shape != e.shape:
            raise ContractError(f"actual shape {tuple(a.shape)} != expected shape {tuple(e.shape)}")
        if a.numel() == 0:
            return float("-inf")
        if torch.isnan(a).any() or torch.isnan(e).any():
            return float("inf")
        excess = (a - e).abs() - (self.atol + self.rtol * e.abs())
        return float(excess.max())

    def check(self, actual: torch.Tensor, expected: torch.Tensor) -> bool:
        return self.max_violation(actual, expected) <= 0.0


class InvarianceDefinition(StrictModel):
    name: str
    description: str = Field(min_length=8)


class _InvarianceFile(StrictModel):
    schema_version: Literal[1]
    version: int
    invariances: list[InvarianceDefinition]


class _QuantityTolerances(StrictModel):
    forward: Tolerance
    backward: Tolerance


class PrecisionProfile(StrictModel):
    schema_version: Literal[1]
    name: str
    version: int
    tolerances: dict[str, _QuantityTolerances]

    @field_validator("tolerances")
    @classmethod
    def _known_dtypes(cls, v: dict[str, _QuantityTolerances]) -> dict[str, _QuantityTolerances]:
        unknown = set(v) - set(_DTYPES)
        if unknown:
            raise ValueError(f"unknown dtypes {sorted(unknown)}")
        return v


class ToleranceOverride(StrictModel):
    dtype: str
    quantity: Quantity
    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    reason: str = Field(min_length=8)


class InvarianceSet(StrictModel):
    forward: list[str]
    backward: list[str]


class ContractVariant(StrictModel):
    """A named mode of an operator that changes what it computes (not how well): e.g. the
    processed log-probs of a kept-set record, or fp32 logits from bf16 inputs. The variant keeps
    the operator's invariances; ``dtypes`` (a subset of the operator's) are the input dtypes it
    applies to, and ``equality`` states the raw-bit equality it promises."""

    summary: str = Field(min_length=8)
    dtypes: list[str]
    equality: str = Field(min_length=8)


class OperatorContract(StrictModel):
    """One operator's declared numerical contract (see module docstring)."""

    schema_version: Literal[1]
    op: str
    version: int = Field(ge=1)
    summary: str = Field(min_length=8)
    dtypes: list[str]
    invariances: InvarianceSet
    precision_profile: str
    tolerance_overrides: list[ToleranceOverride] = Field(default_factory=list)
    #: invariances required of the implementations of one platform family only (forward and
    #: backward), e.g. ``{"cpu": ["threads", "isa"]}``: host thread counts and instruction sets
    #: are CPU notions
    platform_invariances: dict[Literal["cpu", "cuda", "rocm"], list[str]] = Field(default_factory=dict)
    #: named variants (``ContractVariant``); a request names the variants it uses and only
    #: implementations that declare them are eligible
    variants: dict[str, ContractVariant] = Field(default_factory=dict)
    notes: dict[str, str] = Field(default_factory=dict)

    @field_validator("dtypes")
    @classmethod
    def _dtypes(cls, v: list[str]) -> list[str]:
        bad = [d for d in v if d not in _DTYPES]
        if bad or not v:
            raise ValueError(f"dtypes must be a non-empty subset of {sorted(_DTYPES)}, got {v}")
        return v

    @model_validator(mode="after")
    def _check_names(self) -> "OperatorContract":
        vocab = {d.name for d in invariance_vocabulary()}
        for side in ("forward", "backward"):
            bad = [n for n in getattr(self.invariances, side) if n not in vocab]
            if bad:
                raise ValueError(f"{side} invariances {bad} are not in the vocabulary {sorted(vocab)}")
        for family, names in self.platform_invariances.items():
            bad = [n for n in names if n not in vocab]
            if bad:
                raise ValueError(f"platform_invariances[{family!r}] {bad} are not in the vocabulary {sorted(vocab)}")
        for o in self.tolerance_overrides:
            if o.dtype not in self.dtypes:
                raise ValueError(f"override for dtype {o.dtype!r} which the contract does not support")
        for name, v in self.variants.items():
            bad = [d for d in v.dtypes if d not in self.dtypes]
            if bad or not v.dtypes:
                raise ValueError(f"variant {name!r}: dtypes must be a non-empty subset of the contract's {self.dtypes}, got {v.dtypes}")
        return self

    @property
    def guarantees(self) -> frozenset[str]:
        """Forward invariances (the set an implementation must cover under the strict policy)."""
        return frozenset(self.invariances.forward)

    def guarantees_on(self, family: str) -> frozenset[str]:
        """What an implementation for platform ``family`` must cover: :attr:`guarantees` plus the
        family's :attr:`platform_invariances`."""
        return self.guarantees | frozenset(self.platform_invariances.get(family, ()))

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype_name(dtype) in self.dtypes

    def tolerance(self, dtype: torch.dtype, quantity: Quantity = "forward") -> Tolerance:
        name = dtype_name(dtype)
        if name not in self.dtypes:
            raise ContractError(f"{self.op}: dtype {name} is not covered by the contract ({self.dtypes})")
        for o in self.tolerance_overrides:
            if o.dtype == name and o.quantity == quantity:
                return Tolerance(atol=o.atol, rtol=o.rtol, reason=o.reason)
        profile = precision_profile(self.precision_profile)
        if name not in profile.tolerances:
            raise ContractError(f"precision profile {profile.name!r} has no entry for {name}")
        return getattr(profile.tolerances[name], quantity)


def _read_json(*parts: str) -> dict:
    ref = resources.files(__name__).joinpath(*parts)
    try:
        return json.loads(ref.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ContractError(f"contract file {'/'.join(parts)} not found") from exc
    except json.JSONDecodeError as exc:
        raise ContractError(f"contract file {'/'.join(parts)} is not valid JSON: {exc}") from exc


@functools.lru_cache(maxsize=None)
def invariance_vocabulary() -> tuple[InvarianceDefinition, ...]:
    """The named invariances (row, chunk, prefill_decode, layout, tp_size, run_to_run)."""
    return tuple(_InvarianceFile.model_validate(_read_json("profiles", "invariance", "v1.json")).invariances)


@functools.lru_cache(maxsize=None)
def precision_profile(name: str) -> PrecisionProfile:
    """Load ``profiles/precision/<name>.json``."""
    return PrecisionProfile.model_validate(_read_json("profiles", "precision", f"{name}.json"))


def _operator_files() -> dict[str, str]:
    files = {}
    for entry in resources.files(__name__).joinpath("operators").iterdir():
        if entry.name.endswith(".json"):
            files[entry.name[: -len(".json")]] = entry.name
    return files


@functools.lru_cache(maxsize=None)
def load_contract(op: str) -> OperatorContract:
    """The contract of operator ``op`` (e.g. ``"gemm.linear"``), validated."""
    files = _operator_files()
    if op not in files:
        raise ContractError(f"op: no contract for {op!r}; known: {sorted(files)}")
    contract = OperatorContract.model_validate(_read_json("operators", files[op]))
    if contract.op != op:
        raise ContractError(f"contract file {files[op]} declares op {contract.op!r}")
    return contract


def all_contracts() -> dict[str, OperatorContract]:
    """Every operator contract shipped with the package, by operator id."""
    return {op: load_contract(op) for op in sorted(_operator_files())}


def tolerance(op: str, dtype: torch.dtype, quantity: Quantity = "forward") -> Tolerance:
    """Accuracy tolerance of ``op`` for ``dtype`` against the float64 reference."""
    return load_contract(op).tolerance(dtype, quantity)
