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

``logprob.linear_token_logprobs`` (the fused LM head, ``rlk::linear_token_logprobs_triton``,
kernels in ``fused.py``): the Triton ``gemm.linear`` logits computed a chunk at a time and
folded into the same canonical log-sum-exp; forward outputs and both gradients are **raw-bit
equal to the unfused GPU path** ``token_logprobs(gemm.linear(h, W))`` / ``entropy(...)`` for any
``token_chunk`` and any ``vocab_chunk`` multiple of 1024 (``fused.py`` says why), never holding
the ``[N, V]`` logits.

Nothing here imports triton: the kernels (``kernels.py``, ``fused.py``) are imported on the
first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._lse_checks import check_lse
from rl_engine.backends._customop import wire_entropy, wire_log_softmax, wire_token_logprobs
from rl_engine.backends.triton import call_op, register_triton

__all__ = [
    "log_softmax_triton",
    "token_logprobs_triton",
    "entropy_triton",
    "log_softmax",
    "token_logprobs",
    "entropy",
    "linear_token_logprobs_triton",
    "linear_token_logprobs",
    "FORWARD_BUDGET_BYTES",
    "BACKWARD_BUDGET_BYTES",
]

_DTYPES = (torch.float32, torch.bfloat16)
#: Fused LM head default chunk sizes (``_chunks``): byte budgets of the forward ``[rows,
#: vocab_chunk]`` logits chunk and of the backward blocks (the vocabulary pass ``[N,
#: vocab_chunk]``; pass A ``[rows, V]``, used for ``dhidden`` only when its fp32 accumulator is
#: over ``fused.DX_ACCUMULATOR_BUDGET_BYTES``), and row caps. Pass A's cap keeps the dx GEMM
#: (``M`` = rows, output ``[rows, H]``) on the M <= 256 tile row of ``gemm/configs.py`` (64x128
#: tiles: 128 programs at H = 4096; 257..2048 rows would get 128x256 tiles, 48 programs at 320
#: rows).
FORWARD_BUDGET_BYTES = 64 * 2**20
BACKWARD_BUDGET_BYTES = 80 * 2**20
FORWARD_MAX_ROWS = 8192
BACKWARD_MAX_ROWS = 256
ROW_QUANTUM = 64
VOCAB_BLOCK = 1024


def _kernels():
    from rl_engine.backends.triton.logprob import kernels

    return kernels


def _fused():
    from rl_engine.backends.triton.logprob import fused

    return fused


def _f32_contiguous(grad: torch.Tensor) -> torch.Tensor:
    """How the upstream gradient reaches the backward kernels: fp32, contiguous."""
    return grad.float().contiguous()


# ---------------------------------------------------------------------------------------------
# log_softmax


@torch.library.custom_op("rlk::log_softmax_triton", mutates_args=(), device_types="cuda")
def log_softmax_triton(logits: torch.Tensor, temperature: float, kept_threshold: torch.Tensor | None = None,
                       kept_boundary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, _, lse, _ = _kernels().forward(logits, temperature, log_softmax=True, kept_threshold=kept_threshold,
                                        kept_boundary=kept_boundary)
    return out, lse


@torch.library.custom_op("rlk::log_softmax_triton_backward", mutates_args=(), device_types="cuda")
def log_softmax_triton_backward(grad: torch.Tensor, out: torch.Tensor, temperature: float, dtype: torch.dtype,
                                masked: bool = False) -> torch.Tensor:
    return _kernels().log_softmax_backward(grad, out, temperature, dtype, masked)


wire_log_softmax(log_softmax_triton, log_softmax_triton_backward, prepare_grad=_f32_contiguous)


# ---------------------------------------------------------------------------------------------
# token_logprobs


@torch.library.custom_op("rlk::token_logprobs_triton", mutates_args=(), device_types="cuda")
def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          kept_threshold: torch.Tensor | None = None,
                          kept_boundary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _, lp, lse, _ = _kernels().forward(logits, temperature, targets=targets, kept_threshold=kept_threshold,
                                       kept_boundary=kept_boundary)
    return lp, lse


@torch.library.custom_op("rlk::token_logprobs_triton_backward", mutates_args=(), device_types="cuda")
def token_logprobs_triton_backward(
    grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, temperature: float,
    kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
) -> torch.Tensor:
    return _kernels().token_logprobs_backward(grad, logits, targets, lse, temperature, kept_threshold, kept_boundary)


wire_token_logprobs(token_logprobs_triton, token_logprobs_triton_backward, prepare_grad=_f32_contiguous)


# ---------------------------------------------------------------------------------------------
# entropy


@torch.library.custom_op("rlk::entropy_triton", mutates_args=(), device_types="cuda")
def entropy_triton(logits: torch.Tensor, temperature: float, kept_threshold: torch.Tensor | None = None,
                   kept_boundary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, lse, ent = _kernels().forward(logits, temperature, entropy=True, kept_threshold=kept_threshold,
                                        kept_boundary=kept_boundary)
    return ent, lse


@torch.library.custom_op("rlk::entropy_triton_backward", mutates_args=(), device_types="cuda")
def entropy_triton_backward(
    grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, temperature: float,
    kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
) -> torch.Tensor:
    return _kernels().entropy_backward(grad, logits, lse, ent, temperature, kept_threshold, kept_boundary)


wire_entropy(entropy_triton, entropy_triton_backward, prepare_grad=_f32_contiguous)


# ---------------------------------------------------------------------------------------------
# fused LM head + token log-prob (+ entropy)


@torch.library.custom_op("rlk::linear_token_logprobs_triton", mutates_args=(), device_types="cuda")
def linear_token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    token_chunk: int,
    vocab_chunk: int,
    bwd_token_chunk: int,
    bwd_vocab_chunk: int,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [N], entropy [N] or [0], lse [N])`` fp32; ``hidden [N, H]``, ``weight [V, H]``."""
    return _fused().forward(hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk,
                            kept_threshold, kept_boundary, fp32_logits)


@linear_token_logprobs_triton.register_fake
def _(hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk, bwd_token_chunk, bwd_vocab_chunk,
      kept_threshold=None, kept_boundary=None, fp32_logits=False):
    n = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return hidden.new_empty((n,), **f), hidden.new_empty((n if return_entropy else 0,), **f), hidden.new_empty((n,), **f)


@torch.library.custom_op("rlk::linear_token_logprobs_triton_backward", mutates_args=(), device_types="cuda")
def linear_token_logprobs_triton_backward(
    grad_logprobs: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    temperature: float,
    token_chunk: int,
    vocab_chunk: int,
    need_hidden: bool,
    need_weight: bool,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden [N, H] or [0], dweight [V, H] or [0])`` in the inputs' dtype (``fused.backward``)."""
    return _fused().backward(grad_logprobs, grad_ent, hidden, weight, targets, lse, ent, temperature, token_chunk,
                             vocab_chunk, need_hidden, need_weight, kept_threshold, kept_boundary, fp32_logits)


@linear_token_logprobs_triton_backward.register_fake
def _(grad_logprobs, grad_ent, hidden, weight, targets, lse, ent, temperature, token_chunk, vocab_chunk,
      need_hidden, need_weight, kept_threshold=None, kept_boundary=None, fp32_logits=False):
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
    )


def _lt_setup(ctx, inputs, output):
    (hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk, bwd_token_chunk, bwd_vocab_chunk,
     kept_threshold, kept_boundary, fp32_logits) = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, targets, output[2], output[1], kept_threshold, kept_boundary)
    ctx.args = (temperature, bwd_token_chunk, bwd_vocab_chunk, fp32_logits)


def _lt_backward(ctx, g_lp, g_ent, _g_lse):
    hidden, weight, targets, lse, ent, kept_threshold, kept_boundary = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * 12
    if (g_lp is None and g_ent is None) or not (need_h or need_w):
        return none
    temperature, token_chunk, vocab_chunk, fp32_logits = ctx.args
    dh, dw = linear_token_logprobs_triton_backward(
        _f32_contiguous(g_lp) if g_lp is not None else None,
        _f32_contiguous(g_ent) if (g_ent is not None and ent.numel()) else None,
        hidden, weight, targets, lse, ent, temperature, token_chunk, vocab_chunk, need_h, need_w,
        kept_threshold, kept_boundary, fp32_logits,
    )
    return (dh if need_h else None), (dw if need_w else None), *none[2:]


linear_token_logprobs_triton.register_autograd(_lt_backward, setup_context=_lt_setup)


# ---------------------------------------------------------------------------------------------
# operator-signature wrappers (what the runtime dispatches to; same signatures as the references)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, kept_threshold: torch.Tensor | None = None,
                kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.shape[-1]
    out, lse = call_op(log_softmax_triton, logits.reshape(-1, V), float(temperature), kept_threshold, kept_boundary)
    check_lse(lse, "logits", kept_threshold=kept_threshold)
    return out.reshape(logits.shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.shape[-1]
    lp, lse = call_op(token_logprobs_triton, logits.reshape(-1, V), targets.reshape(-1), float(temperature),
                      kept_threshold, kept_boundary)
    check_lse(lse, "logits", kept_threshold=kept_threshold)
    return lp.reshape(targets.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0, *, kept_threshold: torch.Tensor | None = None,
            kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.shape[-1]
    ent, lse = call_op(entropy_triton, logits.reshape(-1, V), float(temperature), kept_threshold, kept_boundary)
    check_lse(lse, "logits", kept_threshold=kept_threshold)
    return ent.reshape(logits.shape[:-1])


def _chunks(n: int, v: int, dtype: torch.dtype, token_chunk: int | None, vocab_chunk: int | None
            ) -> tuple[int, int, int, int]:
    """``(forward rows, forward vocab chunk, backward pass-A rows, backward vocab chunk)``.

    Pure arithmetic (no triton import). Explicit ``token_chunk`` / ``vocab_chunk`` are used by
    both passes. Defaults: the forward takes up to :data:`FORWARD_MAX_ROWS` rows and the widest
    vocabulary chunk (a multiple of 1024) whose ``[rows, chunk]`` logits fit
    :data:`FORWARD_BUDGET_BYTES`; pass A takes up to :data:`BACKWARD_MAX_ROWS` rows whose
    ``[rows, V]`` block fits :data:`BACKWARD_BUDGET_BYTES`; the backward's vocabulary pass the widest chunk whose
    ``[N, chunk]`` block fits it. No choice changes a bit (``fused.py``); they set memory and
    GEMM efficiency."""
    es = torch.finfo(dtype).bits // 8
    n1 = max(n, 1)
    v_blocks = -(-v // VOCAB_BLOCK)

    def widest(rows: int, budget: int) -> int:
        return min(v_blocks, max(1, budget // (rows * es * VOCAB_BLOCK))) * VOCAB_BLOCK

    def rows_within(budget: int) -> int:
        return max(ROW_QUANTUM, budget // (v * es) // ROW_QUANTUM * ROW_QUANTUM)

    fwd_rows = token_chunk or min(n1, FORWARD_MAX_ROWS)
    bwd_rows = token_chunk or min(n1, BACKWARD_MAX_ROWS, rows_within(BACKWARD_BUDGET_BYTES))
    fwd_vc = vocab_chunk or widest(min(fwd_rows, n1), FORWARD_BUDGET_BYTES)
    bwd_vc = vocab_chunk or widest(n1, BACKWARD_BUDGET_BYTES)
    return fwd_rows, fwd_vc, bwd_rows, bwd_vc


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    H = hidden.shape[-1]
    h2 = hidden.reshape(-1, H)
    fp32_logits = logits_dtype == torch.float32 and hidden.dtype != torch.float32
    lp, ent, lse = call_op(
        linear_token_logprobs_triton, h2, weight, targets.reshape(-1), float(temperature), bool(return_entropy),
        *_chunks(h2.shape[0], weight.shape[0], torch.float32 if fp32_logits else hidden.dtype, token_chunk, vocab_chunk),
        kept_threshold, kept_boundary, fp32_logits,
    )
    check_lse(lse, "hidden", "the logits hidden @ weight.T / temperature", kept_threshold=kept_threshold)
    lp = lp.reshape(targets.shape)
    return (lp, ent.reshape(targets.shape)) if return_entropy else lp


_PROCESSED = frozenset({"processed"})
for _op, _fn, _variants in (
    ("logprob.log_softmax", log_softmax, _PROCESSED),
    ("logprob.token_logprobs", token_logprobs, _PROCESSED),
    ("logprob.entropy", entropy, _PROCESSED),
    ("logprob.linear_token_logprobs", linear_token_logprobs, _PROCESSED | {"fp32_logits"}),
):
    register_triton(
        _op, "triton.canonical_lse", _fn, dtypes=_DTYPES, guarantees=frozenset({"row", "chunk", "run_to_run"}),
        variants=_variants,
        # rlk_logprob_fwd asserts the targets' range where it reads them; the fused LM head's
        # kernels do not, so its entry point keeps the separate device check
        device_index_checks=_op == "logprob.token_logprobs",
    )
