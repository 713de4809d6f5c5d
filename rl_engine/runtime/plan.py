"""Plans: which implementation each side uses for each module.

A :class:`Plan` maps every ``(module, side)`` to ``"P"`` (production: native PyTorch, see
:mod:`rl_engine.layers.native`) or ``"R"`` (rl-kernel: the contract-carrying
``rl_engine.ops`` entry points). Modules are :data:`MODULES`; sides are ``"train"`` (teacher
forcing) and ``"rollout"`` (prefill + decode with a KV cache).

``Plan.parse("R/R")`` puts every module of both sides on rl-kernel, ``"P/P"`` on native torch,
``"P/R"``/``"R/P"`` mix per side (train letter first). Single modules can then be switched with
:meth:`Plan.with_module` — the one-module-at-a-time ablations build on this.

A model never calls an operator directly: it receives an :class:`OpsProvider` for the side it
runs, ``plan.provider("train")``, whose methods route each module to P or R.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

from rl_engine.layers import native

__all__ = ["MODULES", "SIDES", "Plan", "OpsProvider", "PlanError"]

MODULES: tuple[str, ...] = ("attention", "gemm", "norm", "rope", "activation", "embedding", "logprob")
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

    def provider(self, side: str, *, kv_cache: str = "contiguous") -> "OpsProvider":
        return OpsProvider(self.side(side), kv_cache=kv_cache)


def _ops(family: str):
    return importlib.import_module(f"rl_engine.ops.{family}")


class OpsProvider:
    """The operators one side of a plan runs, one method per operation a model needs.

    Args:
        choices: ``module -> "P" | "R"`` for every module in :data:`MODULES`.
        kv_cache: ``"contiguous"`` or ``"paged"`` (the rl-kernel cache layout used by the R
            attention module on the rollout side).
    """

    def __init__(self, choices: Mapping[str, str], *, kv_cache: str = "contiguous"):
        missing = set(MODULES) - set(choices)
        if missing:
            raise PlanError(f"choices: missing modules {sorted(missing)}")
        bad = {m: v for m, v in choices.items() if v not in ("P", "R") or m not in MODULES}
        if bad:
            raise PlanError(f"choices: expected module -> 'P'|'R' for modules {list(MODULES)}, got {bad}")
        if kv_cache not in ("contiguous", "paged"):
            raise PlanError(f"kv_cache: expected 'contiguous' or 'paged', got {kv_cache!r}")
        self.choices = dict(choices)
        self.kv_cache = kv_cache

    def __repr__(self) -> str:
        return f"OpsProvider({self.choices})"

    def _r(self, module: str) -> bool:
        return self.choices[module] == "R"

    # --- embedding / gemm / norm / activation / rope --------------------------------------
    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _ops("embedding").embedding(ids, weight) if self._r("embedding") else native.embedding(ids, weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _ops("gemm").linear(x, weight, bias) if self._r("gemm") else native.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _ops("norm").rms_norm(x, weight, eps) if self._r("norm") else native.rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return _ops("activation").silu_and_mul(x) if self._r("activation") else native.silu_and_mul(x)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor, *, theta: float) -> torch.Tensor:
        if self._r("rope"):
            return _ops("rope").apply_rope(x, positions, theta=theta)
        return native.apply_rope(x, positions, theta=theta)

    # --- attention ------------------------------------------------------------------------
    def varlen_attention(self, q, k, v, cu_seqlens, *, scale: float | None = None) -> torch.Tensor:
        if self._r("attention"):
            return _ops("attention").varlen_attention(q, k, v, cu_seqlens, scale=scale)
        return native.varlen_attention(q, k, v, cu_seqlens, scale=scale)

    def new_kv_cache(self, max_seqs: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                     dtype: torch.dtype, device: torch.device | str) -> Any:
        """One layer's KV cache for up to ``max_seqs`` sequences of ``max_len`` tokens."""
        if not self._r("attention"):
            return native.NativeKVCache(max_seqs, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        attn = _ops("attention")
        if self.kv_cache == "contiguous":
            return attn.ContiguousKVCache(max_seqs, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        block = 16
        per_seq = -(-max_len // block)
        return attn.PagedKVCache(max_seqs * per_seq, block, num_kv_heads, head_dim, dtype=dtype, device=device,
                                 max_seqs=max_seqs, max_blocks_per_seq=per_seq)

    def cached_attention(self, q, k_new, v_new, cache, seq_ids, cu_seqlens_q, *, scale: float | None = None):
        if self._r("attention"):
            return _ops("attention").cached_attention(q, k_new, v_new, cache, seq_ids, cu_seqlens_q, scale=scale)
        return native.cached_attention(q, k_new, v_new, cache, seq_ids, cu_seqlens_q, scale=scale)

    def cached_attention_layers(self, caches, seq_ids, cu_seqlens_q, *, scale: float | None = None):
        """``attend(i, q, k_new, v_new)`` for layer ``i`` of one rollout step over the per-layer
        ``caches``: on rl-kernel, the step is planned once for every layer
        (``plan_cached_attention``, then ``cached_attention_step`` per layer: the bits of one
        ``cached_attention`` call per layer, without redoing the step's bookkeeping and its
        host-to-device copies in every layer); natively, one call per layer."""
        if self._r("attention"):
            attn = _ops("attention")
            plan = attn.plan_cached_attention(caches, seq_ids, cu_seqlens_q)
            return lambda i, q, k, v: attn.cached_attention_step(q, k, v, caches[i], plan, scale=scale)
        return lambda i, q, k, v: native.cached_attention(q, k, v, caches[i], seq_ids, cu_seqlens_q, scale=scale)

    # --- log-probs --------------------------------------------------------------------------
    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        if self._r("logprob"):
            return _ops("logprob").token_logprobs(logits, targets, temperature)
        return native.token_logprobs(logits, targets, temperature)

    def entropy(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return _ops("logprob").entropy(logits, temperature) if self._r("logprob") else native.entropy(logits, temperature)

    def lm_head_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, *, return_entropy: bool = False,
                         token_chunk: int | None = None, vocab_chunk: int | None = None):
        """Log-probs (and entropy) of ``targets`` under ``softmax(hidden Wᵀ / T)``.

        With gemm and logprob both on R this is the fused, chunked
        ``rl_engine.ops.logprob.linear_token_logprobs`` (raw-bit equal to the unfused pair by
        its contract); otherwise the logits are materialised with :meth:`linear`.
        Returns ``(logprobs, entropy_or_None)``.
        """
        if self._r("gemm") and self._r("logprob"):
            out = _ops("logprob").linear_token_logprobs(
                hidden, weight, targets, temperature, return_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk
            )
            return (out[0], out[1]) if return_entropy else (out, None)
        logits = self.linear(hidden, weight)
        lp = self.token_logprobs(logits, targets, temperature)
        return lp, (self.entropy(logits, temperature) if return_entropy else None)
