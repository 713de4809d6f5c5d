"""Invariant CPU log-prob operators, all built on the canonical log-sum-exp (:mod:`.lse`).

* ``rlk::log_softmax_cpu``, ``rlk::token_logprobs_cpu``, ``rlk::entropy_cpu`` take logits
  ``[R, V]``; they and their backward ops (``*_backward``) return fp32 values and gradients in
  the logits dtype.
* ``rlk::linear_token_logprobs_cpu`` fuses the LM head: for each token chunk it walks the
  vocabulary in chunks, computes that logits chunk with
  :func:`~rl_engine.backends.cpu.common.exact_matmul` (the exact bits ``gemm.linear`` gives for
  those rows and columns), and feeds it to the canonical accumulator, so it never holds more than
  ``[token_chunk, vocab_chunk]`` logits. Forward outputs are raw-bit equal to the unfused
  ``token_logprobs(linear(h, W))`` / ``entropy(linear(h, W))``.

Fused backward (bitwise equal to the unfused path's backward, see docs/operators/logprob.md):

* ``dhidden``: per token chunk, recompute the logits for the whole vocabulary, form the
  gradient of the logits ``[token_chunk, V]`` in the hidden dtype exactly as the unfused ops do,
  and multiply by the weight with one ``exact_matmul`` over ``K = V`` — the same call the
  ``gemm.linear`` backward makes, and row invariant, so each row's bits match;
* ``dweight``: per vocabulary chunk, recompute the logits of **all** tokens for that chunk, form
  the logits gradient ``[T, vocab_chunk]`` and multiply its transpose by the hidden states with
  one ``exact_matmul`` over ``K = T`` — again the ``gemm.linear`` backward's call, row (= vocab
  row) invariant.

Both passes recompute the logits (two extra GEMMs) so memory stays bounded by
``O(token_chunk · V + T · vocab_chunk)`` instead of ``O(T · V)``.

**Kept sets** (``kept_threshold`` / ``kept_boundary``, one record per row: top-k / top-p
replay): every op masks the scaled logits of the entries outside a row's kept set to ``-inf``
before the canonical accumulation (:func:`~.lse.mask_kept`, per vocabulary chunk with absolute
column ids in the fused op; the target of a token log-prob counts as kept), so the values are
those of the renormalised distribution and the fused op stays raw-bit equal to the unfused one;
gradients at dropped entries are ``+0``.

**fp32 logits** (``fp32_logits`` of the fused op, for bf16 inputs): the logits chunks are the
exact sums rounded once to float32 (``exact_matmul(..., out_dtype=float32)``, the bits of
``gemm.linear(h, W, out_dtype=torch.float32)``), never rounded to bf16; the logits gradient is
formed in fp32 (both outputs' terms added in fp32) and rounded once to the inputs' dtype before
the two backward products — what the unfused ``token_logprobs`` / ``entropy`` backward followed
by the fp32-output ``gemm.linear`` backward does.
"""

from __future__ import annotations

import torch

from rl_engine.backends._lse_checks import check_lse
from rl_engine.backends._customop import wire_entropy, wire_log_softmax, wire_token_logprobs
from rl_engine.backends.cpu.common import exact_matmul
from rl_engine.backends.cpu.logprob.lse import (
    VOCAB_BLOCK,
    LseAccumulator,
    finish_grad,
    grad_entropy,
    grad_log_softmax,
    grad_logprob,
    mask_kept,
    scale_logits,
)
from rl_engine.runtime.custom_ops import call_op
from rl_engine.runtime.registry import Implementation, register

__all__ = [
    "VOCAB_BLOCK",
    "DEFAULT_TOKEN_CHUNK",
    "DEFAULT_VOCAB_CHUNK",
    "log_softmax",
    "token_logprobs",
    "entropy",
    "linear_token_logprobs",
]

_DTYPES = (torch.float32, torch.bfloat16)
#: Default rows per chunk of the fused LM head (memory only: the exact GEMM's rows are independent).
DEFAULT_TOKEN_CHUNK = 256
#: Default vocabulary columns per chunk of the fused LM head (a multiple of VOCAB_BLOCK).
DEFAULT_VOCAB_CHUNK = 4 * VOCAB_BLOCK


def _stats(logits2: torch.Tensor, temperature: float, entropy: bool, kept_threshold=None, kept_boundary=None,
           targets=None):
    z, _ = mask_kept(scale_logits(logits2, temperature), 0, kept_threshold, kept_boundary, targets)
    acc = LseAccumulator(z.shape[0], entropy=entropy, vocab_size=z.shape[1])
    acc.update(z, 0)
    return z, acc.finish()


def _as_is(grad: torch.Tensor) -> torch.Tensor:
    """The upstream gradient of ``token_logprobs`` / ``entropy``, passed on unchanged."""
    return grad


# ---------------------------------------------------------------------------------------------
# log_softmax


@torch.library.custom_op("rlk::log_softmax_cpu", mutates_args=(), device_types="cpu")
def log_softmax_cpu(logits: torch.Tensor, temperature: float, kept_threshold: torch.Tensor | None = None,
                    kept_boundary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    z, res = _stats(logits, temperature, False, kept_threshold, kept_boundary)
    return z - res.lse.unsqueeze(1), res.lse


@torch.library.custom_op("rlk::log_softmax_cpu_backward", mutates_args=(), device_types="cpu")
def log_softmax_cpu_backward(grad: torch.Tensor, out: torch.Tensor, temperature: float, dtype: torch.dtype,
                             masked: bool = False) -> torch.Tensor:
    return finish_grad(grad_log_softmax(out, grad, masked), temperature, dtype)


wire_log_softmax(log_softmax_cpu, log_softmax_cpu_backward, prepare_grad=torch.Tensor.contiguous)


# ---------------------------------------------------------------------------------------------
# token_logprobs


@torch.library.custom_op("rlk::token_logprobs_cpu", mutates_args=(), device_types="cpu")
def token_logprobs_cpu(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       kept_threshold: torch.Tensor | None = None,
                       kept_boundary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    z, res = _stats(logits, temperature, False, kept_threshold, kept_boundary, targets)
    z_t = z.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    return z_t - res.lse, res.lse


def _drop(dz: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``+0`` at the entries outside the kept set (none without a record)."""
    return dz if keep is None else dz.masked_fill_(~keep, 0.0)


@torch.library.custom_op("rlk::token_logprobs_cpu_backward", mutates_args=(), device_types="cpu")
def token_logprobs_cpu_backward(
    grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, temperature: float,
    kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
) -> torch.Tensor:
    z, keep = mask_kept(scale_logits(logits, temperature), 0, kept_threshold, kept_boundary, targets)
    return finish_grad(_drop(grad_logprob(z, 0, lse, targets.long(), grad), keep), temperature, logits.dtype)


wire_token_logprobs(token_logprobs_cpu, token_logprobs_cpu_backward, prepare_grad=_as_is)


# ---------------------------------------------------------------------------------------------
# entropy


@torch.library.custom_op("rlk::entropy_cpu", mutates_args=(), device_types="cpu")
def entropy_cpu(logits: torch.Tensor, temperature: float, kept_threshold: torch.Tensor | None = None,
                kept_boundary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _, res = _stats(logits, temperature, True, kept_threshold, kept_boundary)
    return res.entropy, res.lse


@torch.library.custom_op("rlk::entropy_cpu_backward", mutates_args=(), device_types="cpu")
def entropy_cpu_backward(
    grad: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, temperature: float,
    kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None,
) -> torch.Tensor:
    z, keep = mask_kept(scale_logits(logits, temperature), 0, kept_threshold, kept_boundary)
    return finish_grad(_drop(grad_entropy(z, lse, ent, grad), keep), temperature, logits.dtype)


wire_entropy(entropy_cpu, entropy_cpu_backward, prepare_grad=_as_is)


# ---------------------------------------------------------------------------------------------
# fused LM head + token log-prob (+ entropy)


@torch.library.custom_op("rlk::linear_token_logprobs_cpu", mutates_args=(), device_types="cpu")
def linear_token_logprobs_cpu(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    token_chunk: int,
    vocab_chunk: int,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N = hidden.shape[0]
    V = weight.shape[0]
    logits_dtype = torch.float32 if fp32_logits else None
    logprobs = torch.empty(N, dtype=torch.float32)
    lse = torch.empty(N, dtype=torch.float32)
    ent = torch.empty(N if return_entropy else 0, dtype=torch.float32)
    targets = targets.long()
    for r0 in range(0, N, token_chunk):
        h = hidden[r0 : r0 + token_chunk]
        tgt = targets[r0 : r0 + token_chunk]
        kt, kb = _kept_rows(kept_threshold, kept_boundary, r0, r0 + token_chunk)
        R = h.shape[0]
        acc = LseAccumulator(R, entropy=return_entropy, vocab_size=V)
        z_t = torch.empty(R, dtype=torch.float32)
        for c0 in range(0, V, vocab_chunk):
            z, _ = mask_kept(scale_logits(exact_matmul(h, weight[c0 : c0 + vocab_chunk], logits_dtype), temperature),
                             c0, kt, kb, tgt)
            acc.update(z, c0)
            local = tgt - c0
            hit = (local >= 0) & (local < z.shape[1])
            rows = torch.nonzero(hit).squeeze(1)
            z_t[rows] = z[rows, local[rows]]
            del z
        res = acc.finish()
        logprobs[r0 : r0 + R] = z_t - res.lse
        lse[r0 : r0 + R] = res.lse
        if return_entropy:
            ent[r0 : r0 + R] = res.entropy
    return logprobs, ent, lse


@linear_token_logprobs_cpu.register_fake
def _(hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk, kept_threshold=None,
      kept_boundary=None, fp32_logits=False):
    n = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return hidden.new_empty((n,), **f), hidden.new_empty((n if return_entropy else 0,), **f), hidden.new_empty((n,), **f)


def _kept_rows(kept_threshold: torch.Tensor | None, kept_boundary: torch.Tensor | None, r0: int, r1: int):
    if kept_threshold is None:
        return None, None
    return kept_threshold[r0:r1], kept_boundary[r0:r1]


def fused_dlogits(
    logits: torch.Tensor,
    start: int,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
    kept_threshold: torch.Tensor | None = None,
    kept_boundary: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of the logits block in the logits dtype, exactly as the unfused ops produce it:
    each op's gradient is rounded to the dtype on its own, and autograd adds the two (one IEEE
    addition in the dtype, which is commutative, so the order autograd uses does not matter).
    Entries outside the kept set (the target counts as kept) get ``+0``."""
    z, keep = mask_kept(scale_logits(logits, temperature), start, kept_threshold, kept_boundary, targets)
    out = None
    if g_lp is not None:
        out = finish_grad(_drop(grad_logprob(z, start, lse, targets, g_lp), keep), temperature, logits.dtype)
    if g_ent is not None:
        d_ent = finish_grad(_drop(grad_entropy(z, lse, ent, g_ent), keep), temperature, logits.dtype)
        out = d_ent if out is None else out + d_ent
    return out


@torch.library.custom_op("rlk::linear_token_logprobs_cpu_backward", mutates_args=(), device_types="cpu")
def linear_token_logprobs_cpu_backward(
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
    N, H = hidden.shape
    V = weight.shape[0]
    logits_dtype = torch.float32 if fp32_logits else None
    targets = targets.long()
    ent_ = ent if grad_ent is not None else None
    dhidden = hidden.new_zeros((N, H) if need_hidden else (0,))
    dweight = weight.new_zeros((V, H) if need_weight else (0,))
    if N == 0 or (grad_logprobs is None and grad_ent is None):
        return dhidden, dweight

    def rows(r0: int, r1: int):
        return (
            targets[r0:r1],
            lse[r0:r1],
            ent_[r0:r1] if ent_ is not None else None,
            grad_logprobs[r0:r1] if grad_logprobs is not None else None,
            grad_ent[r0:r1] if grad_ent is not None else None,
            temperature,
            *_kept_rows(kept_threshold, kept_boundary, r0, r1),
        )

    # The logits gradient block is stored in the inputs' dtype: in fp32-logits mode the fp32
    # gradient (both terms already added in fp32) is rounded to it once, here.
    if need_hidden:
        # Pass A: dh[rows] = dlogits[rows, :V] @ W, one K = V product per token chunk.
        w_t = weight.t()  # [H, V]
        for r0 in range(0, N, token_chunk):
            h = hidden[r0 : r0 + token_chunk]
            R = h.shape[0]
            args = rows(r0, r0 + R)
            dl = hidden.new_empty((R, V))
            for c0 in range(0, V, vocab_chunk):
                logits = exact_matmul(h, weight[c0 : c0 + vocab_chunk], logits_dtype)
                dl[:, c0 : c0 + logits.shape[1]] = fused_dlogits(logits, c0, *args)
            dhidden[r0 : r0 + R] = exact_matmul(dl, w_t)
            del dl
        del w_t
    if need_weight:
        # Pass B: dW[cols] = dlogits[:, cols]ᵀ @ h, one K = N product per vocabulary chunk.
        h_t = hidden.t()  # [H, N]
        for c0 in range(0, V, vocab_chunk):
            w = weight[c0 : c0 + vocab_chunk]
            C = w.shape[0]
            dl = hidden.new_empty((N, C))
            for r0 in range(0, N, token_chunk):
                h = hidden[r0 : r0 + token_chunk]
                dl[r0 : r0 + h.shape[0]] = fused_dlogits(exact_matmul(h, w, logits_dtype), c0, *rows(r0, r0 + h.shape[0]))
            dweight[c0 : c0 + C] = exact_matmul(dl.t(), h_t)
            del dl
    return dhidden, dweight


@linear_token_logprobs_cpu_backward.register_fake
def _(grad_logprobs, grad_ent, hidden, weight, targets, lse, ent, temperature, token_chunk, vocab_chunk, need_hidden,
      need_weight, kept_threshold=None, kept_boundary=None, fp32_logits=False):
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
    )


def _lt_setup(ctx, inputs, output):
    (hidden, weight, targets, temperature, return_entropy, token_chunk, vocab_chunk, kept_threshold, kept_boundary,
     fp32_logits) = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, targets, output[2], output[1], kept_threshold, kept_boundary)
    ctx.args = (temperature, token_chunk, vocab_chunk, fp32_logits)


def _lt_backward(ctx, g_lp, g_ent, _g_lse):
    hidden, weight, targets, lse, ent, kept_threshold, kept_boundary = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * 10
    if (g_lp is None and g_ent is None) or not (need_h or need_w):
        return none
    temperature, token_chunk, vocab_chunk, fp32_logits = ctx.args
    dh, dw = call_op(
        linear_token_logprobs_cpu_backward,
        g_lp.contiguous() if g_lp is not None else None,
        g_ent.contiguous() if (g_ent is not None and ent.numel()) else None,
        hidden,
        weight,
        targets,
        lse,
        ent,
        temperature,
        token_chunk,
        vocab_chunk,
        need_h,
        need_w,
        kept_threshold,
        kept_boundary,
        fp32_logits,
    )
    return (dh if need_h else None), (dw if need_w else None), *none[2:]


linear_token_logprobs_cpu.register_autograd(_lt_backward, setup_context=_lt_setup)


# ---------------------------------------------------------------------------------------------
# operator-signature wrappers (what the runtime dispatches to; same signatures as the references),
# each running its op's body directly in a plain no-grad eager call (``call_op``)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, kept_threshold: torch.Tensor | None = None,
                kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.shape[-1]
    out, lse = call_op(log_softmax_cpu, logits.reshape(-1, V), float(temperature), kept_threshold, kept_boundary)
    check_lse(lse, "logits", kept_threshold=kept_threshold)
    return out.reshape(logits.shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.shape[-1]
    lp, lse = call_op(token_logprobs_cpu, logits.reshape(-1, V), targets.reshape(-1), float(temperature),
                      kept_threshold, kept_boundary)
    check_lse(lse, "logits", kept_threshold=kept_threshold)
    return lp.reshape(targets.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0, *, kept_threshold: torch.Tensor | None = None,
            kept_boundary: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.shape[-1]
    ent, lse = call_op(entropy_cpu, logits.reshape(-1, V), float(temperature), kept_threshold, kept_boundary)
    check_lse(lse, "logits", kept_threshold=kept_threshold)
    return ent.reshape(logits.shape[:-1])


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
    lp, ent, lse = call_op(
        linear_token_logprobs_cpu,
        hidden.reshape(-1, H),
        weight,
        targets.reshape(-1),
        float(temperature),
        bool(return_entropy),
        int(token_chunk or DEFAULT_TOKEN_CHUNK),
        int(vocab_chunk or DEFAULT_VOCAB_CHUNK),
        kept_threshold,
        kept_boundary,
        logits_dtype == torch.float32 and hidden.dtype != torch.float32,
    )
    check_lse(lse, "hidden", "the logits hidden @ weight.T / temperature", kept_threshold=kept_threshold)
    lp = lp.reshape(targets.shape)
    return (lp, ent.reshape(targets.shape)) if return_entropy else lp


_GUARANTEES = frozenset({"row", "chunk", "run_to_run", "threads", "isa"})
_PROCESSED = frozenset({"processed"})
for _op, _fn, _variants in (
    ("logprob.log_softmax", log_softmax, _PROCESSED),
    ("logprob.token_logprobs", token_logprobs, _PROCESSED),
    ("logprob.entropy", entropy, _PROCESSED),
    ("logprob.linear_token_logprobs", linear_token_logprobs, _PROCESSED | {"fp32_logits"}),
):
    register(
        Implementation(
            op=_op,
            impl_id="cpu.canonical_lse",
            version="3",
            fn=_fn,
            families=("cpu",),
            dtypes=_DTYPES,
            guarantees=_GUARANTEES,
            priority=10,
            variants=_variants,
        )
    )
