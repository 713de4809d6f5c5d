"""The operators one side of a plan runs: each module routed to native torch (P) or rl-kernel (R).

:func:`ops_for` turns a :class:`~rl_engine.runtime.plan.Plan` and a side into an
:class:`OpsProvider`, the object a model receives; its methods are the operations a model needs
(linear, norms, attention with its KV caches, log-probs), each dispatched to
:mod:`rl_engine.engine.native` or to the ``rl_engine.ops`` entry point by the plan's letter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_engine.engine import native
from rl_engine.ops import activation as _activation
from rl_engine.ops import attention as _attention
from rl_engine.ops import embedding as _embedding
from rl_engine.ops import gemm as _gemm
from rl_engine.ops import logprob as _logprob
from rl_engine.ops import moe as _moe
from rl_engine.ops import norm as _norm
from rl_engine.ops import rope as _rope
from rl_engine.runtime.plan import MODULES, Plan, PlanError

__all__ = ["OpsProvider", "ops_for"]

_FAMILIES = {"activation": _activation, "attention": _attention, "embedding": _embedding, "gemm": _gemm,
             "logprob": _logprob, "moe": _moe, "norm": _norm, "rope": _rope}


def _ops(family: str):
    return _FAMILIES[family]


def ops_for(plan: Plan, side: str, *, kv_cache: str = "contiguous") -> "OpsProvider":
    """The operators of ``side`` (``"train"`` or ``"rollout"``) under ``plan``.

    ``kv_cache`` is the rl-kernel cache layout of the rollout side's R attention
    (``"contiguous"`` or ``"paged"``)."""
    return OpsProvider(plan.side(side), kv_cache=kv_cache)


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

    # --- mixture of experts -----------------------------------------------------------------
    def moe_route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
        """``(weights [T, K], ids [T, K])`` of the router logits (``rl_engine.ops.moe.route`` or HF's router)."""
        if self._r("moe"):
            return _ops("moe").route(router_logits, top_k, renormalize)
        return native.moe_route(router_logits, top_k, renormalize)

    def moe_experts(self, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        """The routed experts of a sparse MoE block (``rl_engine.ops.moe.experts`` or HF's eager loop)."""
        if self._r("moe"):
            return _ops("moe").experts(x, w_gate_up, w_down, weights, ids)
        return native.moe_experts(x, w_gate_up, w_down, weights, ids)

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

    def paged_attention_step(self, q, k_new, v_new, k_cache, v_cache, plan, *, scale: float | None = None):
        """One layer of a planned step over engine-owned paged caches (rl-kernel only: the native
        path has no engine-cache form)."""
        if not self._r("attention"):
            raise PlanError("attention: the native (P) path has no engine-owned paged cache; run the rollout side on R")
        return _ops("attention").paged_attention_step(q, k_new, v_new, k_cache, v_cache, plan, scale=scale)

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
    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                       kept=None) -> torch.Tensor:
        """Log-probs of ``targets``; with ``kept`` (a ``KeptSet`` per row) renormalised over each
        row's kept set (the processed log-prob)."""
        if self._r("logprob"):
            return _ops("logprob").token_logprobs(logits, targets, temperature, kept=kept)
        return native.token_logprobs(logits, targets, temperature, kept)

    def entropy(self, logits: torch.Tensor, temperature: float = 1.0, *, kept=None) -> torch.Tensor:
        if self._r("logprob"):
            return _ops("logprob").entropy(logits, temperature, kept=kept)
        return native.entropy(logits, temperature, kept)

    def lm_head_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, *, return_entropy: bool = False,
                         token_chunk: int | None = None, vocab_chunk: int | None = None, kept=None):
        """Log-probs (and entropy) of ``targets`` under ``softmax(hidden Wᵀ / T)``, renormalised
        over each row's kept set when ``kept`` (a ``KeptSet`` per row) is given.

        With gemm and logprob both on R this is the fused, chunked
        ``rl_engine.ops.logprob.linear_token_logprobs`` (raw-bit equal to the unfused pair by
        its contract); otherwise the logits are materialised with :meth:`linear`.
        Returns ``(logprobs, entropy_or_None)``.
        """
        if self._r("gemm") and self._r("logprob"):
            out = _ops("logprob").linear_token_logprobs(
                hidden, weight, targets, temperature, return_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
                kept=kept,
            )
            return (out[0], out[1]) if return_entropy else (out, None)
        logits = self.linear(hidden, weight)
        lp = self.token_logprobs(logits, targets, temperature, kept=kept)
        return lp, (self.entropy(logits, temperature, kept=kept) if return_entropy else None)
