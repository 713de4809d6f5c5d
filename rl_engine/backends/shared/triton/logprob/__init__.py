"""Triton ``logprob.log_softmax``, ``logprob.token_logprobs`` and ``logprob.entropy`` for CUDA
(validated on sm90) and ROCm (declared, untested).

Same public semantics as the CPU implementation (``rl_engine/backends/cpu/logprob``): fp32
outputs for fp32 and bf16 logits, ``z = fl32(logits) / fl32(τ)``, the canonical blocked
log-sum-exp (1024-column blocks at absolute offsets merged in block order, the same merge
formulas), gradients to the logits in the logits dtype (rounded once), the same errors for
rows without a finite logit or that overflow. One row per program, fixed reduction order:
**row** and **chunk invariant** over rows, deterministic, forward and backward. The GPU's
``exp``/``log`` and in-block summation tree differ from the CPU's, so the two platforms' bits
need not agree; each meets the contract's tolerances (see ``kernels.py``).

``logprob.linear_token_logprobs`` (the fused LM head) is not implemented here.

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends.shared.triton import arch_reasons, unavailable_reasons
from rl_engine.runtime.registry import Implementation, Request, register
from rl_engine.utils.checks import current_nan_policy

__all__ = [
    "log_softmax_triton",
    "token_logprobs_triton",
    "entropy_triton",
    "log_softmax",
    "token_logprobs",
    "entropy",
]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.shared.triton.logprob import kernels

    return kernels


def _check_lse(lse: torch.Tensor, what: str) -> None:
    """Rows without any finite logit, or overflow to +inf/NaN, get a clear error (as on CPU)."""
    if lse.numel() == 0:
        return
    dead = torch.isneginf(lse)
    if bool(dead.any()):
        rows = torch.nonzero(dead).squeeze(1)[:8].tolist()
        raise ValueError(f"{what}: rows {rows} have no finite entry (all -inf): their log-probs are undefined")
    if current_nan_policy() != "propagate" and not bool(torch.isfinite(lse).all()):
        rows = torch.nonzero(~torch.isfinite(lse)).squeeze(1)[:8].tolist()
        raise ValueError(f"{what}: rows {rows} are not finite in logits / temperature (+inf input or overflow)")


def _f32(t: torch.Tensor, *shape: int) -> torch.Tensor:
    return t.new_empty(shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# log_softmax


@torch.library.custom_op("rlk::log_softmax_triton", mutates_args=(), device_types="cuda")
def log_softmax_triton(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, _, lse, _ = _kernels().forward(logits, temperature, log_softmax=True)
    return out, lse


@log_softmax_triton.register_fake
def _(logits, temperature):
    return _f32(logits, *logits.shape), _f32(logits, logits.shape[0])


@torch.library.custom_op("rlk::log_softmax_triton_backward", mutates_args=(), device_types="cuda")
def log_softmax_triton_backward(grad: torch.Tensor, out: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().log_softmax_backward(grad, out, temperature, dtype)


@log_softmax_triton_backward.register_fake
def _(grad, out, temperature, dtype):
    return out.new_empty(out.shape, dtype=dtype)


def _ls_setup(ctx, inputs, output):
    logits, temperature = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[0])
    ctx.temperature = temperature
    ctx.dtype = logits.dtype


def _ls_backward(ctx, grad, _grad_lse):
    if grad is None:
        return None, None
    (out,) = ctx.saved_tensors
    return log_softmax_triton_backward(grad.float().contiguous(), out, ctx.temperature, ctx.dtype), None


log_softmax_triton.register_autograd(_ls_backward, setup_context=_ls_setup)


# ---------------------------------------------------------------------------------------------
# token_logprobs


@torch.library.custom_op("rlk::token_logprobs_triton", mutates_args=(), device_types="cuda")
def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, lp, lse, _ = _kernels().forward(logits, temperature, targets=targets)
    return lp, lse


@token_logprobs_triton.register_fake
def _(logits, targets, temperature):
    return _f32(logits, logits.shape[0]), _f32(logits, logits.shape[0])


@torch.library.custom_op("rlk::token_logprobs_triton_backward", mutates_args=(), device_types="cuda")
def token_logprobs_triton_backward(
    grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, temperature: float
) -> torch.Tensor:
    return _kernels().token_logprobs_backward(grad, logits, targets, lse, temperature)


@token_logprobs_triton_backward.register_fake
def _(grad, logits, targets, lse, temperature):
    return logits.new_empty(logits.shape)


def _tl_setup(ctx, inputs, output):
    logits, targets, temperature = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, targets, output[1])
    ctx.temperature = temperature


def _tl_backward(ctx, grad, _grad_lse):
    if grad is None:
        return None, None, None
    logits, targets, lse = ctx.saved_tensors
    return token_logprobs_triton_backward(grad.float().contiguous(), logits, targets, lse, ctx.temperature), None, None


token_logprobs_triton.register_autograd(_tl_backward, setup_context=_tl_setup)


# ---------------------------------------------------------------------------------------------
# entropy


@torch.library.custom_op("rlk::entropy_triton", mutates_args=(), device_types="cuda")
def entropy_triton(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, lse, ent = _kernels().forward(logits, temperature, entropy=True)
    return ent, lse


@entropy_triton.register_fake
def _(logits, temperature):
    return _f32(logits, logits.shape[0]), _f32(logits, logits.shape[0])


@torch.library.custom_op("rlk::entropy_triton_backward", mutates_args=(), device_types="cuda")
def entropy_triton_backward(
    grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, temperature: float
) -> torch.Tensor:
    return _kernels().entropy_backward(grad, logits, lse, ent, temperature)


@entropy_triton_backward.register_fake
def _(grad, logits, lse, ent, temperature):
    return logits.new_empty(logits.shape)


def _en_setup(ctx, inputs, output):
    logits, temperature = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, output[1], output[0])
    ctx.temperature = temperature


def _en_backward(ctx, grad, _grad_lse):
    if grad is None:
        return None, None
    logits, lse, ent = ctx.saved_tensors
    return entropy_triton_backward(grad.float().contiguous(), logits, lse, ent, ctx.temperature), None


entropy_triton.register_autograd(_en_backward, setup_context=_en_setup)


# ---------------------------------------------------------------------------------------------
# operator-signature wrappers (what the runtime dispatches to; same signatures as the references)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    V = logits.shape[-1]
    out, lse = log_softmax_triton(logits.reshape(-1, V), float(temperature))
    _check_lse(lse, "logits")
    return out.reshape(logits.shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    V = logits.shape[-1]
    lp, lse = token_logprobs_triton(logits.reshape(-1, V), targets.reshape(-1), float(temperature))
    _check_lse(lse, "logits")
    return lp.reshape(targets.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    V = logits.shape[-1]
    ent, lse = entropy_triton(logits.reshape(-1, V), float(temperature))
    _check_lse(lse, "logits")
    return ent.reshape(logits.shape[:-1])


def _call_reasons(request: Request) -> list[str]:
    return arch_reasons(request.platform.family, request.platform.arch)


for _op, _fn in (
    ("logprob.log_softmax", log_softmax),
    ("logprob.token_logprobs", token_logprobs),
    ("logprob.entropy", entropy),
):
    register(
        Implementation(
            op=_op,
            impl_id="triton.canonical_lse",
            version="1",
            fn=_fn,
            families=("cuda", "rocm"),
            untested_families=("rocm",),
            dtypes=_DTYPES,
            guarantees=frozenset({"row", "chunk", "run_to_run"}),
            priority=5,
            static_check=unavailable_reasons,
            call_check=_call_reasons,
        )
    )
