"""Qwen3 dense assembled from operator calls only (every call goes through an ``OpsProvider``).

One decoder layer (HF ``Qwen3DecoderLayer``), ``T`` tokens flattened, ``Hq``/``Hkv`` heads of
size ``D``::

    x  = rms_norm(h, input_layernorm)
    q, k, v = split(linear(x, W_qkv))                       # one GEMM, column slices
    q  = rms_norm(q.view(T, Hq, D), q_norm)                 # QK-norm per head, before RoPE
    k  = rms_norm(k.view(T, Hkv, D), k_norm)
    q, k = apply_rope(q, pos), apply_rope(k, pos)           # rotate-half, theta from the spec
    h  = h + linear(attention(q, k, v), Wo)                 # causal; varlen (train) or KV cache (rollout)
    h  = h + linear(silu_and_mul(linear(rms_norm(h, post_attention_layernorm), W_gate_up)), W_down)

then ``norm`` and the LM head (``embed_tokens`` when tied). The q/k/v projections are stored
as one ``[(Hq + 2 Hkv) D, H]`` matrix and computed by one ``linear`` (the GEMM contract is
column-chunk invariant, so each slice has the bits of its own product); the gate and up
projections likewise as one ``[2I, H]`` matrix (gate rows first), which :func:`silu_and_mul`
splits. The residual additions are elementwise IEEE additions in the model dtype, as in HF.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rl_engine.models.qwen3.spec import ModelLoadError, Qwen3Spec, load_spec
from rl_engine.utils import portable
from rl_engine.models.hooks import stage_hook

__all__ = ["Qwen3ForCausalLM"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _layer_names(i: int, spec: Qwen3Spec) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    h, d = spec.hidden_size, spec.head_dim
    names = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (spec.q_size, h),
        p + "self_attn.k_proj.weight": (spec.kv_size, h),
        p + "self_attn.v_proj.weight": (spec.kv_size, h),
        p + "self_attn.o_proj.weight": (h, spec.q_size),
        p + "self_attn.q_norm.weight": (d,),
        p + "self_attn.k_norm.weight": (d,),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
        p + "mlp.up_proj.weight": (spec.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, spec.intermediate_size),
    }
    if spec.attention_bias:
        names[p + "self_attn.q_proj.bias"] = (spec.q_size,)
        names[p + "self_attn.k_proj.bias"] = (spec.kv_size,)
        names[p + "self_attn.v_proj.bias"] = (spec.kv_size,)
        names[p + "self_attn.o_proj.bias"] = (h,)
    return names


def hf_parameter_shapes(spec: Qwen3Spec) -> dict[str, tuple[int, ...]]:
    """Every HF checkpoint tensor name of ``spec`` and its shape."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    for i in range(spec.num_hidden_layers):
        shapes.update(_layer_names(i, spec))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


class Qwen3ForCausalLM:
    """Qwen3 dense weights plus the forward passes of the train and rollout paths.

    Build with :meth:`from_pretrained` (HF checkpoint directory) or :meth:`random` (seeded).
    Parameters are plain tensors (``self.params``, HF names, except q/k/v fused per layer as
    ``model.layers.{i}.self_attn.qkv_proj.*`` and gate/up as
    ``model.layers.{i}.mlp.gate_up_proj.weight``); call :meth:`requires_grad_` for autograd.
    """

    def __init__(self, spec: Qwen3Spec, params: dict[str, torch.Tensor]):
        self.spec = spec
        self.params = params
        first = params["model.embed_tokens.weight"]
        self.dtype = first.dtype
        self.device = first.device

    # --- construction ----------------------------------------------------------------------
    #: What :meth:`from_hf_state_dict` calls the checkpoint in its errors.
    checkpoint_kind = "Qwen3 dense"

    @classmethod
    def load_spec(cls, model_dir: str | Path) -> Qwen3Spec:
        """The spec of a checkpoint directory (its ``config.json``)."""
        return load_spec(model_dir)

    @classmethod
    def parameter_shapes(cls, spec: Qwen3Spec) -> dict[str, tuple[int, ...]]:
        """Every HF checkpoint tensor name of ``spec`` and its shape."""
        return hf_parameter_shapes(spec)

    @classmethod
    def fusions(cls, spec: Qwen3Spec) -> dict[str, tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]]]:
        """``fused parameter -> (its HF tensors, how they combine)``: q/k/v and gate/up concatenated."""
        fused: dict[str, tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]]] = {}
        for i in range(spec.num_hidden_layers):
            p = f"model.layers.{i}."
            fused[p + "mlp.gate_up_proj.weight"] = ([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], torch.cat)
            for kind in ("weight", "bias") if spec.attention_bias else ("weight",):
                fused[p + f"self_attn.qkv_proj.{kind}"] = ([p + f"self_attn.{x}_proj.{kind}" for x in "qkv"], torch.cat)
        return fused

    @classmethod
    def from_hf_state_dict(cls, spec: Qwen3Spec, sd: dict[str, torch.Tensor], *, dtype: torch.dtype,
                           device: torch.device | str = "cpu") -> "Qwen3ForCausalLM":
        shapes = cls.parameter_shapes(spec)
        if spec.tie_word_embeddings:
            sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # a tied copy may be saved
        missing = [k for k in shapes if k not in sd]
        if missing:
            raise ModelLoadError(f"weights: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        unexpected = [k for k in sd if k not in shapes and not k.endswith("rotary_emb.inv_freq")]
        if unexpected:
            raise ModelLoadError(f"weights: unexpected tensor(s) {unexpected[:3]} (is this a {cls.checkpoint_kind} checkpoint?)")
        for k, shp in shapes.items():
            if tuple(sd[k].shape) != shp:
                raise ModelLoadError(f"weights: {k} has shape {tuple(sd[k].shape)}, config says {shp}")
        fused = cls.fusions(spec)
        parts = {k for srcs, _ in fused.values() for k in srcs}
        params: dict[str, torch.Tensor] = {}
        for k in shapes:
            if k not in parts:
                params[k] = sd[k].to(device=device, dtype=dtype).contiguous()
        for k, (srcs, combine) in fused.items():
            params[k] = combine([sd[x].to(device=device, dtype=dtype) for x in srcs]).contiguous()
        return cls(spec, params)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Qwen3ForCausalLM":
        """Load ``config.json`` and ``model.safetensors`` (or the sharded index) from a directory."""
        from safetensors.torch import load_file

        spec = cls.load_spec(model_dir)
        path = Path(model_dir)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ModelLoadError(f"weights: {str(index)!r} is not a valid safetensors index: {exc}") from exc
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ModelLoadError(f"weights: {str(path)!r} has neither model.safetensors nor model.safetensors.index.json")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            fp = path / f
            if not fp.is_file():
                raise ModelLoadError(f"weights: shard {str(fp)!r} listed in the index is missing")
            try:
                sd.update(load_file(str(fp)))
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"weights: cannot read {str(fp)!r}: {exc}") from exc
        return cls.from_hf_state_dict(spec, sd, dtype=dtype, device=device)

    @classmethod
    def random(cls, spec: Qwen3Spec, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", std: float = 0.02) -> "Qwen3ForCausalLM":
        """Seeded random weights (fp32 draws, then cast), norm weights ``1 + N(0, 0.01)``.

        Draws come from :func:`rl_engine.utils.portable.normal` (unit variance, the same bits on
        every CPU), so a seed names the same model on every host.

        The embedding (and an untied LM head) is drawn with std 0.25, so the logits of the tiny
        models have a standard deviation of a few units (sampled distributions neither flat
        nor one-hot); projection matrices are N(0, 1/fan_in); biases N(0, ``std``²).
        """
        g = torch.Generator().manual_seed(seed)
        sd = {}
        for name, shape in cls.parameter_shapes(spec).items():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t = 1.0 + 0.1 * portable.normal(shape, g)
            elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
                t = 0.25 * portable.normal(shape, g)
            elif name.endswith(".bias"):
                t = std * portable.normal(shape, g)
            else:
                t = portable.normal(shape, g) / math.sqrt(shape[1])
            sd[name] = t
        return cls.from_hf_state_dict(spec, sd, dtype=dtype, device=device)

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named tensors (gate/up split again), e.g. to build a transformers model."""
        s = self.spec
        out = {}
        for k, v in self.params.items():
            v = v.detach()
            if k.endswith("mlp.gate_up_proj.weight"):
                base = k[: -len("gate_up_proj.weight")]
                i = s.intermediate_size
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = v[:i].clone(), v[i:].clone()
            elif ".self_attn.qkv_proj." in k:
                base, kind = k.split(".self_attn.qkv_proj.")
                q, kk, vv = v.split([s.q_size, s.kv_size, s.kv_size])
                for name, t in zip("qkv", (q, kk, vv)):
                    out[f"{base}.self_attn.{name}_proj.{kind}"] = t.clone()
            else:
                out[k] = v.clone()
        return out

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self.params.values())

    def requires_grad_(self, flag: bool = True) -> "Qwen3ForCausalLM":
        for v in self.params.values():
            v.requires_grad_(flag)
        return self

    def zero_grad(self) -> None:
        for v in self.params.values():
            v.grad = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            return self.params["model.embed_tokens.weight"]
        return self.params["lm_head.weight"]

    # --- forward ---------------------------------------------------------------------------
    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, ops, attend) -> torch.Tensor:
        s, P = self.spec, self.params
        T = ids.shape[0]
        eps = s.rms_norm_eps
        # Stage hook (rl_engine.models.hooks): one context-variable read per forward; the
        # tensors are not touched when no observer has set a hook.
        tap = stage_hook()
        h = ops.embedding(ids, P["model.embed_tokens.weight"])
        if tap:
            h = tap(-1, "embedding", h)
        for i in range(s.num_hidden_layers):
            p = f"model.layers.{i}."
            x = ops.rms_norm(h, P[p + "input_layernorm.weight"], eps)
            if tap:
                tap(i, "input_norm", x)
            qkv = ops.linear(x, P[p + "self_attn.qkv_proj.weight"], P.get(p + "self_attn.qkv_proj.bias"))
            q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
            q = ops.rms_norm(q.reshape(T, s.num_attention_heads, s.head_dim).contiguous(), P[p + "self_attn.q_norm.weight"], eps)
            k = ops.rms_norm(k.reshape(T, s.num_key_value_heads, s.head_dim).contiguous(), P[p + "self_attn.k_norm.weight"], eps)
            q = ops.apply_rope(q, positions, theta=s.rope_theta)
            k = ops.apply_rope(k, positions, theta=s.rope_theta)
            v = v.reshape(T, s.num_key_value_heads, s.head_dim)
            o = attend(i, q.contiguous(), k.contiguous(), v.contiguous())
            if tap:
                tap(i, "attention", o.reshape(T, s.q_size))
            o = ops.linear(o.reshape(T, s.q_size).contiguous(), P[p + "self_attn.o_proj.weight"],
                           P.get(p + "self_attn.o_proj.bias"))
            if tap:
                tap(i, "attn_proj", o)
            h = h + o
            x = ops.rms_norm(h, P[p + "post_attention_layernorm.weight"], eps)
            if tap:
                tap(i, "post_attention_norm", x)
            x = self._mlp(i, x, ops, tap)
            if tap:
                tap(i, "mlp", x)
            h = h + x
            if tap:
                tap(i, "residual", h)
        out = ops.rms_norm(h, P["model.norm.weight"], eps)
        if tap:
            tap(-1, "final_norm", out)
        return out

    def _mlp(self, i: int, x: torch.Tensor, ops, tap) -> torch.Tensor:
        """The MLP of layer ``i`` on the post-attention-norm rows ``x [T, H]`` (``tap``: the stage
        hook or ``None``)."""
        p = f"model.layers.{i}."
        x = ops.silu_and_mul(ops.linear(x, self.params[p + "mlp.gate_up_proj.weight"]))
        return ops.linear(x.contiguous(), self.params[p + "mlp.down_proj.weight"])

    def hidden_train(self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, ops) -> torch.Tensor:
        """Final-norm hidden states ``[T, H]`` of a packed batch (train path, causal per segment).

        Args:
            ids, positions: ``[T]`` int64; cu_seqlens: ``[S+1]`` int32/int64 segment bounds.
            ops: the train side's :class:`~rl_engine.engine.OpsProvider`.
        """
        scale = self.spec.head_dim ** -0.5
        return self._layers(ids, positions, ops, lambda i, q, k, v: ops.varlen_attention(q, k, v, cu_seqlens, scale=scale))

    def new_kv_caches(self, ops, max_seqs: int, max_len: int) -> list:
        """One KV cache per layer, of the rollout provider's kind."""
        s = self.spec
        return [ops.new_kv_cache(max_seqs, max_len, s.num_key_value_heads, s.head_dim, dtype=self.dtype, device=self.device)
                for _ in range(s.num_hidden_layers)]

    def hidden_cached(self, ids: torch.Tensor, positions: torch.Tensor, caches: list, seq_ids: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, ops) -> torch.Tensor:
        """Final-norm hidden states ``[T, H]`` of one rollout step (prefill, chunk or decode rows)
        against per-layer KV caches; the new tokens' k/v are appended to the caches. The step is
        planned once for all layers (``ops.cached_attention_layers``).

        The step is one transaction over the caches: if any layer raises (a rejected input, a
        kernel error, an interrupt), every cache is restored to its state before the step (its
        ``snapshot``/``restore``), so the caches still hold the same sequences and the step can be
        planned again."""
        scale = self.spec.head_dim ** -0.5
        snapshots = [c.snapshot() for c in caches]
        try:
            return self._layers(ids, positions, ops, ops.cached_attention_layers(caches, seq_ids, cu_seqlens_q, scale=scale))
        except BaseException:
            for c, snap in zip(caches, snapshots):
                c.restore(snap)
            raise

    def hidden_paged(self, ids: torch.Tensor, positions: torch.Tensor, k_caches: list, v_caches: list, plan,
                     ops) -> torch.Tensor:
        """Final-norm hidden states ``[T, H]`` of one rollout step over engine-owned paged caches.

        The engine form of :meth:`hidden_cached`: ``k_caches[i]`` / ``v_caches[i]`` are layer
        ``i``'s ``[num_blocks, block_size, Hkv, D]`` caches, and ``plan`` is the step's
        :class:`~rl_engine.ops.attention.PagedAttentionPlan` (``plan_paged_attention``), shared
        by every layer. Nothing in the step reads the host, so it can be captured in a CUDA graph
        and replayed after the plan is updated in place for the next step
        (``plan_paged_attention(..., out=plan)``); the new tokens' keys and values are written at
        ``plan.slot_mapping``.
        """
        scale = self.spec.head_dim ** -0.5
        if len(k_caches) != self.spec.num_hidden_layers or len(v_caches) != self.spec.num_hidden_layers:
            raise ValueError(f"k_caches: expected {self.spec.num_hidden_layers} per-layer caches (and as many v_caches), "
                             f"got {len(k_caches)} and {len(v_caches)}")
        return self._layers(ids, positions, ops,
                            lambda i, q, k, v: ops.paged_attention_step(q, k, v, k_caches[i], v_caches[i], plan, scale=scale))

    def logits(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head_weight)


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
