"""The operators the HF install calls: rl_engine's public ops eagerly, one graph node each under ``torch.compile``.

Eagerly each function here is the public entry point (``rl_engine.ops.<family>.<op>``, or the
attention helpers of :mod:`rl_engine.integrations.hf.attention`), called directly.

Under ``torch.compile`` (``torch.compiler.is_compiling()`` while dynamo traces) the call becomes
one ``torch.library`` custom op, ``rlk::hf_<op>``, whose real implementation is that same
eager call and whose fake implementation gives only the output's shape and dtype. The entry
points do Python work a graph cannot hold — argument checks that read values (offsets, NaN
scans), the registry's dispatch and the provenance record, which read context variables —
so dynamo must not trace into them: as one opaque node each, the compiled graph holds the
model's glue (reshapes, residual additions, masks, positions) and calls rl_engine's ops, and
every op runs exactly as it runs eagerly, so the compiled model computes **the same bits**.
Under ``mode="reduce-overhead"`` the nodes are captured in a CUDA graph like any other op (the
decode path reads nothing back to the host).

The nodes carry no autograd: under ``torch.compile`` the install serves inference (``generate``,
scoring under ``torch.no_grad()``); compiling a forward that needs gradients fails when its
backward is traced (``BackendCompilerFailed`` naming the node). Train with the eager model.

Importing this module registers the ``rlk::hf_*`` ops (the install imports it).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["linear", "embedding", "rms_norm", "silu_and_mul", "apply_rope", "packed_attention", "cache_attention"]


def _no_gradients(node) -> None:
    """Give ``node`` an autograd formula that refuses: a compiled forward that needs gradients
    fails when the backward is traced (``torch.compile`` raises ``BackendCompilerFailed`` with
    this message) instead of silently dropping them."""
    name = f"rlk::{node._name}"

    def backward(ctx, *grads):
        raise ValueError(f"{name}: the rl_engine HF install under torch.compile computes no gradients (its ops are "
                         "opaque graph nodes); run the compiled model under torch.no_grad() or train the eager model")

    node.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)


# --------------------------------------------------------------------------------------------- nodes


@torch.library.custom_op("rlk::hf_linear", mutates_args=())
def _linear_node(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    from rl_engine.ops.gemm import linear as op

    return op(x, weight, bias)


@_linear_node.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_no_gradients(_linear_node)


@torch.library.custom_op("rlk::hf_embedding", mutates_args=())
def _embedding_node(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from rl_engine.ops.embedding import embedding as op

    return op(ids, weight)


@_embedding_node.register_fake
def _(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


_no_gradients(_embedding_node)


@torch.library.custom_op("rlk::hf_rms_norm", mutates_args=())
def _rms_norm_node(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from rl_engine.ops.norm import rms_norm as op

    return op(x, weight, eps)


@_rms_norm_node.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


_no_gradients(_rms_norm_node)


@torch.library.custom_op("rlk::hf_silu_and_mul", mutates_args=())
def _silu_and_mul_node(x: torch.Tensor) -> torch.Tensor:
    from rl_engine.ops.activation import silu_and_mul as op

    return op(x)


@_silu_and_mul_node.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


_no_gradients(_silu_and_mul_node)


@torch.library.custom_op("rlk::hf_apply_rope", mutates_args=())
def _apply_rope_node(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    from rl_engine.ops.rope import apply_rope as op

    return op(x, positions, theta=theta)


@_apply_rope_node.register_fake
def _(x, positions, theta):
    return x.new_empty(x.shape)


_no_gradients(_apply_rope_node)


@torch.library.custom_op("rlk::hf_packed_attention", mutates_args=())
def _packed_attention_node(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                           segments: Optional[torch.Tensor], scale: Optional[float]) -> torch.Tensor:
    from rl_engine.integrations.hf.attention import packed_attention as fn

    return fn(q, k, v, valid, segments, scale)


@_packed_attention_node.register_fake
def _(q, k, v, valid, segments, scale):
    return q.new_empty(q.shape)


_no_gradients(_packed_attention_node)


@torch.library.custom_op("rlk::hf_cache_attention", mutates_args=("k_store", "v_store", "lens"))
def _cache_attention_node(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                          v_store: torch.Tensor, lens: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    from rl_engine.integrations.hf.attention import cache_attention as fn

    return fn(q, k, v, k_store, v_store, lens, valid, scale)


@_cache_attention_node.register_fake
def _(q, k, v, k_store, v_store, lens, valid, scale):
    return q.new_empty(q.shape)


# --------------------------------------------------------------------------------------------- entry points


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`rl_engine.ops.gemm.linear` (``x [..., K]``, ``weight [N, K]`` → ``[..., N]``)."""
    if torch.compiler.is_compiling():
        return _linear_node(x, weight, bias)
    from rl_engine.ops.gemm import linear as op

    return op(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`rl_engine.ops.embedding.embedding` (``ids [...]``, ``weight [V, H]`` → ``[..., H]``)."""
    if torch.compiler.is_compiling():
        return _embedding_node(ids, weight)
    from rl_engine.ops.embedding import embedding as op

    return op(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rl_engine.ops.norm.rms_norm` (``x [..., H]``, ``weight [H]``)."""
    if torch.compiler.is_compiling():
        return _rms_norm_node(x, weight, eps)
    from rl_engine.ops.norm import rms_norm as op

    return op(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`rl_engine.ops.activation.silu_and_mul` (``[..., 2d]`` → ``[..., d]``)."""
    if torch.compiler.is_compiling():
        return _silu_and_mul_node(x)
    from rl_engine.ops.activation import silu_and_mul as op

    return op(x)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """:func:`rl_engine.ops.rope.apply_rope` (``x [T, H, D]``, ``positions [T]``)."""
    if torch.compiler.is_compiling():
        return _apply_rope_node(x, positions, theta)
    from rl_engine.ops.rope import apply_rope as op

    return op(x, positions, theta=theta)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     segments: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """:func:`rl_engine.integrations.hf.attention.packed_attention`."""
    if torch.compiler.is_compiling():
        return _packed_attention_node(q, k, v, valid, segments, scale)
    from rl_engine.integrations.hf.attention import packed_attention as fn

    return fn(q, k, v, valid, segments, scale)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                    lens: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`rl_engine.integrations.hf.attention.cache_attention` (mutates ``k_store``, ``v_store``, ``lens``)."""
    if torch.compiler.is_compiling():
        return _cache_attention_node(q, k, v, k_store, v_store, lens, valid, scale)
    from rl_engine.integrations.hf.attention import cache_attention as fn

    return fn(q, k, v, k_store, v_store, lens, valid, scale)
