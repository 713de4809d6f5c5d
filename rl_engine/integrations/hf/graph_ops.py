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

Gradients: each node's autograd formula is one more opaque node, ``rlk::hf_backward``, which
re-runs the eager call with autograd on and returns ``torch.autograd.grad`` of it — the public
op's own backward. The ops are deterministic (the same inputs give the same bits and the same
saved tensors), so a compiled training step computes the eager step's loss and gradients bit for
bit, at the cost of one extra forward per op in the backward. The rollout-side
``cache_attention`` (it appends to the cache) has no gradient.

Importing this module registers the ``rlk::hf_*`` ops (the install imports it).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["linear", "embedding", "rms_norm", "silu_and_mul", "apply_rope", "packed_attention", "cache_attention"]


def _eager(op: str, t: list, scalars: list[float]) -> torch.Tensor:
    """The eager public call behind node ``op`` (tensor arguments ``t``, float arguments ``scalars``)."""
    if op == "linear":
        from rl_engine.ops.gemm import linear as fn

        return fn(t[0], t[1], t[2])
    if op == "embedding":
        from rl_engine.ops.embedding import embedding as fn

        return fn(t[0], t[1])
    if op == "rms_norm":
        from rl_engine.ops.norm import rms_norm as fn

        return fn(t[0], t[1], scalars[0])
    if op == "silu_and_mul":
        from rl_engine.ops.activation import silu_and_mul as fn

        return fn(t[0])
    if op == "apply_rope":
        from rl_engine.ops.rope import apply_rope as fn

        return fn(t[0], t[1], theta=scalars[0])
    if op == "packed_attention":
        from rl_engine.integrations.hf.attention import packed_attention as fn

        return fn(t[0], t[1], t[2], t[3], t[4], scalars[0] if scalars else None)
    raise ValueError(f"op: no HF graph node {op!r}")


@torch.library.custom_op("rlk::hf_backward", mutates_args=())
def _backward_node(op: str, grad: torch.Tensor, inputs: list[Optional[torch.Tensor]], scalars: list[float],
                   needs: list[bool]) -> list[torch.Tensor]:
    """Gradients of node ``op``'s output (``grad``) to the ``inputs`` flagged in ``needs``: the
    eager call re-run under autograd. An input not needed gets an empty tensor."""
    with _autograd_inside_custom_op(), torch.enable_grad():
        leaves = [t.detach().requires_grad_() if n else t for t, n in zip(inputs, needs)]
        out = _eager(op, leaves, scalars)
        wanted = [leaf for leaf, n in zip(leaves, needs) if n]
        got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    result = []
    for leaf, n in zip(leaves, needs):
        if not n:
            result.append(grad.new_empty(0))
            continue
        g = next(got)
        result.append(torch.zeros_like(leaf) if g is None else g.detach())  # zeros: an input the output does not reach
    return result


def _autograd_inside_custom_op():
    """A custom op's implementation runs with the autograd dispatch keys excluded (it sits below
    autograd); the eager re-run needs them back for the duration of the backward. Restored on exit."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther, C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


@_backward_node.register_fake
def _(op, grad, inputs, scalars, needs):
    return [t.new_empty(t.shape) if n else grad.new_empty(0) for t, n in zip(inputs, needs)]


def _with_gradients(node, op: str, tensors: tuple[int, ...], scalars: tuple[int, ...] = ()) -> None:
    """Give ``node`` (positional arguments: tensors at ``tensors``, floats at ``scalars``) the
    autograd formula of the eager call, through :func:`_backward_node`."""
    n_args = len(tensors) + len(scalars)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in tensors))
        ctx.scalars = [float(inputs[i]) for i in scalars if inputs[i] is not None]

    def backward(ctx, grad):
        needs = [bool(ctx.needs_input_grad[i]) for i in tensors]
        out: list = [None] * n_args
        if not any(needs):
            return tuple(out)
        grads = _backward_node(op, grad.contiguous(), list(ctx.saved_tensors), ctx.scalars, needs)
        for j, i in enumerate(tensors):
            if needs[j]:
                out[i] = grads[j]
        return tuple(out)

    node.register_autograd(backward, setup_context=setup_context)


# --------------------------------------------------------------------------------------------- nodes


@torch.library.custom_op("rlk::hf_linear", mutates_args=())
def _linear_node(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _eager("linear", [x, weight, bias], [])


@_linear_node.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_with_gradients(_linear_node, "linear", (0, 1, 2))


@torch.library.custom_op("rlk::hf_embedding", mutates_args=())
def _embedding_node(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _eager("embedding", [ids, weight], [])


@_embedding_node.register_fake
def _(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


_with_gradients(_embedding_node, "embedding", (0, 1))


@torch.library.custom_op("rlk::hf_rms_norm", mutates_args=())
def _rms_norm_node(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _eager("rms_norm", [x, weight], [eps])


@_rms_norm_node.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


_with_gradients(_rms_norm_node, "rms_norm", (0, 1), (2,))


@torch.library.custom_op("rlk::hf_silu_and_mul", mutates_args=())
def _silu_and_mul_node(x: torch.Tensor) -> torch.Tensor:
    return _eager("silu_and_mul", [x], [])


@_silu_and_mul_node.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


_with_gradients(_silu_and_mul_node, "silu_and_mul", (0,))


@torch.library.custom_op("rlk::hf_apply_rope", mutates_args=())
def _apply_rope_node(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    return _eager("apply_rope", [x, positions], [theta])


@_apply_rope_node.register_fake
def _(x, positions, theta):
    return x.new_empty(x.shape)


_with_gradients(_apply_rope_node, "apply_rope", (0, 1), (2,))


@torch.library.custom_op("rlk::hf_packed_attention", mutates_args=())
def _packed_attention_node(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                           segments: Optional[torch.Tensor], scale: Optional[float]) -> torch.Tensor:
    return _eager("packed_attention", [q, k, v, valid, segments], [] if scale is None else [scale])


@_packed_attention_node.register_fake
def _(q, k, v, valid, segments, scale):
    return q.new_empty(q.shape)


_with_gradients(_packed_attention_node, "packed_attention", (0, 1, 2, 3, 4), (5,))


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
    return _eager("linear", [x, weight, bias], [])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`rl_engine.ops.embedding.embedding` (``ids [...]``, ``weight [V, H]`` → ``[..., H]``)."""
    if torch.compiler.is_compiling():
        return _embedding_node(ids, weight)
    return _eager("embedding", [ids, weight], [])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rl_engine.ops.norm.rms_norm` (``x [..., H]``, ``weight [H]``)."""
    if torch.compiler.is_compiling():
        return _rms_norm_node(x, weight, eps)
    return _eager("rms_norm", [x, weight], [eps])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`rl_engine.ops.activation.silu_and_mul` (``[..., 2d]`` → ``[..., d]``)."""
    if torch.compiler.is_compiling():
        return _silu_and_mul_node(x)
    return _eager("silu_and_mul", [x], [])


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """:func:`rl_engine.ops.rope.apply_rope` (``x [T, H, D]``, ``positions [T]``)."""
    if torch.compiler.is_compiling():
        return _apply_rope_node(x, positions, theta)
    return _eager("apply_rope", [x, positions], [theta])


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     segments: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """:func:`rl_engine.integrations.hf.attention.packed_attention`."""
    if torch.compiler.is_compiling():
        return _packed_attention_node(q, k, v, valid, segments, scale)
    return _eager("packed_attention", [q, k, v, valid, segments], [] if scale is None else [scale])


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                    lens: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`rl_engine.integrations.hf.attention.cache_attention` (mutates ``k_store``, ``v_store``, ``lens``)."""
    if torch.compiler.is_compiling():
        return _cache_attention_node(q, k, v, k_store, v_store, lens, valid, scale)
    from rl_engine.integrations.hf.attention import cache_attention as fn

    return fn(q, k, v, k_store, v_store, lens, valid, scale)
