"""Plans: which implementation each side uses for each module.

A :class:`Plan` maps every ``(module, side)`` to ``"P"`` (production: native PyTorch, see
:mod:`rl_engine.engine.native`) or ``"R"`` (rl-kernel: the contract-carrying
``rl_engine.ops`` entry points). Modules are :data:`MODULES`; sides are ``"train"`` (teacher
forcing) and ``"rollout"`` (prefill + decode with a KV cache).

``Plan.parse("R/R")`` puts every module of both sides on rl-kernel, ``"P/P"`` on native torch,
``"P/R"``/``"R/P"`` mix per side (train letter first). Single modules can then be switched with
:meth:`Plan.with_module` — the one-module-at-a-time ablations build on this.

A plan is data: a model never calls an operator directly but receives the operators of one side,
``rl_engine.engine.ops_for(plan, "train")``, which routes each module to P or R.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["MODULES", "SIDES", "Plan", "PlanError"]

MODULES: tuple[str, ...] = ("attention", "gemm", "norm", "rope", "activation", "embedding", "logprob", "moe")
SIDES: tuple[str, ...] = ("train", "rollout")
Letter = Literal["P", "R"]


class PlanError(ValueError):
    """A plan string or module/side/letter is not valid."""


@dataclass(frozen=True)
class Plan:
    """``choices[(module, side)] -> "P" | "R"`` for every module and side."""

    choices: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        full = {}
        for m in MODULES:
            for s in SIDES:
                v = self.choices.get((m, s))
                if v not in ("P", "R"):
                    raise PlanError(f"plan: module {m!r} side {s!r} must be 'P' or 'R', got {v!r}")
                full[(m, s)] = v
        extra = set(self.choices) - set(full)
        if extra:
            raise PlanError(f"plan: unknown (module, side) keys {sorted(extra)}; modules {list(MODULES)}, sides {list(SIDES)}")
        object.__setattr__(self, "choices", MappingProxyType(full))

    @classmethod
    def uniform(cls, train: Letter, rollout: Letter) -> "Plan":
        return cls({(m, s): (train if s == "train" else rollout) for m in MODULES for s in SIDES})

    @classmethod
    def parse(cls, text: str) -> "Plan":
        """``"R/R"``, ``"P/P"``, ``"P/R"`` or ``"R/P"`` (train side first)."""
        parts = text.strip().upper().split("/")
        if len(parts) != 2 or any(p not in ("P", "R") for p in parts):
            raise PlanError(f"plan: expected one of R/R, P/P, P/R, R/P (train/rollout), got {text!r}")
        return cls.uniform(parts[0], parts[1])  # type: ignore[arg-type]

    def with_module(self, module: str, train: Letter | None = None, rollout: Letter | None = None) -> "Plan":
        """A copy with ``module`` switched on the given side(s)."""
        if module not in MODULES:
            raise PlanError(f"module: expected one of {list(MODULES)}, got {module!r}")
        ch = dict(self.choices)
        if train is not None:
            ch[(module, "train")] = train
        if rollout is not None:
            ch[(module, "rollout")] = rollout
        return Plan(ch)

    def side(self, side: str) -> dict[str, str]:
        if side not in SIDES:
            raise PlanError(f"side: expected one of {list(SIDES)}, got {side!r}")
        return {m: self.choices[(m, side)] for m in MODULES}

    @property
    def label(self) -> str:
        """``"R/R"`` etc. when each side is uniform, else the per-module listing."""
        t, r = self.side("train"), self.side("rollout")
        if len(set(t.values())) == 1 and len(set(r.values())) == 1:
            return f"{next(iter(t.values()))}/{next(iter(r.values()))}"
        return ",".join(f"{m}={t[m]}/{r[m]}" for m in MODULES)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "train": self.side("train"), "rollout": self.side("rollout")}
