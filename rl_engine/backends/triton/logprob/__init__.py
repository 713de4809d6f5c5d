"""Triton ``logprob.log_softmax``, ``logprob.token_logprobs`` and ``logprob.entropy`` for CUDA
(validated on sm90) and ROCm (declared, untested).

Same public semantics as the CPU implementation (``rl_engine/backends/cpu/logprob``): fp32
outputs for fp32 and bf16 logits, ``z = fl32(logits) / fl32(τ)``, the canonical blocked
log-sum-exp (1024-column blocks at absolute offsets merged in block order, the same merge
formulas), gradients to the logits in the logits dtype (rounded once), the same errors for
rows without a finite logit or that overflow where the NaN policy lets them be read back
(:mod:`rl_engine.backends._lse_checks`: not under the default). One row per program, fixed
reduction order: **row** and **chunk invariant** over rows, deterministic, forward and
backward. The GPU's ``exp``/``log`` and in-block summation tree differ from the CPU's, so the
two platforms' bits need not agree; each meets the contract's tolerances (see ``kernels.py``).

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

from typing import NamedTuple

import torch

from rl_engine.backends._lse_checks import check_lse
from rl_engine.backends._customop import wire_entropy, wire_log_softmax, wire_token_logprobs
from rl_engine.backends.triton import register_triton
from rl_engine.runtime.custom_ops import call_op

__all__ = [
    "log_softmax_triton",
    "token_logprobs_triton",
    "entropy_triton",
    "log_softmax",
    "token_logprobs",
    "entropy",
    "linear_token_logprobs_triton",
    "linear_token_logprobs",
    "Chunks",
    "workspace_bytes",
    "FORWARD_BUDGET_BYTES",
    "DX_MAX_COLUMNS",
]

_DTYPES = (torch.float32, torch.bfloat16)
#: Fused LM head chunk sizes (``_chunks``; none changes a bit, they set memory and GEMM shapes).
#: A forward-only call (scoring: no gradient wanted) holds one ``[rows, vocab_chunk]`` logits
#: chunk within :data:`FORWARD_BUDGET_BYTES`, up to :data:`FORWARD_MAX_ROWS` rows. A training
#: call (a gradient wanted) keeps every block it holds beside its inputs and outputs — the
#: forward's logits chunk, the backward's logits-gradient blocks and its fp32 accumulator —
#: within the size of ``hidden`` (``N·H`` elements of its dtype): about half of what Liger-Kernel's
#: fused linear cross-entropy holds (two ``[c, V]`` blocks, ``c`` the power of two at or above
#: ``N / ⌈V/H⌉``: at least about ``4·N·H`` bytes in bf16 whenever ``V >= 4·H``).
FORWARD_BUDGET_BYTES = 64 * 2**20
FORWARD_MAX_ROWS = 8192
ROW_QUANTUM = 64
VOCAB_BLOCK = 1024
#: The widest vocabulary chunk of the backward's ``grad hidden`` pass. Each chunk's chained
#: ``grad_input`` stores and reloads the fp32 ``[rows, H]`` accumulator (``8·rows·H`` bytes)
#: beside ``4·rows·chunk·H`` flops of products (the logits and the ``dx`` product): at 8192
#: columns that traffic is a few percent of the pass on an H200 (4.8 TB/s, about 990 dense
#: bf16 TFLOP/s).
DX_MAX_COLUMNS = 8192


class Chunks(NamedTuple):
    """The chunk sizes of one fused LM-head call (``_chunks``), in the custom op's argument order.

    ``fwd_rows`` × ``fwd_cols``: the forward's logits chunk. ``dx_rows`` × ``dx_cols``: the
    backward's ``grad hidden`` pass — per ``dx_rows`` tokens, the vocabulary in chunks of
    ``dx_cols`` columns chained through an fp32 ``[dx_rows, H]`` accumulator. ``dw_cols``: the
    ``grad weight`` pass — per ``dw_cols`` vocabulary rows, the logits gradient of all ``N``
    tokens; when ``dx_rows`` covers every token and ``dw_cols == dx_cols`` the two share one pass
    (one logits product fewer). Vocabulary chunks are multiples of :data:`VOCAB_BLOCK`."""

    fwd_rows: int
    fwd_cols: int
    dx_rows: int
    dx_cols: int
    dw_cols: int


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
    dx_rows: int,
    dx_cols: int,
    dw_cols: int,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [N], entropy [N] or [0], lse [N])`` fp32; ``hidden [N, H]``, ``weight [V, H]``;
    the chunk sizes are :class:`Chunks` (the backward's three are kept for the backward)."""
    return _fused().forward(hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk,
                            kept_threshold, kept_boundary, fp32_logits)


@linear_token_logprobs_triton.register_fake
def _(hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk, dx_rows, dx_cols, dw_cols,
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
    dx_rows: int,
    dx_cols: int,
    dw_cols: int,
    need_hidden: bool,
    need_weight: bool,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dhidden [N, H] or [0], dweight [V, H] or [0])`` in the inputs' dtype (``fused.backward``)."""
    return _fused().backward(grad_logprobs, grad_ent, hidden, weight, targets, lse, ent, temperature, dx_rows, dx_cols,
                             dw_cols, need_hidden, need_weight, kept_threshold, kept_boundary, fp32_logits)


@linear_token_logprobs_triton_backward.register_fake
def _(grad_logprobs, grad_ent, hidden, weight, targets, lse, ent, temperature, dx_rows, dx_cols, dw_cols,
      need_hidden, need_weight, kept_threshold=None, kept_boundary=None, fp32_logits=False):
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
    )


def _lt_setup(ctx, inputs, output):
    (hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk, dx_rows, dx_cols, dw_cols,
     kept_threshold, kept_boundary, fp32_logits) = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, targets, output[2], output[1], kept_threshold, kept_boundary)
    ctx.args = (temperature, dx_rows, dx_cols, dw_cols, fp32_logits)


def _lt_backward(ctx, g_lp, g_ent, _g_lse):
    hidden, weight, targets, lse, ent, kept_threshold, kept_boundary = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * 13
    if (g_lp is None and g_ent is None) or not (need_h or need_w):
        return none
    temperature, dx_rows, dx_cols, dw_cols, fp32_logits = ctx.args
    dh, dw = call_op(
        linear_token_logprobs_triton_backward,
        _f32_contiguous(g_lp) if g_lp is not None else None,
        _f32_contiguous(g_ent) if (g_ent is not None and ent.numel()) else None,
        hidden, weight, targets, lse, ent, temperature, dx_rows, dx_cols, dw_cols, need_h, need_w,
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


def _chunks(n: int, h: int, v: int, dtype: torch.dtype, token_chunk: int | None, vocab_chunk: int | None, *,
            training: bool, fp32_logits: bool = False) -> Chunks:
    """The chunk sizes of a fused LM-head call over ``hidden [n, h]`` of ``dtype``, ``weight [v, h]``.

    Pure arithmetic (no triton import). An explicit ``token_chunk`` sets ``fwd_rows`` and
    ``dx_rows`` (one at or above ``n``: the shared backward pass, four GEMMs instead of five, for
    ``n·(4·h + dx_cols·e)`` bytes), an explicit ``vocab_chunk`` every vocabulary chunk.
    Defaults, with ``e`` the bytes of a logits element held (the dtype's; ``fp32_logits``: 4 in
    the forward, 4 + the dtype's in the backward, whose gradient block is separate) and
    ``B = n·h·`` the dtype's bytes (the size of ``hidden``):

    * forward: the most rows up to :data:`FORWARD_MAX_ROWS` and the widest chunk with
      ``rows·cols·e`` within :data:`FORWARD_BUDGET_BYTES`, and within ``B`` when ``training``;
    * ``grad hidden``: ``dx_cols`` the widest chunk up to :data:`DX_MAX_COLUMNS` whose logits
      block is no larger than the fp32 accumulator (``cols·e <= 4·h`` per row), ``dx_rows`` the
      most rows with ``rows·(4·h + dx_cols·e) <= B`` (no accumulator when one chunk covers
      ``v``);
    * ``grad weight``: the ``grad hidden`` pass's chunk when that pass fits ``B`` with all ``n``
      rows (one shared pass), else the widest chunk with ``n·cols·e <= B``.

    Rows are multiples of :data:`ROW_QUANTUM` and columns of :data:`VOCAB_BLOCK`, at least one
    of each, never more rows than ``n`` nor more columns than ``v`` rounded up to a block. So a
    training call holds at most ``B`` beside its inputs and outputs (:func:`workspace_bytes`; plus
    the forward's 16 bytes of fold state per row) wherever those minimums fit in ``B``: the
    ``grad weight`` pass's ``[n, 1024]`` block (``h·`` the dtype's bytes ``>= 1024·e``: every
    16-bit LM head of ``h >= 1024``; fp32 logits need ``h >= 3072``) and ``ROW_QUANTUM`` rows of
    the ``grad hidden`` pass (``n >= 256`` at ``h = 4096``, bf16). Below them it holds those
    minimums (``tests/backends/triton/test_linear_logprob_triton.py -k chunks``).
    """
    es = torch.finfo(dtype).bits // 8
    fwd_e = 4 if fp32_logits else es
    bwd_e = 4 + es if fp32_logits else es
    n1 = max(n, 1)
    v_cols = -(-v // VOCAB_BLOCK) * VOCAB_BLOCK
    budget = n1 * h * es

    def widest(rows: int, limit: int, e: int) -> int:  # vocabulary columns: at least one block
        return min(v_cols, max(1, limit // (rows * e * VOCAB_BLOCK)) * VOCAB_BLOCK)

    def rows_within(limit: int, per_row: int) -> int:  # token rows: at least one quantum
        return max(ROW_QUANTUM, limit // per_row // ROW_QUANTUM * ROW_QUANTUM)

    fwd_budget = min(FORWARD_BUDGET_BYTES, budget) if training else FORWARD_BUDGET_BYTES
    fwd_rows = token_chunk or min(n1, FORWARD_MAX_ROWS, rows_within(fwd_budget, VOCAB_BLOCK * fwd_e))
    fwd_cols = vocab_chunk or widest(min(fwd_rows, n1), fwd_budget, fwd_e)
    dx_cols = vocab_chunk or min(v_cols, DX_MAX_COLUMNS, max(VOCAB_BLOCK, 4 * h // bwd_e // VOCAB_BLOCK * VOCAB_BLOCK))
    per_row = (4 * h if v > dx_cols else 0) + dx_cols * bwd_e
    fits = n1 * per_row <= budget  # the grad-hidden pass over every token at once
    dx_rows = token_chunk or (n1 if fits else min(n1, rows_within(budget, per_row)))
    shared = dx_rows >= n1 and (token_chunk is not None or fits)
    dw_cols = vocab_chunk or (dx_cols if shared else widest(n1, budget, bwd_e))
    return Chunks(fwd_rows, fwd_cols, dx_rows, dx_cols, dw_cols)


def workspace_bytes(chunks: Chunks, n: int, h: int, v: int, dtype: torch.dtype, *, fp32_logits: bool = False,
                    need_hidden: bool = True, need_weight: bool = True) -> int:
    """The most bytes a fused LM-head forward + backward with ``chunks`` holds at once beside its
    inputs and outputs (``fused.forward`` / ``fused.backward``): the forward's logits chunk and
    fold state, or the backward's gradient block(s) and fp32 accumulator, whichever is larger.
    Pure arithmetic, the model the default chunks are sized by and the GPU peak-memory test
    checks against the allocator."""
    es = torch.finfo(dtype).bits // 8
    fwd_e, bwd_e = (4, 4 + es) if fp32_logits else (es, es)
    rows = min(chunks.fwd_rows, n)
    phases = [rows * min(chunks.fwd_cols, v) * fwd_e + 4 * 4 * rows]
    shared = need_hidden and need_weight and chunks.dx_rows >= n and chunks.dw_cols == chunks.dx_cols
    if need_weight:
        phases.append(n * min(chunks.dw_cols, v) * bwd_e + (4 * n * h if shared and v > chunks.dw_cols else 0))
    if need_hidden and not shared:
        rows = min(chunks.dx_rows, n)
        phases.append(rows * (min(chunks.dx_cols, v) * bwd_e + (4 * h if v > chunks.dx_cols else 0)))
    return max(phases)


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
    training = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lp, ent, lse = call_op(
        linear_token_logprobs_triton, h2, weight, targets.reshape(-1), float(temperature), bool(return_entropy),
        *_chunks(h2.shape[0], H, weight.shape[0], hidden.dtype, token_chunk, vocab_chunk, training=training,
                 fp32_logits=fp32_logits),
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
