"""rl_engine's KV cache behind transformers' ``Cache`` interface: :class:`RlkCache`.

An installed model (:func:`rl_engine.integrations.hf.install.install`) decodes over this cache:
each layer's keys and values live in rl_engine's storage layout — ``[B, R, Hkv, D]``, row ``b``
holding sequence ``b``'s tokens at their **logical** positions ``0..lens[b]-1`` (pads are never
stored), i.e. a contiguous cache of one ``R``-row page per sequence — and every call appends the
new tokens **in place** and attends through ``attention.cached_attention``
(:func:`rl_engine.integrations.hf.attention.cache_attention`): no copy of the past, no
re-layout of HF's keys. Each token's attention output is raw-bit equal to the one the training
forward computes for it (contract ``attention.cached_attention``).

Two kinds, as transformers has them:

* **dynamic** (:class:`RlkDynamicLayer`): sized at first use (``generate`` passes its
  ``max_length``), grown by doubling if a call needs more; the cache's length is a Python int.
  ``generate``'s default.
* **static** (:class:`RlkStaticLayer`, ``cache_implementation="static"``): ``max_cache_len``
  tokens per sequence, fixed storage and a length kept as a 0-d tensor (static addresses,
  marked for dynamo), so a compiled decode step never changes shape and can be captured in a
  CUDA graph; ``is_compileable`` is true, so ``generate`` compiles the decode step when it
  compiles (CUDA, or a ``CompileConfig``).

The per-row lengths ``lens`` ``[B]`` live on the device: RoPE positions (``lens[b]`` + the
number of valid new tokens before a token) and the storage rows of a decode step are computed
there, so a step reads nothing back to the host.

What transformers asks of a cache and how this one answers: ``get_seq_length`` — tokens seen
(pads included, HF's physical count; a tensor for the static kind); ``get_mask_sizes`` — the
dynamic kind ``(seen + Lq, 0)``, the static kind ``(max_cache_len, 0)`` (a fixed mask shape);
``reset``, ``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices`` — supported;
``crop`` (assisted decoding) — not supported (``is_croppable`` is false). ``update`` — HF's
key/value exchange — raises: the keys are not in HF's layout, only the installed attention
reads them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, StaticCache

__all__ = ["RlkCache", "RlkCacheLayer", "RlkDynamicLayer", "RlkStaticLayer", "prepare_cache_for_generation"]

#: Tokens per row a dynamic layer allocates when nothing says how many it will hold.
_MIN_DYNAMIC_TOKENS = 256


class RlkCacheLayer(CacheLayerMixin):
    """One layer's keys and values in rl_engine's layout (see the module docstring).

    Attributes (after the first call):
        keys, values: ``[B, capacity + 1, Hkv, D]`` storage (the last row of each sequence is
            the spare row a pad token of a decode step is written to).
        lens: ``[B]`` int64, tokens stored per sequence.
        capacity: tokens a sequence can hold.
    """

    is_sliding = False
    is_croppable = False

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"max_cache_len: expected a positive int, got {capacity!r}")
        self.capacity = capacity
        self.lens: torch.Tensor | None = None

    def __repr__(self) -> str:
        shape = None if self.keys is None else tuple(self.keys.shape)
        return f"{type(self).__name__}(capacity={self.capacity}, storage={shape})"

    # -- storage

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate from HF-layout states ``[B, Hkv, L, D]`` (``Cache.early_initialization``)."""
        self._allocate(key_states.shape[0], key_states.shape[1], key_states.shape[-1], key_states.dtype,
                       key_states.device, key_states.shape[2])

    def _allocate(self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, tokens: int) -> None:
        cap = self._initial_capacity(tokens)
        self.keys = torch.zeros((batch, cap + 1, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.lens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.capacity = cap
        self.device = self.keys.device
        self.is_initialized = True

    def _initial_capacity(self, tokens: int) -> int:
        raise NotImplementedError

    def prepare(self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, q_len: int) -> None:
        """Make room for a call of ``q_len`` new tokens per row (allocate on first use).

        Raises:
            ValueError: ``cache:`` the call's batch, heads, head dim, dtype or device differ from
                what the cache holds.
        """
        if not self.is_initialized:
            self._allocate(batch, num_kv_heads, head_dim, dtype, device, q_len)
            return
        want = (batch, num_kv_heads, head_dim, dtype, torch.empty(0, device=device).device)
        have = (self.keys.shape[0], self.keys.shape[2], self.keys.shape[3], self.keys.dtype, self.keys.device)
        if want != have:
            raise ValueError(f"cache: holds (batch, kv heads, head_dim, dtype, device) = {have}, the call has {want}; "
                             "use a new cache (or reset() it for the same shapes)")

    # -- the attention step

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Append the valid new tokens in place and attend (:func:`~rl_engine.integrations.hf.attention.cache_attention`).

        Shapes: q ``[B, Lq, Hq, D]``; k, v ``[B, Lq, Hkv, D]``; valid ``[B, Lq]`` bool; returns
        ``[B, Lq, Hq, D]``.
        """
        from rl_engine.integrations.hf import graph_ops

        out = graph_ops.cache_attention(q, k, v, self.keys, self.values, self.lens, valid, scale)
        self._advance(q.shape[1])
        return out

    def _advance(self, q_len: int) -> None:
        raise NotImplementedError

    # -- the rest of transformers' layer interface

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("cache: an RlkCache keeps keys at logical positions for rl_engine's attention and does not hand "
                        "them to another attention function; use it with a model carrying the rl_engine install "
                        "(rl_engine.integrations.hf.install.install)")

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every sequence (storage rows past ``lens`` are never read, so nothing is zeroed)."""
        if self.is_initialized:
            self.lens.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("tokens_to_remove: an RlkCache cannot be cropped (it stores no pads, so a physical length does "
                         "not map to one position per row); assisted decoding is not supported with rl_engine's cache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search), in place."""
        if self.is_initialized:
            idx = beam_idx.to(self.keys.device)
            for t in (self.keys, self.values, self.lens):
                t.copy_(t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys, self.values, self.lens = (t.repeat_interleave(repeats, dim=0) for t in (self.keys, self.values, self.lens))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values, self.lens = (t[indices].contiguous() for t in (self.keys, self.values, self.lens))


class RlkDynamicLayer(RlkCacheLayer):
    """A layer sized at first use and grown by doubling (``capacity``: the first size, if known)."""

    is_compileable = False

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.seen = 0

    def _initial_capacity(self, tokens: int) -> int:
        return max(tokens, _MIN_DYNAMIC_TOKENS if self.capacity is None else self.capacity)

    def prepare(self, batch, num_kv_heads, head_dim, dtype, device, q_len) -> None:
        super().prepare(batch, num_kv_heads, head_dim, dtype, device, q_len)
        if self.seen + q_len > self.capacity:  # every row holds at most `seen` tokens
            cap = max(2 * self.capacity, self.seen + q_len)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros((old.shape[0], cap + 1, *old.shape[2:]))
                new[:, : self.capacity] = old[:, : self.capacity]
                setattr(self, name, new)
            self.capacity = cap

    def _advance(self, q_len: int) -> None:
        self.seen += q_len

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.seen = 0


class RlkStaticLayer(RlkCacheLayer):
    """A layer of ``capacity`` (``max_cache_len``) tokens per sequence with fixed storage and a
    0-d tensor length: what ``torch.compile`` and CUDA graphs need."""

    is_compileable = True

    def __init__(self, capacity: int) -> None:
        if capacity is None:
            raise ValueError("max_cache_len: a static cache needs the number of tokens per sequence, got None")
        super().__init__(capacity)
        self.cumulative_length = torch.tensor(0, dtype=torch.int64)

    def _initial_capacity(self, tokens: int) -> int:
        return self.capacity

    def prepare(self, batch, num_kv_heads, head_dim, dtype, device, q_len) -> None:
        """As :meth:`RlkCacheLayer.prepare`; also refuses a call past ``max_cache_len`` tokens per row
        (pads included: the mask has that many columns) where the length may be read back
        (:func:`rl_engine.utils.checks.reads_back`; never while compiling)."""
        from rl_engine.utils.checks import reads_back

        super().prepare(batch, num_kv_heads, head_dim, dtype, device, q_len)
        if not torch.compiler.is_compiling() and reads_back(self.cumulative_length):
            seen = int(self.cumulative_length)
            if seen + q_len > self.capacity:
                raise ValueError(f"cache: {seen} tokens per row seen (pads included) + {q_len} new exceed "
                                 f"max_cache_len={self.capacity}")

    def _allocate(self, batch, num_kv_heads, head_dim, dtype, device, tokens) -> None:
        super()._allocate(batch, num_kv_heads, head_dim, dtype, device, tokens)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # fixed addresses: no recompilation, CUDA-graph safe
            for t in (self.keys, self.values, self.lens, self.cumulative_length):
                torch._dynamo.mark_static_address(t)

    def _advance(self, q_len: int) -> None:
        self.cumulative_length.add_(q_len)

    def get_seq_length(self) -> int | torch.Tensor:
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        super().reset()
        self.cumulative_length.zero_()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("repeats: a static RlkCache has a fixed batch; create it for the expanded batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("indices: a static RlkCache has a fixed batch; create it for the selected batch")


class RlkCache(Cache):
    """rl_engine's KV cache for a transformers decoder (one :class:`RlkCacheLayer` per layer).

    Args:
        config: the model's ``PretrainedConfig`` (its text config gives the layer count); every
            layer must be full attention.
        max_cache_len: tokens per sequence — required for ``static=True``; for the dynamic kind
            the first allocation (it grows beyond).
        static: fixed storage for ``torch.compile`` (see the module docstring).

    Use: ``model.generate(..., cache=RlkCache(model.config))`` on an installed model, or let the
    install choose it (``generate`` of an installed model uses it by default; with
    ``cache_implementation="static"`` the static kind).

    Raises:
        ValueError: sliding-window / non-full-attention layers, a bad ``max_cache_len``.
    """

    def __init__(self, config, *, max_cache_len: int | None = None, static: bool = False) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n = getattr(text, "num_hidden_layers", None)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"config: expected num_hidden_layers >= 1, got {n!r}")
        types = getattr(text, "layer_types", None) or ["full_attention"] * n
        if any(t != "full_attention" for t in types):
            raise ValueError(f"config: an RlkCache serves full-attention layers only, got layer types {sorted(set(types))}")
        layers = [RlkStaticLayer(max_cache_len) if static else RlkDynamicLayer(max_cache_len) for _ in range(n)]
        super().__init__(layers=layers)
        self.static = static

    def __repr__(self) -> str:
        return f"RlkCache(static={self.static}, layers={len(self.layers)}, first={self.layers[0]!r})"


def prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """``GenerationMixin._prepare_cache_for_generation`` of an installed model (bound to the instance).

    Runs transformers' own preparation, then replaces the cache it made for this call — a fresh
    ``DynamicCache`` (no ``cache_implementation``, or ``"dynamic"``) or ``StaticCache``
    (``"static"``) — by an :class:`RlkCache` of the same kind and size. A cache the caller passed
    (``cache=`` / ``past_key_values=``) and other implementations (offloaded, quantized, sliding)
    are left as they are: the installed attention then takes its fallback path for a
    transformers cache (:func:`~rl_engine.integrations.hf.attention.rebuilt_cache_attention`).
    """
    keys = ("cache", "past_key_values")
    user_defined = any(model_kwargs.get(k) is not None for k in keys)
    result = type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
    if user_defined:
        return result
    for key in keys:
        made = model_kwargs.get(key)
        if made is None or getattr(made, "offloading", False):
            continue
        if type(made) is DynamicCache:
            model_kwargs[key] = RlkCache(self.config, max_cache_len=getattr(generation_config, "max_length", None))
        elif type(made) is StaticCache:
            model_kwargs[key] = RlkCache(self.config, max_cache_len=_static_length(made), static=True)
    return result


def _static_length(cache: StaticCache) -> int:
    """``max_cache_len`` of a transformers ``StaticCache`` (the first layer's)."""
    length = getattr(cache.layers[0], "max_cache_len", None)
    if not isinstance(length, int):
        raise ValueError(f"cache: cannot read max_cache_len from {type(cache).__name__}")
    return length
