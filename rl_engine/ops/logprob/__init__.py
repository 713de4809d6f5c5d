"""Log-prob entry points: log-softmax, selected-token log-probs, entropy, and the fused LM head.

All four compute from the same canonical log-sum-exp (docs/operators/logprob.md): the
vocabulary is reduced in fixed blocks of :data:`VOCAB_BLOCK` = 1024 columns at absolute offsets,
merged sequentially in block order, in fp32 from ``z = fl32(logits) / fl32(temperature)``. Hence
``token_logprobs(logits, t)[i] == log_softmax(logits)[i, t[i]]`` and the fused
``linear_token_logprobs(h, W, t) == token_logprobs(gemm.linear(h, W), t)``, bit for bit.

Outputs are **always float32** (also for bf16 logits): an importance ratio ``exp(lp_new -
lp_old)`` needs the log-prob's fp32 bits, and every token's value is computed in fp32 anyway.

**Processed log-probs** (top-k / top-p replay): every op takes ``kept``, a
:class:`~rl_engine.ops.logprob.kept.KeptSet` record per row (the kept set of the sampling step,
:mod:`~rl_engine.ops.logprob.kept`), and then computes the same quantities of the distribution
renormalised over the kept set — the entries outside it are ``-inf`` before the canonical
log-sum-exp — forward and backward, fused and chunked alike. ``kept=None`` is the full
vocabulary (and a keep-all record gives the same bits). See docs/operators/processed-logprobs.md.
"""

from __future__ import annotations

import functools
import math

import torch

from rl_engine.ops.gemm import check_out_dtype
from rl_engine.ops.logprob.kept import KEEP_ALL_BOUNDARY, KeptSet, canonical_prefix, kept_set, scale_logits
from rl_engine.runtime.registry import checks_indices, dispatch, make_request
from rl_engine.utils.checks import (FLOAT_DTYPES, check_finite, check_index_range, reads_back, require_same_device,
                                    require_tensor)

__all__ = ["VOCAB_BLOCK", "log_softmax", "token_logprobs", "entropy", "linear_token_logprobs", "KeptSet",
           "KEEP_ALL_BOUNDARY", "kept_set", "canonical_prefix", "scale_logits"]

#: Vocabulary block of the canonical log-sum-exp (= the CPU backend's ``TILE_N``).
VOCAB_BLOCK = 1024
_INDEX_DTYPES = (torch.int64, torch.int32)


def _temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a Python float, got {type(temperature).__name__}")
    t = float(temperature)
    if not math.isfinite(t) or t <= 0.0:
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature!r}")
    if not _positive_finite_fp32(t):
        raise ValueError(f"temperature: {temperature!r} is not representable as a positive finite float32")
    return t


@functools.lru_cache(maxsize=256)
def _positive_finite_fp32(t: float) -> bool:
    """Whether ``fl32(t)`` is finite and nonzero (the kernels divide by it). Cached per value: a
    loop calls with a handful of temperatures, and building the fp32 scalar costs host time."""
    v = float(torch.tensor(t, dtype=torch.float32))
    return math.isfinite(v) and v != 0.0


def _logits(logits: object) -> torch.Tensor:
    require_tensor("logits", logits, dtypes=FLOAT_DTYPES, min_ndim=1, finite=True)
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: expected a non-empty vocabulary (last) dimension, got shape {tuple(logits.shape)}")
    return logits


def _targets(targets: object, lead: torch.Size, vocab: int, lead_name: str, *, device_checked: bool = False
             ) -> torch.Tensor:
    """Validate ``targets``; ``device_checked``: the selected implementation asserts their range
    in its own kernel, so where they cannot be read back no separate check is launched."""
    require_tensor("targets", targets, dtypes=_INDEX_DTYPES)
    if targets.shape != lead:
        raise ValueError(f"targets: expected shape {tuple(lead)} (the leading dims of {lead_name}), got {tuple(targets.shape)}")
    if targets.numel() and targets.device.type != "meta" and not reads_back(targets):
        if not device_checked:  # a GPU tensor under the default NaN policy: a device-side assertion, no host read
            check_index_range("targets", targets, vocab, what="token ids")
    elif targets.numel() and targets.device.type != "meta":
        lo, hi = (int(v) for v in torch.aminmax(targets))
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"targets: expected token ids in [0, {vocab}), got {bad} (mask ignored positions, e.g. -100, before calling)"
            )
    return targets


def _kept(kept: object, lead: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
    """The backend keywords of a kept-set record (``{}`` for ``None``), validated."""
    if kept is None:
        return {}
    if not isinstance(kept, KeptSet):
        raise TypeError(f"kept: expected a rl_engine.ops.logprob.KeptSet or None, got {type(kept).__name__}")
    require_tensor("kept.threshold", kept.threshold, dtypes=(torch.float32,), contiguous=False)
    require_tensor("kept.boundary", kept.boundary, dtypes=_INDEX_DTYPES, contiguous=False)
    for name, t in (("kept.threshold", kept.threshold), ("kept.boundary", kept.boundary)):
        if t.shape != lead:
            raise ValueError(f"{name}: expected shape {tuple(lead)} (one record per row), got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (the logits' device), got {t.device}")
    thr = kept.threshold.reshape(-1).contiguous()
    if thr.numel() and thr.device.type != "meta":
        bad = (torch.isnan(thr) | torch.isposinf(thr)).any()
        if not reads_back(thr):  # GPU, default policy: assert on the device instead of reading back
            torch._assert_async(~bad, "kept.threshold: expected scaled logits below +inf (no NaN)")
        elif bool(bad):
            raise ValueError("kept.threshold: expected scaled logits below +inf (no NaN), got NaN or +inf")
    return {"kept_threshold": thr, "kept_boundary": kept.boundary.reshape(-1).contiguous()}


_PROCESSED = frozenset({"processed"})
_FP32_LOGITS = frozenset({"fp32_logits"})


def _variants(kw: dict) -> frozenset[str]:
    """The contract variants a call's backend keywords use."""
    out = frozenset()
    if "kept_threshold" in kw:
        out |= _PROCESSED
    if "logits_dtype" in kw:
        out |= _FP32_LOGITS
    return out


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, kept: KeptSet | None = None) -> torch.Tensor:
    r"""Log-softmax over the last dimension at a temperature.

    .. math:: y_{\dots,j} = z_{\dots,j} - \log \sum_k e^{z_{\dots,k}}, \qquad
              z = \mathrm{fl}_{32}(\text{logits}) / \mathrm{fl}_{32}(\tau)

    With ``kept`` (records ``[...]``): the log-softmax renormalised over each row's kept set,
    ``-inf`` outside it; the gradient at an entry whose output is ``-inf`` is ``+0``.

    Shapes:
        logits: ``[..., V]`` (fp32 or bf16); kept: records ``[...]``; returns ``[..., V]`` **float32**.

    Contract ``logprob.log_softmax``: row invariant (a row depends only on itself), any split of
    the rows gives the same bits, deterministic; the log-sum-exp is the canonical blocked one
    (docs/operators/logprob.md). Backward: grad to ``logits`` in the logits dtype, row invariant.
    ``-inf`` logits are allowed (their log-prob is ``-inf``).

    Raises:
        TypeError / ValueError: wrong type, dtype, empty vocabulary, non-contiguous, NaN or
            overflow of ``logits / temperature`` (where the NaN policy scans ``logits``), a row
            that is entirely ``-inf`` (where it may be read back: :mod:`rl_engine.utils.checks`),
            or a temperature that is not a finite positive number (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    _logits(logits)
    t = _temperature(temperature)
    kw = _kept(kept, logits.shape[:-1], logits.device)
    req = make_request("logprob.log_softmax", logits, features={"V": logits.shape[-1]}, variants=_variants(kw))
    return dispatch(req, logits, t, **kw)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   kept: KeptSet | None = None) -> torch.Tensor:
    r"""Log-probability of each target token under ``softmax(logits / temperature)``.

    .. math:: \mathrm{lp}_i = z_{i, t_i} - \log \sum_{k \in K_i} e^{z_{i,k}}

    ``K_i`` is the whole vocabulary, or with ``kept`` the kept set of row ``i`` together with its
    target (the processed log-prob of a top-k / top-p sampling step: raw-bit equal to what the
    rollout reported for the same record, logits and temperature; the target is always counted —
    it was drawn from the kept set — so logits that drifted from the rollout's still give a
    finite log-prob, whose difference shows the drift).

    Shapes:
        logits: ``[..., V]``; targets: ``[...]`` (int64 or int32, in ``[0, V)``); kept: records
        ``[...]``; returns ``[...]`` **float32**.

    Contract ``logprob.token_logprobs``: row invariant, chunk invariant over tokens,
    deterministic; raw-bit equal to ``log_softmax(logits, temperature)[..., t]`` and to
    :func:`linear_token_logprobs` on ``gemm.linear`` logits. Backward: grad to ``logits`` only
    (``(onehot − p) · g / τ`` rounded once to the logits dtype), row invariant.

    Raises:
        TypeError / ValueError: bad ``logits`` (as :func:`log_softmax`), ``targets`` of the wrong
            dtype or shape or out of range (ignore indices such as ``-100`` must be masked
            first), bad temperature, a ``kept`` record of the wrong type, dtype, shape or device,
            or a NaN or ``+inf`` threshold. An out-of-range target on a GPU under the default
            policy, which reads nothing back, stops the process at a device-side assertion
            instead (``docs/design/host-path.md``).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    _logits(logits)
    kw = _kept(kept, logits.shape[:-1], logits.device)
    req = make_request("logprob.token_logprobs", logits, features={"V": logits.shape[-1]}, variants=_variants(kw))
    _targets(targets, logits.shape[:-1], logits.shape[-1], "logits", device_checked=checks_indices(req))
    t = _temperature(temperature)
    require_same_device(logits=logits, targets=targets)
    return dispatch(req, logits, targets, t, **kw)


def entropy(logits: torch.Tensor, temperature: float = 1.0, *, kept: KeptSet | None = None) -> torch.Tensor:
    r"""Entropy of ``softmax(logits / temperature)`` per row.

    .. math:: H_i = -\sum_j p_{ij} \log p_{ij} = \log s_i - t_i / s_i, \quad
              s_i = \sum_j e^{z_{ij} - m_i}, \; t_i = \sum_j e^{z_{ij} - m_i}(z_{ij} - m_i)

    With ``kept``: the entropy of the distribution renormalised over each row's kept set.

    Shapes:
        logits: ``[..., V]``; kept: records ``[...]``; returns ``[...]`` **float32**.

    Contract ``logprob.entropy``: row invariant, deterministic; the same canonical block
    accumulation as the log-sum-exp, so it is raw-bit equal to the entropy of
    :func:`linear_token_logprobs`. Backward: ``−p (log p + H) · g / τ`` in the logits dtype.

    Raises:
        TypeError / ValueError: as :func:`log_softmax`.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    _logits(logits)
    t = _temperature(temperature)
    kw = _kept(kept, logits.shape[:-1], logits.device)
    req = make_request("logprob.entropy", logits, features={"V": logits.shape[-1]}, variants=_variants(kw))
    return dispatch(req, logits, t, **kw)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    kept: KeptSet | None = None,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""LM head + selected-token log-prob (+ entropy) without materialising the ``[N, V]`` logits.

    .. math:: \ell = h W^\top \ (\text{rounded to } h\text{'s dtype, or to fp32}), \qquad
              \mathrm{lp}_i = \mathrm{token\_logprobs}(\ell, t, \tau)_i, \quad
              H_i = \mathrm{entropy}(\ell, \tau)_i

    The tokens are processed ``token_chunk`` rows at a time and the vocabulary ``vocab_chunk``
    columns at a time; each logits chunk is computed by the same GEMM as
    ``gemm.linear`` and folded into the canonical log-sum-exp.

    Shapes:
        hidden: ``[..., H]`` (fp32 or bf16); weight: ``[V, H]`` (same dtype); targets: ``[...]``
        (int64/int32 in ``[0, V)``); returns ``[...]`` float32 log-probs, or
        ``(logprobs, entropy)`` when ``return_entropy``.

    Args:
        token_chunk: rows per chunk (any positive int; default: CPU 256, GPU sized from a memory
            budget — a training call holds at most about the size of ``hidden`` beside its
            inputs and outputs, see docs/operators/logprob.md; on the GPU a value at or above
            the token count makes the backward one shared pass, one GEMM fewer for an fp32
            ``[N, H]`` accumulator more). No value changes a bit.
        vocab_chunk: vocabulary columns per chunk, a positive multiple of :data:`VOCAB_BLOCK`
            (default: CPU 4096, GPU sized from the same budget). No value changes a bit.
        kept: kept-set records ``[...]`` (one per target): the processed log-probs (and
            entropy) renormalised over each row's kept set, each chunk masked with absolute
            column ids — raw-bit equal to ``token_logprobs(gemm.linear(hidden, weight), targets,
            temperature, kept=kept)``, forward and backward.
        logits_dtype: ``None`` (the logits are rounded to ``hidden``'s dtype, as
            ``gemm.linear`` gives them) or ``torch.float32``: the **fp32 LM-head variant** for
            bf16 inputs — the logits are the GEMM's sums rounded once to fp32 (the bits of
            ``gemm.linear(hidden, weight, out_dtype=torch.float32)``), log-probs and entropy
            computed from them, the logits gradient formed in fp32 and rounded once to bf16
            before the backward products; raw-bit equal to the unfused path on the fp32
            logits, forward and backward.

    Contract ``logprob.linear_token_logprobs``: **raw-bit equal** to
    ``token_logprobs(gemm.linear(hidden, weight), targets, temperature)`` (and the entropy to
    ``entropy(gemm.linear(...))``), forward and backward (grads to ``hidden`` and ``weight``);
    invariant to ``token_chunk``, ``vocab_chunk``, batch composition and position;
    deterministic. Forward memory: ``O(token_chunk · vocab_chunk)`` beyond the outputs.
    Backward recomputes the logits (CPU: once per gradient, holding
    ``O(token_chunk · V + N · vocab_chunk)``; GPU: once or twice, holding
    ``O(N · vocab_chunk + token_chunk · (H + vocab_chunk))``).

    Raises:
        TypeError / ValueError: bad dtype, shape, device or contiguity of any tensor, NaN in
            ``hidden`` where the NaN policy scans it (:mod:`rl_engine.utils.checks`); targets
            out of range (on a GPU under the default policy a device-side assertion instead); a
            chunk size that is not a positive int or a ``vocab_chunk`` that is not a multiple of
            ``VOCAB_BLOCK``; bad temperature; a bad ``kept`` record or ``logits_dtype`` other
            than ``None``, ``hidden``'s dtype or ``torch.float32``; logits that overflow
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
    kw = _kept(kept, hidden.shape[:-1], hidden.device)
    ldt = check_out_dtype("logits_dtype", logits_dtype, hidden.dtype)
    if ldt is not None:
        kw["logits_dtype"] = ldt
    req = make_request(
        "logprob.linear_token_logprobs",
        hidden,
        features={"H": hidden.shape[-1], "V": weight.shape[0], "entropy": return_entropy},
        variants=_variants(kw),
    )
    try:
        return dispatch(
            req, hidden, weight, targets, t, return_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk, **kw
        )
    except ValueError as exc:
        # hidden is finite (checked above), so non-finite logits rows come from the weight (not
        # scanned under the default NaN policy) or from overflow: name the weight when it is the cause.
        if str(exc).startswith("hidden:"):
            check_finite("weight", weight, why="the LM head weight must be finite")
        raise
