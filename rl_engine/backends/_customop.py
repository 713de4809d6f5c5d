"""Fake implementations and autograd wiring shared by every backend's custom ops of a family.

Each family's forward and backward custom ops have the same signatures on every backend (CPU:
``rlk::<name>_cpu``, Triton: ``rlk::<name>_triton``; only the kernels differ), so what autograd
saves, which backward op it calls and how that op's result maps back to the inputs is written
once, here. ``wire_<op>(forward, backward)`` registers the fake (meta) implementation of both
custom ops and ``forward.register_autograd(...)`` with ``backward`` as the gradient; a backend
module defines its two custom ops and calls it once.

The autograd formulas call the backward op through
:func:`rl_engine.runtime.custom_ops.call_op`: a backward pass records no graph of its own (grad
mode is off unless ``create_graph``), so its op's body runs directly in eager mode, and the op
runs wherever the backward is traced (``torch.compile``'s AOT autograd, a dispatch mode).

Only torch and the runtime's custom-op helpers are imported here (no triton, no backend module).
"""

from __future__ import annotations

from typing import Callable

import torch

from rl_engine.runtime.custom_ops import call_op

__all__ = [
    "wire_linear",
    "wire_rms_norm",
    "wire_fused_add_rms_norm",
    "wire_apply_rope",
    "wire_silu_and_mul",
    "wire_embedding",
    "wire_log_softmax",
    "wire_token_logprobs",
    "wire_entropy",
    "wire_varlen_attention",
    "wire_moe_route",
    "wire_moe_expert_gate_up",
    "wire_moe_expert_gate_up_saving",
    "wire_moe_expert_down_combine",
]

GradPrep = Callable[[torch.Tensor], torch.Tensor]


def _like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape)


def _f32(t: torch.Tensor, *shape: int) -> torch.Tensor:
    return t.new_empty(shape, dtype=torch.float32)


# --------------------------------------------------------------------------- gemm


def wire_linear(forward, backward) -> None:
    """``forward(x, weight, bias, fp32_out) -> y`` with ``x [..., K]``, ``weight [N, K]``, ``bias [N] |
    None`` (``fp32_out``: a float32 ``y`` from 16-bit inputs, the fp32-output variant);
    ``backward(grad, x, weight, need_dx, need_dw, has_bias) -> (dx, dw, db)`` in ``x``'s dtype (an
    fp32 ``grad`` of the variant is rounded to it first), where a gradient that is not needed
    comes back as an empty ``[0]`` tensor (it is neither computed nor stored)."""
    forward.register_fake(lambda x, weight, bias, fp32_out=False: x.new_empty(
        (*x.shape[:-1], weight.shape[0]), dtype=torch.float32 if fp32_out else x.dtype))

    def backward_fake(grad, x, weight, need_dx, need_dw, has_bias):
        n = weight.shape[0]
        return (x.new_empty(x.shape if need_dx else (0,)), weight.new_empty(weight.shape if need_dw else (0,)),
                x.new_empty((n,) if has_bias else (0,)))

    backward.register_fake(backward_fake)

    def setup(ctx, inputs, output):
        x, weight, bias, _fp32_out = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    def grad_fn(ctx, grad):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        has_bias = ctx.has_bias and ctx.needs_input_grad[2]
        dx, dw, db = call_op(backward, grad.contiguous(), x, weight, need_dx, need_dw, has_bias)
        return (dx if need_dx else None), (dw if need_dw else None), (db if has_bias else None), None

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- norm


def wire_rms_norm(forward, backward) -> None:
    """``forward(x, weight, eps) -> y``; ``backward(grad, x, weight, eps) -> (dx, dweight)``."""
    forward.register_fake(lambda x, weight, eps: _like(x))
    backward.register_fake(lambda grad, x, weight, eps: (_like(x), _like(weight)))

    def setup(ctx, inputs, output):
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    def grad_fn(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dw = call_op(backward, grad.contiguous(), x, weight, ctx.eps)
        return dx, dw, None

    forward.register_autograd(grad_fn, setup_context=setup)


def wire_fused_add_rms_norm(forward, backward) -> None:
    """``forward(x, residual, weight, eps) -> (y, new_residual)``;
    ``backward(grad_out, grad_residual, new_residual, weight, eps) -> (dresidual, dweight)``."""
    forward.register_fake(lambda x, residual, weight, eps: (_like(x), _like(x)))
    backward.register_fake(
        lambda grad_out, grad_residual, new_residual, weight, eps: (_like(new_residual), _like(weight))
    )

    def setup(ctx, inputs, output):
        _, _, weight, eps = inputs
        ctx.save_for_backward(output[1], weight)
        ctx.eps = eps

    def grad_fn(ctx, grad_out, grad_residual):
        new_residual, weight = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(new_residual)
        if grad_residual is None:
            grad_residual = torch.zeros_like(new_residual)
        dres, dw = call_op(backward, grad_out.contiguous(), grad_residual.contiguous(), new_residual, weight, ctx.eps)
        # new_residual = x + residual: both inputs receive the same gradient.
        return dres, dres, dw, None

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- rope


def wire_apply_rope(forward, backward) -> None:
    """``forward(x, positions, theta, rotary_dim) -> y``;
    ``backward(grad, positions, theta, rotary_dim) -> dx`` (the transposed rotation)."""
    forward.register_fake(lambda x, positions, theta, rotary_dim: _like(x))
    backward.register_fake(lambda grad, positions, theta, rotary_dim: _like(grad))

    def setup(ctx, inputs, output):
        _, positions, theta, rotary_dim = inputs
        ctx.save_for_backward(positions)
        ctx.theta = theta
        ctx.rotary_dim = rotary_dim

    def grad_fn(ctx, grad):
        (positions,) = ctx.saved_tensors
        return call_op(backward, grad.contiguous(), positions, ctx.theta, ctx.rotary_dim), None, None, None

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- activation


def wire_silu_and_mul(forward, backward) -> None:
    """``forward(x) -> y`` (``[..., 2d] -> [..., d]``); ``backward(grad, x) -> dx``."""
    forward.register_fake(lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))
    backward.register_fake(lambda grad, x: _like(x))

    def setup(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)

    def grad_fn(ctx, grad):
        (x,) = ctx.saved_tensors
        return call_op(backward, grad.contiguous(), x)

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- embedding


def wire_embedding(forward, backward) -> None:
    """``forward(ids, weight) -> weight[ids]``; ``backward(grad, ids, num_weights) -> dweight``."""
    forward.register_fake(lambda ids, weight: weight.new_empty((*ids.shape, weight.shape[1])))
    backward.register_fake(lambda grad, ids, num_weights: grad.new_empty((num_weights, grad.shape[-1])))

    def setup(ctx, inputs, output):
        ids, weight = inputs
        ctx.save_for_backward(ids)
        ctx.num_weights = weight.shape[0]

    def grad_fn(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, call_op(backward, grad.contiguous(), ids, ctx.num_weights)

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- logprob
#
# The forward ops take logits ``[R, V]`` and return ``(values, lse)`` in fp32; only ``values``
# carries a gradient (``lse`` is returned for the wrappers' row checks). ``prepare_grad`` is how
# the backend hands the upstream gradient to its backward op (e.g. ``.float().contiguous()``).
# ``kept_threshold`` / ``kept_boundary`` (``[R]`` or ``None``) are the rows' kept-set records
# (rl_engine.utils.kept): the values are those of the distribution renormalised over the kept set.


def wire_log_softmax(forward, backward, *, prepare_grad: GradPrep) -> None:
    """``forward(logits, temperature, kept_threshold, kept_boundary) -> (out, lse)``;
    ``backward(grad, out, temperature, dtype, masked) -> dlogits``."""
    forward.register_fake(lambda logits, temperature, kept_threshold=None, kept_boundary=None: (
        _f32(logits, *logits.shape), _f32(logits, logits.shape[0])))
    backward.register_fake(lambda grad, out, temperature, dtype, masked=False: out.new_empty(out.shape, dtype=dtype))

    def setup(ctx, inputs, output):
        logits, temperature, kept_threshold, kept_boundary = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(output[0])
        ctx.temperature = temperature
        ctx.dtype = logits.dtype
        ctx.masked = kept_threshold is not None

    def grad_fn(ctx, grad, _grad_lse):
        if grad is None:
            return None, None, None, None
        (out,) = ctx.saved_tensors
        return call_op(backward, prepare_grad(grad), out, ctx.temperature, ctx.dtype, ctx.masked), None, None, None

    forward.register_autograd(grad_fn, setup_context=setup)


def wire_token_logprobs(forward, backward, *, prepare_grad: GradPrep) -> None:
    """``forward(logits, targets, temperature, kept_threshold, kept_boundary) -> (logprobs, lse)``;
    ``backward(grad, logits, targets, lse, temperature, kept_threshold, kept_boundary) -> dlogits``."""
    forward.register_fake(lambda logits, targets, temperature, kept_threshold=None, kept_boundary=None: (
        _f32(logits, logits.shape[0]), _f32(logits, logits.shape[0])))
    backward.register_fake(
        lambda grad, logits, targets, lse, temperature, kept_threshold=None, kept_boundary=None: _like(logits))

    def setup(ctx, inputs, output):
        logits, targets, temperature, kept_threshold, kept_boundary = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, targets, output[1], kept_threshold, kept_boundary)
        ctx.temperature = temperature

    def grad_fn(ctx, grad, _grad_lse):
        if grad is None:
            return None, None, None, None, None
        logits, targets, lse, kt, kb = ctx.saved_tensors
        return call_op(backward, prepare_grad(grad), logits, targets, lse, ctx.temperature, kt, kb), None, None, None, None

    forward.register_autograd(grad_fn, setup_context=setup)


def wire_entropy(forward, backward, *, prepare_grad: GradPrep) -> None:
    """``forward(logits, temperature, kept_threshold, kept_boundary) -> (entropy, lse)``;
    ``backward(grad, logits, lse, entropy, temperature, kept_threshold, kept_boundary) -> dlogits``."""
    forward.register_fake(lambda logits, temperature, kept_threshold=None, kept_boundary=None: (
        _f32(logits, logits.shape[0]), _f32(logits, logits.shape[0])))
    backward.register_fake(
        lambda grad, logits, lse, ent, temperature, kept_threshold=None, kept_boundary=None: _like(logits))

    def setup(ctx, inputs, output):
        logits, temperature, kept_threshold, kept_boundary = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, output[1], output[0], kept_threshold, kept_boundary)
        ctx.temperature = temperature

    def grad_fn(ctx, grad, _grad_lse):
        if grad is None:
            return None, None, None, None
        logits, lse, ent, kt, kb = ctx.saved_tensors
        return call_op(backward, prepare_grad(grad), logits, lse, ent, ctx.temperature, kt, kb), None, None, None

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- attention


def wire_varlen_attention(forward, backward) -> None:
    """``forward(q, k, v, cu_seqlens, scale, window) -> (out, lse, out_fp32)`` with ``out_fp32``
    the unrounded output for 16-bit inputs (empty for fp32: ``out`` is already fp32);
    ``backward(grad, q, k, v, out_f32_or_out, lse, cu_seqlens, scale, window) -> (dq, dk, dv)``.
    ``lse`` and ``out_fp32`` are not differentiable; the backward's ``delta = Σ dO ⊙ O`` uses the
    unrounded output."""

    def fake_forward(q, k, v, cu_seqlens, scale, window):
        f32 = _f32(q, 0) if q.dtype == torch.float32 else _f32(q, *q.shape)
        return _like(q), _f32(q, *q.shape[:2]), f32

    forward.register_fake(fake_forward)
    backward.register_fake(lambda grad, q, k, v, out, lse, cu_seqlens, scale, window: (_like(q), _like(k), _like(v)))

    def setup(ctx, inputs, output):
        q, k, v, cu_seqlens, scale, window = inputs
        out, lse, out_f32 = output
        ctx.save_for_backward(q, k, v, out_f32 if out_f32.numel() or out.numel() == 0 else out, lse, cu_seqlens)
        ctx.scale, ctx.window = scale, window
        ctx.mark_non_differentiable(lse, out_f32)

    def grad_fn(ctx, grad_out, grad_lse, grad_out_f32):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(q)
        dq, dk, dv = call_op(backward, grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.scale, ctx.window)
        return dq, dk, dv, None, None, None

    forward.register_autograd(grad_fn, setup_context=setup)


# --------------------------------------------------------------------------- moe


def wire_moe_route(forward, backward) -> None:
    """``forward(logits, top_k, renormalize) -> (weights fp32 [T, K], ids int64 [T, K])``;
    ``backward(grad_weights, logits, ids, renormalize) -> dlogits``. ``ids`` is not
    differentiable (the selection has no gradient)."""

    def fake_forward(logits, top_k, renormalize):
        T = logits.shape[0]
        return logits.new_empty((T, top_k), dtype=torch.float32), logits.new_empty((T, top_k), dtype=torch.int64)

    forward.register_fake(fake_forward)
    backward.register_fake(lambda grad, logits, ids, renormalize: _like(logits))

    def setup(ctx, inputs, output):
        logits, _, renormalize = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, output[1])
        ctx.renormalize = renormalize
        ctx.mark_non_differentiable(output[1])

    def grad_fn(ctx, grad, _grad_ids):
        if grad is None:
            return None, None, None
        logits, ids = ctx.saved_tensors
        return call_op(backward, grad.float().contiguous(), logits, ids, ctx.renormalize), None, None

    forward.register_autograd(grad_fn, setup_context=setup)


def wire_moe_expert_gate_up(forward, backward) -> None:
    """``forward(x, w_gate_up, ids) -> act`` (``[T, H], [E, 2I, H], [T, K] -> [T, K, I]``);
    ``backward(grad, x, w_gate_up, ids) -> (dx, dw_gate_up)``."""
    forward.register_fake(lambda x, w, ids: x.new_empty((*ids.shape, w.shape[1] // 2)))
    backward.register_fake(lambda grad, x, w, ids: (_like(x), _like(w)))

    def setup(ctx, inputs, output):
        x, w, ids = inputs
        ctx.save_for_backward(x, w, ids)

    def grad_fn(ctx, grad):
        x, w, ids = ctx.saved_tensors
        dx, dw = call_op(backward, grad.contiguous(), x, w, ids)
        return dx, dw, None

    forward.register_autograd(grad_fn, setup_context=setup)


def wire_moe_expert_gate_up_saving(forward, backward) -> None:
    """``forward(x, w_gate_up, ids) -> (act, h)`` (``[T, K, I]`` and the gate/up GEMM result
    ``[T·K, 2I]`` it activates, not differentiable); ``backward(grad, x, w_gate_up, ids, h) -> (dx,
    dw_gate_up)``: the backward reads the forward's ``h`` instead of recomputing the GEMM, at the
    memory of one ``[T·K, 2I]`` tensor per call kept for the backward."""
    forward.register_fake(lambda x, w, ids: (x.new_empty((*ids.shape, w.shape[1] // 2)),
                                             x.new_empty((ids.numel(), w.shape[1]))))
    backward.register_fake(lambda grad, x, w, ids, h: (_like(x), _like(w)))

    def setup(ctx, inputs, output):
        x, w, ids = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, w, ids, output[1])

    def grad_fn(ctx, grad, _grad_h):
        x, w, ids, h = ctx.saved_tensors
        dx, dw = call_op(backward, grad.contiguous(), x, w, ids, h)
        return dx, dw, None

    forward.register_autograd(grad_fn, setup_context=setup)


def wire_moe_expert_down_combine(forward, backward) -> None:
    """``forward(act, w_down, weights, ids) -> out`` (``[T, K, I], [E, H, I], [T, K] fp32,
    [T, K] -> [T, H]``); ``backward(grad, act, w_down, weights, ids) -> (dact, dw_down, dweights)``."""
    forward.register_fake(lambda act, w, weights, ids: act.new_empty((act.shape[0], w.shape[1])))
    backward.register_fake(lambda grad, act, w, weights, ids: (_like(act), _like(w), _like(weights)))

    def setup(ctx, inputs, output):
        act, w, weights, ids = inputs
        ctx.save_for_backward(act, w, weights, ids)

    def grad_fn(ctx, grad):
        act, w, weights, ids = ctx.saved_tensors
        dact, dw, dweights = call_op(backward, grad.contiguous(), act, w, weights, ids)
        return dact, dw, dweights, None

    forward.register_autograd(grad_fn, setup_context=setup)
