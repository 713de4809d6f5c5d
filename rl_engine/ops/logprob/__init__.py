"""Log-prob entry points: log-softmax, selected-token log-probs, entropy, and the fused LM head.

All four compute from the same canonical log-sum-exp (docs/operators/logprob.md): the
vocabulary is reduced in fixed blocks of :data:`VOCAB_BLOCK` = 1024 columns at absolute offsets,
merged sequentially in block order, in fp32 from ``z = fl32(logits) / fl32(temperature)``. Hence
``token_logprobs(logits, t)[i] == log_softmax(logits)[i, t[i]]`` and the fused
``linear_token_logprobs(h, W, t) == token_logprobs(gemm.linear(h, W), t)``, bit for bit.

Outputs are **always float32** (also for bf16 logits): an importance ratio ``exp(lp_new -
lp_old)`` needs the log-prob's fp32 bits, and every token's value is computed in fp32 anyway.
"""

from __future__ import annotations

import math

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, check_finite, require_same_device, require_tensor

__all__ = ["VOCAB_BLOCK", "log_softmax", "token_logprobs", "entropy", "linear_token_logprobs"]

#: Vocabulary block of the canonical log-sum-exp (= the GEMM's column tile ``TILE_N``).
VOCAB_BLOCK = 1024
_INDEX_DTYPES = (torch.int64, torch.int32)


def _temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a Python float, got {type(temperature).__name__}")
    t = float(temperature)
    if not math.isfinite(t) or t <= 0.0:
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature!r}")
    if not math.isfinite(float(torch.tensor(t, dtype=torch.float32))) or float(torch.tensor(t, dtype=torch.float32)) == 0.0:
        raise ValueError(f"temperature: {temperature!r} is not representable as a positive finite float32")
    return t


def _logits(logits: object) -> torch.Tensor:
    require_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_ndim=1, finite=True)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary (last) dimension, got shape {tuple(logits.shape)}")
    return logits


def _targets(targets: object, lead: torch.Size, vocab: int, lead_name: str) -> torch.Tensor:
    require_tensor("targets", targets, dtypes=_INDEX_DTYPES)
    if targets.shape != lead:
        raise ValueError(f"targets: expected shape {tuple(lead)} (the leading dims of {lead_name}), got {tuple(targets.shape)}")
    if targets.numel() and targets.device.type != "meta":
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"targets: expected token ids in [0, {vocab}), got {bad} (mask ignored positions, e.g. -100, before calling)"
            )
    return targets


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    r"""Log-softmax over the last dimension at a temperature.

    .. math:: y_{\dots,j} = z_{\dots,j} - \log \sum_k e^{z_{\dots,k}}, \qquad
              z = \mathrm{fl}_{32}(\text{logits}) / \mathrm{fl}_{32}(\tau)

    Shapes:
        logits: ``[..., V]`` (fp32 or bf16); returns ``[..., V]`` **float32**.

    Contract ``logprob.log_softmax``: row invariant (a row depends only on itself), any split of
    the rows gives the same bits, deterministic; the log-sum-exp is the canonical blocked one
    (docs/operators/logprob.md). Backward: grad to ``logits`` in the logits dtype, row invariant.
    ``-inf`` logits are allowed (their log-prob is ``-inf``).

    Raises:
        TypeError / ValueError: wrong type, dtype, empty vocabulary, non-contiguous, NaN, a row
            that is entirely ``-inf``, overflow of ``logits / temperature``, or a temperature
            that is not a finite positive number (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    _logits(logits)
    t = _temperature(temperature)
    req = make_request("logprob.log_softmax", logits, features={"V": logits.shape[-1]})
    return dispatch(req, logits, t)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    r"""Log-probability of each target token under ``softmax(logits / temperature)``.

    .. math:: \mathrm{lp}_i = z_{i, t_i} - \log \sum_k e^{z_{i,k}}

    Shapes:
        logits: ``[..., V]``; targets: ``[...]`` (int64 or int32, in ``[0, V)``);
        returns ``[...]`` **float32**.

    Contract ``logprob.token_logprobs``: row invariant, chunk invariant over tokens,
    deterministic; raw-bit equal to ``log_softmax(logits, temperature)[..., t]`` and to
    :func:`linear_token_logprobs` on ``gemm.linear`` logits. Backward: grad to ``logits`` only
    (``(onehot − p) · g / τ`` rounded once to the logits dtype), row invariant.

    Raises:
        TypeError / ValueError: bad ``logits`` (as :func:`log_softmax`), ``targets`` of the wrong
            dtype or shape or out of range (ignore indices such as ``-100`` must be masked
            first), bad temperature.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    _logits(logits)
    _targets(targets, logits.shape[:-1], logits.shape[-1], "logits")
    t = _temperature(temperature)
    require_same_device(logits=logits, targets=targets)
    req = make_request("logprob.token_logprobs", logits, features={"V": logits.shape[-1]})
    return dispatch(req, logits, targets, t)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    r"""Entropy of ``softmax(logits / temperature)`` per row.

    .. math:: H_i = -\sum_j p_{ij} \log p_{ij} = \log s_i - t_i / s_i, \quad
              s_i = \sum_j e^{z_{ij} - m_i}, \; t_i = \sum_j e^{z_{ij} - m_i}(z_{ij} - m_i)

    Shapes:
        logits: ``[..., V]``; returns ``[...]`` **float32**.

    Contract ``logprob.entropy``: row invariant, deterministic; the same canonical block
    accumulation as the log-sum-exp, so it is raw-bit equal to the entropy of
    :func:`linear_token_logprobs`. Backward: ``−p (log p + H) · g / τ`` in the logits dtype.

    Raises:
        TypeError / ValueError: as :func:`log_softmax`.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    _logits(logits)
    t = _temperature(temperature)
    req = make_request("logprob.entropy", logits, features={"V": logits.shape[-1]})
    return dispatch(req, logits, t)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""LM head + selected-token log-prob (+ entropy) without materialising the ``[N, V]`` logits.

    .. math:: \ell = h W^\top \ (\text{rounded to } h\text{'s dtype}), \qquad
              \mathrm{lp}_i = \mathrm{token\_logprobs}(\ell, t, \tau)_i, \quad
              H_i = \mathrm{entropy}(\ell, \tau)_i

    The tokens are processed ``token_chunk`` rows at a time and the vocabulary ``vocab_chunk``
    columns at a time; each logits chunk is computed by the same tiled GEMM as
    ``gemm.linear`` and folded into the canonical log-sum-exp.

    Shapes:
        hidden: ``[..., H]`` (fp32 or bf16); weight: ``[V, H]`` (same dtype); targets: ``[...]``
        (int64/int32 in ``[0, V)``); returns ``[...]`` float32 log-probs, or
        ``(logprobs, entropy)`` when ``return_entropy``.

    Args:
        token_chunk: rows per chunk (any positive int; default: CPU 256, GPU sized from a memory
            budget, see docs/operators/logprob.md). No value changes a bit.
        vocab_chunk: vocabulary columns per chunk, a positive multiple of :data:`VOCAB_BLOCK`
            (default: CPU 4096, GPU sized from a memory budget). No value changes a bit.

    Contract ``logprob.linear_token_logprobs``: **raw-bit equal** to
    ``token_logprobs(gemm.linear(hidden, weight), targets, temperature)`` (and the entropy to
    ``entropy(gemm.linear(...))``), forward and backward (grads to ``hidden`` and ``weight``);
    invariant to ``token_chunk``, ``vocab_chunk``, batch composition and position;
    deterministic. Forward memory: ``O(token_chunk · vocab_chunk)`` beyond the outputs.
    Backward recomputes the logits twice (once per gradient) and holds
    ``O(token_chunk · V + N · vocab_chunk)``.

    Raises:
        TypeError / ValueError: bad dtype, shape, device, contiguity or NaN of any tensor;
            targets out of range; a chunk size that is not a positive int or a ``vocab_chunk``
            that is not a multiple of ``VOCAB_BLOCK``; bad temperature; logits that overflow
            (``hidden: ...``) or that are not finite because ``weight`` holds NaN or inf
            (``weight: ...``: the weight is read for this diagnosis only when a logits row is
            not finite; ``nan_policy("raise_all")`` scans it up front).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, min_ndim=1, finite=True)
    require_tensor("weight", weight, dtypes=(hidden.dtype,), ndim=2, non_empty=True, finite="param")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[-1]}] to match hidden's last dim, got {tuple(weight.shape)}")
    _targets(targets, hidden.shape[:-1], weight.shape[0], "hidden")
    t = _temperature(temperature)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy: expected a bool, got {type(return_entropy).__name__}")
    for name, val in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
            raise ValueError(f"{name}: expected a positive int or None, got {val!r}")
    if vocab_chunk is not None and vocab_chunk % VOCAB_BLOCK:
        raise ValueError(
            f"vocab_chunk: expected a multiple of VOCAB_BLOCK={VOCAB_BLOCK} (chunks must align with the "
            f"canonical log-sum-exp blocks), got {vocab_chunk}"
        )
    require_same_device(hidden=hidden, weight=weight, targets=targets)
    req = make_request(
        "logprob.linear_token_logprobs",
        hidden,
        features={"H": hidden.shape[-1], "V": weight.shape[0], "entropy": return_entropy},
    )
    try:
        return dispatch(
            req, hidden, weight, targets, t, return_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk
        )
    except ValueError as exc:
        # hidden is finite (checked above), so non-finite logits rows come from the weight (not
        # scanned under the default NaN policy) or from overflow: name the weight when it is the cause.
        if str(exc).startswith("hidden:"):
            check_finite("weight", weight, why="the LM head weight must be finite")
        raise
