"""Shared pieces of the loss family: input convention, reductions, :class:`LossOutput`, combine.

Convention: token tensors are ``[B, L]`` (``B`` sequences, ``L`` padded response length) with a
``mask`` of the same shape marking **active tokens** (1/True: the token enters the loss). Any
padding side, padded length or masked hole is allowed; only the ordered list of a sequence's
active tokens matters.

Reductions (``reduction=``, verl's ``loss_agg_mode`` names), with ``S_b = Σ_t m_{b,t} ℓ_{b,t}``,
``n_b`` active tokens in sequence ``b``, ``N = Σ_b n_b``, ``G`` = number of sequences with
``n_b > 0``:

==========================  =========================  ========================
reduction                   per-sequence term          denominator
==========================  =========================  ========================
``token-mean``              ``S_b``                    ``N``
``seq-mean-token-mean``     ``S_b / n_b``              ``G``
``seq-mean-token-sum``      ``S_b``                    ``G``
``seq-mean-token-sum-norm`` ``S_b``                    ``G · C`` (``C`` = ``loss_scale_factor``)
==========================  =========================  ========================

``loss = canonical_sum(terms) / denominator`` where ``canonical_sum`` adds the per-sequence terms
in ascending-value order: the loss is a function of the *set* of sequences, so it is the same
for any batch order, and micro-batches combine exactly (:func:`combine_microbatch_losses`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rl_engine.utils.reductions import canonical_sum
from rl_engine.utils.checks import FLOAT_DTYPES, reads_back, require_same_device, require_tensor, scans

__all__ = ["REDUCTIONS", "LossOutput", "loss_denominator", "combine_microbatch_losses"]

REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_OPTIONAL_TOKENS = ("is_weights",)
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LossOutput:
    """A reduced token loss and everything needed to combine it with other micro-batches.

    Attributes:
        loss: 0-dim float32 tensor, ``canonical_sum(seq_terms) / denominator``; differentiable.
        seq_terms: ``[B]`` float32 per-sequence contributions to the numerator; differentiable.
        denominator: the divisor used (see the reductions table in :mod:`rl_engine.ops.loss`).
        reduction: the reduction name.
        global_denominator: ``True`` when ``denominator`` was passed in by the caller (required
            to combine micro-batches), ``False`` when it was computed from this call's mask.
        kind: which metric set the statistics feed (``"policy"``, ``"kl"``, ``"aggregate"``,
            ``"entropy"``); parts of different kinds do not combine.
        stats: per-sequence statistics (``[B]`` each, detached) from which ``metrics`` are built.
        metrics: detached 0-dim tensors (clip fractions, ratio statistics, token counts, ...).
            Undefined statistics of a call without active tokens are NaN.
    """

    loss: torch.Tensor
    seq_terms: torch.Tensor
    denominator: float
    reduction: str
    global_denominator: bool
    kind: str
    stats: Mapping[str, torch.Tensor] = field(repr=False)
    metrics: Mapping[str, torch.Tensor] = field(repr=False)


# ---------------------------------------------------------------------------------- validation


def as_mask(mask: object) -> torch.Tensor:
    """Validate ``mask`` (``[B, L]``, bool or 0/1 numbers) and return it as bool."""
    require_tensor("mask", mask, dtypes=_MASK_DTYPES, ndim=2)
    assert isinstance(mask, torch.Tensor)
    if mask.dtype == torch.bool:
        return mask
    if mask.numel() and reads_back(mask) and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask: expected values in {0, 1} (or a bool tensor)")
    return mask != 0


def check_tokens(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Each given tensor is a float ``[B, L]`` tensor of ``mask``'s shape, on its device
    (``None`` only for the optional ``is_weights``)."""
    for name, t in tensors.items():
        if t is None:
            if name in _OPTIONAL_TOKENS:
                continue
            raise TypeError(f"{name}: expected a torch.Tensor, got NoneType")
        require_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=2, finite=True)
        if t.shape != mask.shape:
            raise ValueError(f"{name}: expected shape {tuple(mask.shape)} (the shape of mask), got {tuple(t.shape)}")
    require_same_device(mask=mask, **tensors)


def check_log_probs(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Each given tensor holds log-probabilities at the active tokens of ``mask``: finite and
    ``<= 0`` (``+5`` or ``±inf`` is no log-prob of a sampled token; the ratio ``exp(Δ)`` and the
    KL estimators would turn it into a silently clamped or NaN loss). Padding is not read.
    Like the NaN scan, it runs only where the NaN policy scans the tensor
    (:func:`~rl_engine.utils.checks.scans`: under the default, host tensors and not GPU ones;
    nothing under ``"propagate"``). Call after
    :func:`check_tokens` (shapes and devices already agree)."""
    for name, t in tensors.items():
        if t is None or not scans(t):
            continue
        bad = mask & ~(torch.isfinite(t) & (t <= 0))
        if bool(bad.any()):
            b, i = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(
                f"{name}: expected log-probabilities (finite and <= 0) at the active tokens of mask, "
                f"got {float(t[b, i])} at [{b}, {i}]"
            )


def check_number(name: str, value: object, *, low: float | None = None, low_open: bool = False,
                 high: float | None = None, allow_none: bool = False) -> float | None:
    """``value`` is a finite real number in the given range (message names the argument)."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    v = float(value)
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name}: expected a number {'>' if low_open else '>='} {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{name}: expected a number <= {high}, got {v}")
    return v


def check_choice(name: str, value: object, choices: Sequence[str], *, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}{' or None' if allow_none else ''}, got {value!r}")
    return value  # type: ignore[return-value]


def pad_empty_length(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``L == 0`` batches are padded to one inactive column (pad with +0; masks with False)."""
    return [None if t is None else F.pad(t, (0, 1)) for t in tensors]


# ---------------------------------------------------------------------------------- reductions


def loss_denominator(mask: torch.Tensor, reduction: str = "token-mean", *, loss_scale_factor: float | None = None) -> float:
    """The denominator ``reduction`` uses for the batch described by ``mask``.

    Compute it once on the **full** batch and pass it as ``denominator=`` to every micro-batch
    call; then the micro-batch gradients are exactly the full-batch gradients and
    :func:`combine_microbatch_losses` reproduces the full-batch loss bit for bit.

    Returns ``N`` (``token-mean``), ``G`` (``seq-mean-token-mean`` / ``-sum``) or ``G · C``
    (``seq-mean-token-sum-norm``, ``C = loss_scale_factor``), as a Python float; ``0.0`` when
    nothing is active.
    """
    m = as_mask(mask)
    check_choice("reduction", reduction, REDUCTIONS)
    if reduction == "token-mean":
        if loss_scale_factor is not None:
            raise ValueError("loss_scale_factor: only used with reduction 'seq-mean-token-sum-norm'")
        return float(m.sum())
    sequences = float(m.any(-1).sum()) if m.shape[-1] else 0.0
    if reduction == "seq-mean-token-sum-norm":
        c = check_number("loss_scale_factor", loss_scale_factor, low=0.0, low_open=True)
        return sequences * c
    if loss_scale_factor is not None:
        raise ValueError("loss_scale_factor: only used with reduction 'seq-mean-token-sum-norm'")
    return sequences


def resolve_denominator(mask: torch.Tensor, reduction: str, denominator: object, loss_scale_factor: object) -> tuple[float, bool]:
    """``(denominator to divide by, was it given)``. A computed 0 (nothing active) becomes 1."""
    check_choice("reduction", reduction, REDUCTIONS)
    if denominator is not None:
        den = check_number("denominator", denominator, low=0.0, low_open=True)
        if loss_scale_factor is not None:
            check_number("loss_scale_factor", loss_scale_factor, low=0.0, low_open=True)
        assert den is not None
        return den, True
    if reduction == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        raise ValueError(
            "loss_scale_factor: required with reduction 'seq-mean-token-sum-norm' (Dr. GRPO's constant C, "
            "e.g. the generation budget) unless denominator is given"
        )
    den = loss_denominator(mask, reduction, loss_scale_factor=loss_scale_factor)  # type: ignore[arg-type]
    return (den if den > 0 else 1.0), False


def resolve_and_pad(mask: torch.Tensor, reduction: str, denominator: object, loss_scale_factor: object,
                    *tensors: torch.Tensor | None) -> tuple[float, bool, torch.Tensor, list[torch.Tensor | None]]:
    """:func:`resolve_denominator`'s ``(den, given)``, then ``mask`` and the token ``tensors``
    (``[B, L]``), padded by :func:`pad_empty_length` when ``L == 0``: ``(den, given, mask, tensors)``."""
    den, given = resolve_denominator(mask, reduction, denominator, loss_scale_factor)
    if mask.shape[-1] == 0:
        *tensors, mask = pad_empty_length(*tensors, mask)
    return den, given, mask, list(tensors)


def _nan_if_empty(value: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(n > 0, value, torch.full_like(value, float("nan")))


def _sums(stats: Mapping[str, torch.Tensor], keys: Sequence[str]) -> list[torch.Tensor]:
    """``[tokens total, active sequences, *canonical sums of keys]`` in one batched pass."""
    tokens = stats["tokens"]
    rows = torch.stack([tokens, (tokens > 0).to(torch.float32), *(stats[k] for k in keys)])
    return list(canonical_sum(rows).unbind())


def _policy_metrics(stats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    N, G, low, high, dual, ratio_sum, log_ratio_sum = _sums(
        stats, ("clipped_low", "clipped_high", "dual_clipped", "ratio_sum", "log_ratio_sum")
    )
    Nc = torch.clamp(N, min=1.0)
    out = {"active_tokens": N.to(torch.int64), "active_sequences": G.to(torch.int64)}
    out["clip_frac"] = _nan_if_empty((low + high) / Nc, N)
    out["clip_frac_low"] = _nan_if_empty(low / Nc, N)
    out["clip_frac_high"] = _nan_if_empty(high / Nc, N)
    out["dual_clip_frac"] = _nan_if_empty(dual / Nc, N)
    out["ratio_mean"] = _nan_if_empty(ratio_sum / Nc, N)
    empty = torch.full((), float("nan"), device=N.device)
    out["ratio_min"] = _nan_if_empty(stats["ratio_min"].amin(), N) if stats["ratio_min"].numel() else empty
    out["ratio_max"] = _nan_if_empty(stats["ratio_max"].amax(), N) if stats["ratio_max"].numel() else empty
    out["approx_kl"] = _nan_if_empty(-log_ratio_sum / Nc, N)
    return out


def _mean_metrics(name: str) -> Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def metrics(stats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        N, G, total = _sums(stats, ("value_sum",))
        mean = total / torch.clamp(N, min=1.0)
        return {name: _nan_if_empty(mean, N), "active_tokens": N.to(torch.int64), "active_sequences": G.to(torch.int64)}

    return metrics


_METRICS: dict[str, Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "policy": _policy_metrics,
    "kl": _mean_metrics("kl"),
    "aggregate": _mean_metrics("mean"),
    "entropy": _mean_metrics("entropy"),
}


def _assemble(seq_terms: torch.Tensor, den: float, reduction: str, given: bool, kind: str, stats: Mapping[str, torch.Tensor]) -> LossOutput:
    total = canonical_sum(seq_terms)
    # a fill, not torch.tensor(den): on a GPU that would copy from pageable host memory and wait
    loss = total / torch.full((), den, dtype=torch.float32, device=seq_terms.device)
    stats = {k: v.detach() for k, v in stats.items()}
    with torch.no_grad():
        metrics = _METRICS[kind](stats)
    return LossOutput(loss, seq_terms, den, reduction, given, kind, stats, metrics)


def finish(seq_sum: torch.Tensor, tokens: torch.Tensor, stats: Mapping[str, torch.Tensor], reduction: str,
           den: float, given: bool, kind: str) -> LossOutput:
    """Per-sequence sums (from a kernel) → :class:`LossOutput` under ``reduction``."""
    if reduction == "seq-mean-token-mean":
        zero = torch.zeros((), dtype=seq_sum.dtype, device=seq_sum.device)
        seq_terms = torch.where(tokens > 0, seq_sum / torch.clamp(tokens, min=1.0), zero)
    else:
        seq_terms = seq_sum
    return _assemble(seq_terms, den, reduction, given, kind, stats)


def combine_microbatch_losses(parts: Sequence[LossOutput]) -> LossOutput:
    """The full-batch :class:`LossOutput` from the outputs of its micro-batches, bit for bit.

    Every part must come from the same operator and reduction, called with the same
    ``denominator=`` computed on the full batch (:func:`loss_denominator`). The result's
    ``loss``, ``seq_terms`` (in the order of ``parts``) and ``metrics`` equal those of one call
    on the whole batch — raw-bit equal, for any split and any order of the parts — because the
    loss is a value-ordered sum of the per-sequence terms and each term depends only on its own
    sequence. (Summing the parts' ``loss`` values instead is mathematically the same but rounds
    in a split-dependent order.) Gradients need no combining: each micro-batch's backward
    already produces exactly the full-batch gradient rows.

    Raises:
        ValueError: ``parts`` is empty, mixes operators/reductions/denominators, or (with more
            than one part) a part computed its own denominator instead of receiving the global one.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("parts: expected at least one LossOutput")
    for i, p in enumerate(parts):
        if not isinstance(p, LossOutput):
            raise TypeError(f"parts[{i}]: expected a LossOutput, got {type(p).__name__}")
    first = parts[0]
    for i, p in enumerate(parts[1:], start=1):
        if (p.kind, p.reduction) != (first.kind, first.reduction):
            raise ValueError(f"parts[{i}]: {p.kind}/{p.reduction} differs from parts[0]: {first.kind}/{first.reduction}")
        if p.denominator != first.denominator:
            raise ValueError(
                f"parts[{i}]: denominator {p.denominator} differs from parts[0]'s {first.denominator}; pass the full "
                "batch's denominator=loss_denominator(full_mask, reduction) to every micro-batch"
            )
    if len(parts) > 1:
        for i, p in enumerate(parts):
            if not p.global_denominator:
                raise ValueError(
                    f"parts[{i}]: computed its own denominator from its micro-batch; pass the full batch's "
                    "denominator=loss_denominator(full_mask, reduction) to every micro-batch call"
                )
    seq_terms = torch.cat([p.seq_terms for p in parts])
    stats = {k: torch.cat([p.stats[k] for p in parts]) for k in first.stats}
    return _assemble(seq_terms, first.denominator, first.reduction, first.global_denominator, first.kind, stats)
