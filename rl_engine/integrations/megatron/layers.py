"""Megatron-core modules built on rl_engine's TP-invariant blocks, and the layer spec that uses them.

Each class takes the constructor arguments Megatron-core 0.16 passes to the module it replaces
(``build_module`` in ``TransformerLayer``, ``SelfAttention``, ``TransformerBlock``) and returns
what that module returns, so a ``GPTModel`` built from :func:`qwen3_layer_spec` runs unchanged
Megatron control flow around rl_engine arithmetic:

=====================  ============================================  =====================================
Megatron slot          replacement                                   arithmetic
=====================  ============================================  =====================================
``linear_qkv``,        :class:`RlkColumnParallelLinear`              ``column_parallel_linear``
``linear_fc1``
``linear_proj``,       :class:`RlkRowParallelLinear`                 ``row_parallel_linear`` (scheme from
``linear_fc2``                                                       ``config.rlk_row_scheme``)
``input_layernorm``,   :class:`RlkRMSNorm`                           ``norm.rms_norm``
``pre_mlp_layernorm``,
final layer norm
``q_layernorm``,       :class:`RlkHeadRMSNorm`                       ``norm.rms_norm`` on all heads
``k_layernorm``                                                      (gather / slice)
``core_attention``     :class:`RlkCoreAttention`                     ``rope.apply_rope`` +
                                                                     ``attention.varlen_attention``
``mlp``                :class:`RlkMLP`                               fc1, ``activation.silu_and_mul``, fc2
=====================  ============================================  =====================================

RoPE runs inside the core attention (``GPTModel`` is built with ``position_embedding_type="none"``)
at the positions and sequence bounds of the packed batch, which :func:`packed_batch` sets for
the forward (a context variable). This module imports megatron-core.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401  (the slot names)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from rl_engine.distributed.tensor_parallel import (
    column_parallel_linear,
    gather_heads,
    row_parallel_linear,
    slice_heads,
)
from rl_engine.distributed.transports import Group

__all__ = ["RlkColumnParallelLinear", "RlkRowParallelLinear", "RlkRMSNorm", "RlkHeadRMSNorm", "RlkCoreAttention",
           "RlkMLP", "qwen3_layer_spec", "qwen3_block_spec", "packed_batch"]

_BATCH: ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = ContextVar("rl_engine_megatron_batch", default=None)


@contextmanager
def packed_batch(positions: torch.Tensor, cu_seqlens: torch.Tensor) -> Iterator[None]:
    """The positions ``[T]`` and sequence bounds ``[S+1]`` of the packed batch the forward runs on."""
    token = _BATCH.set((positions, cu_seqlens))
    try:
        yield
    finally:
        _BATCH.reset(token)


def _tp_group(tp_group=None) -> Group:
    return Group(tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group())


class RlkColumnParallelLinear(torch.nn.Module):
    """Megatron ``ColumnParallelLinear`` slot: ``weight`` ``[N / tp, K]`` (this rank's rows)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 gather_output: bool = False, skip_bias_add: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, stride: int = 1, **_):
        super().__init__()
        self.group = _tp_group(tp_group)
        p = self.group.size
        if output_size % p:
            raise ValueError(f"output_size: {output_size} is not divisible by the tensor-parallel size {p}")
        if is_expert:
            raise ValueError("is_expert: expert layers are not supported by the rl_engine Megatron spec")
        self.output_size, self.gather_output, self.skip_bias_add = output_size, gather_output, skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size // p, input_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(output_size // p, dtype=config.params_dtype)) if bias else None
        if init_method is not None:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        b = None if self.skip_bias_add else self.bias
        y = column_parallel_linear(x.contiguous(), self.weight, b, self.group, n_total=self.output_size)
        if self.gather_output:
            y = self.group.all_gather(y, dim=-1)
        return y, (self.bias if self.skip_bias_add else None)


class RlkRowParallelLinear(torch.nn.Module):
    """Megatron ``RowParallelLinear`` slot (input parallel, output replicated).

    ``config.rlk_row_scheme`` picks the scheme (:data:`~rl_engine.distributed.tensor_parallel.ROW_SCHEMES`):
    ``full_k`` holds ``weight`` ``[N / tp, K]`` (rows with full K), the others Megatron's
    ``[N, K / tp]``.
    """

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None, bias: bool = False,
                 input_is_parallel: bool = True, skip_bias_add: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, **_):
        super().__init__()
        if not input_is_parallel:
            raise ValueError("input_is_parallel: the rl_engine row-parallel linear takes a K-sharded input")
        self.group = _tp_group(tp_group)
        p = self.group.size
        self.scheme = getattr(config, "rlk_row_scheme", "full_k")
        for name, v in (("input_size", input_size), ("output_size", output_size)):
            if v % p:
                raise ValueError(f"{name}: {v} is not divisible by the tensor-parallel size {p}")
        shape = (output_size // p, input_size) if self.scheme == "full_k" else (output_size, input_size // p)
        self.weight = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))
        n_bias = output_size // p if self.scheme == "full_k" else output_size
        self.bias = torch.nn.Parameter(torch.zeros(n_bias, dtype=config.params_dtype)) if bias else None
        self.skip_bias_add = skip_bias_add
        if init_method is not None:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        # a skipped bias is returned for Megatron's bias-dropout-add only in the K-shard layouts
        # (full_k's bias is sharded like its rows, so it is always added here)
        add = self.bias if (self.scheme == "full_k" or not self.skip_bias_add) else None
        y = row_parallel_linear(x.contiguous(), self.weight, add, self.group, scheme=self.scheme)
        return y, (self.bias if (self.skip_bias_add and self.scheme != "full_k") else None)


class RlkRMSNorm(torch.nn.Module):
    """Megatron norm slot: ``rl_engine.ops.norm.rms_norm`` over the last dimension."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rl_engine.ops.norm import rms_norm

        return rms_norm(x.contiguous(), self.weight, self.eps)


class RlkHeadRMSNorm(RlkRMSNorm):
    """``q_layernorm`` / ``k_layernorm`` slot on ``[s, b, heads_local, hn]``: the norm runs on
    all heads (gathered over the TP ranks), so the replicated weight's gradient is the
    single-process one; the output is this rank's heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rl_engine.ops.norm import rms_norm

        group = _tp_group()
        full = gather_heads(x.contiguous(), group, dim=2)
        return slice_heads(rms_norm(full.contiguous(), self.weight, self.eps), group, dim=2)


class RlkCoreAttention(torch.nn.Module):
    """Megatron ``core_attention`` slot: RoPE at the packed batch's positions, then causal
    ``attention.varlen_attention`` over its sequences. ``query`` ``[T, 1, heads, hn]``, ``key``
    and ``value`` ``[T, 1, kv_heads, hn]`` → ``[T, 1, heads · hn]``."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None, **_):
        super().__init__()
        self.theta = float(getattr(config, "rlk_rope_theta", 1_000_000.0))
        self.scale = softmax_scale
        self.current_max_attn_logits = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        from rl_engine.ops.attention import varlen_attention
        from rl_engine.ops.rope import apply_rope

        batch = _BATCH.get()
        if batch is None:
            raise RuntimeError("query: the rl_engine core attention runs inside packed_batch(positions, cu_seqlens)")
        if query.shape[1] != 1:
            raise ValueError(f"query: expected one packed row [T, 1, heads, hn], got {tuple(query.shape)}")
        positions, cu = batch
        q = apply_rope(query[:, 0].contiguous(), positions, theta=self.theta)
        k = apply_rope(key[:, 0].contiguous(), positions, theta=self.theta)
        scale = self.scale if self.scale is not None else query.shape[-1] ** -0.5
        o = varlen_attention(q.contiguous(), k.contiguous(), value[:, 0].contiguous(), cu, scale=scale)
        return o.reshape(o.shape[0], 1, -1)


class RlkMLP(MegatronModule):
    """Megatron ``mlp`` slot: ``fc2(silu_and_mul(fc1(x)))``, fc1 holding this rank's
    ``[gate_r; up_r]`` rows (Megatron's per-rank interleaved gated layout)."""

    def __init__(self, config, submodules=None, tp_group=None, **_):
        super().__init__(config=config)
        ffn = config.ffn_hidden_size
        self.linear_fc1 = RlkColumnParallelLinear(config.hidden_size, 2 * ffn, config=config,
                                                  bias=config.add_bias_linear, tp_group=tp_group)
        self.linear_fc2 = RlkRowParallelLinear(ffn, config.hidden_size, config=config, bias=config.add_bias_linear,
                                               input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)

    def forward(self, hidden_states, **_):
        from rl_engine.ops.activation import silu_and_mul

        h, _b = self.linear_fc1(hidden_states)
        return self.linear_fc2(silu_and_mul(h.contiguous()))


def qwen3_layer_spec() -> ModuleSpec:
    """The ``TransformerLayer`` spec of a Qwen3 decoder layer on the modules above."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RlkRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=RlkColumnParallelLinear,
                    core_attention=RlkCoreAttention,
                    linear_proj=RlkRowParallelLinear,
                    q_layernorm=RlkHeadRMSNorm,
                    k_layernorm=RlkHeadRMSNorm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RlkRMSNorm,
            mlp=ModuleSpec(module=RlkMLP),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def qwen3_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """The decoder block: ``num_layers`` Qwen3 layers and the final :class:`RlkRMSNorm`."""
    return TransformerBlockSubmodules(layer_specs=[qwen3_layer_spec()] * num_layers, layer_norm=RlkRMSNorm)
