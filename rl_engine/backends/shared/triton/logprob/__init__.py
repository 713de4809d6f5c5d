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

from rl_engine.backends._customop import wire_entropy, wire_log_softmax, wire_token_logprobs
from rl_engine.backends.shared.triton import register_triton
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


def _f32_contiguous(grad: torch.Tensor) -> torch.Tensor:
    """How the upstream gradient reaches the backward kernels: fp32, contiguous."""
    return grad.float().contiguous()


# ---------------------------------------------------------------------------------------------
# log_softmax


@torch.library.custom_op("rlk::log_softmax_triton", mutates_args=(), device_types="cuda")
def log_softmax_triton(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, _, lse, _ = _kernels().forward(logits, temperature, log_softmax=True)
    return out, lse


@torch.library.custom_op("rlk::log_softmax_triton_backward", mutates_args=(), device_types="cuda")
def log_softmax_triton_backward(grad: torch.Tensor, out: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    return _kernels().log_softmax_backward(grad, out, temperature, dtype)


wire_log_softmax(log_softmax_triton, log_softmax_triton_backward, prepare_grad=_f32_contiguous)


# ---------------------------------------------------------------------------------------------
# token_logprobs


@torch.library.custom_op("rlk::token_logprobs_triton", mutates_args=(), device_types="cuda")
def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, lp, lse, _ = _kernels().forward(logits, temperature, targets=targets)
    return lp, lse


@torch.library.custom_op("rlk::token_logprobs_triton_backward", mutates_args=(), device_types="cuda")
def token_logprobs_triton_backward(
    grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, temperature: float
) -> torch.Tensor:
    return _kernels().token_logprobs_backward(grad, logits, targets, lse, temperature)


wire_token_logprobs(token_logprobs_triton, token_logprobs_triton_backward, prepare_grad=_f32_contiguous)


# ---------------------------------------------------------------------------------------------
# entropy


@torch.library.custom_op("rlk::entropy_triton", mutates_args=(), device_types="cuda")
def entropy_triton(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, lse, ent = _kernels().forward(logits, temperature, entropy=True)
    return ent, lse


@torch.library.custom_op("rlk::entropy_triton_backward", mutates_args=(), device_types="cuda")
def entropy_triton_backward(
    grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, temperature: float
) -> torch.Tensor:
    return _kernels().entropy_backward(grad, logits, lse, ent, temperature)


wire_entropy(entropy_triton, entropy_triton_backward, prepare_grad=_f32_contiguous)


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


for _op, _fn in (
    ("logprob.log_softmax", log_softmax),
    ("logprob.token_logprobs", token_logprobs),
    ("logprob.entropy", entropy),
):
    register_triton(
        _op, "triton.canonical_lse", _fn, dtypes=_DTYPES, guarantees=frozenset({"row", "chunk", "run_to_run"})
    )
