"""HF transformers ``generate`` as the rollout engine, with the sampled tokens' processed
log-probs and their kept-set records.

Top-k / top-p run as rl_engine's canonical filter (:class:`KeptSetRecorder`, a logits processor
in place of HF's temperature / top-k / top-p warpers): each step's kept sets are recorded, the
token is drawn by HF from the filtered distribution, and the log-prob of the sampled token is
computed afterwards from ``generate``'s raw logits with ``token_logprobs(..., kept=records)`` —
the distribution it was drawn from, which the trainer replays bit for bit with the same records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.backends.cpu.common import frozen_weights
from rl_engine.ops.logprob.kept import KeptSet, canonical_prefix, scale_logits

__all__ = ["Rollout", "KeptSetRecorder", "generate_with_logprobs"]


@dataclass(frozen=True)
class Rollout:
    """``sequences [B, P+N]``, ``attention_mask [B, P+N]``, ``prompt_len P``, ``logprobs [B, N]``
    (fp32, processed) and ``kept`` (records ``[B, N]``: the kept set of each step)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    kept: KeptSet


class KeptSetRecorder:
    """A ``generate`` logits processor: rl_engine's canonical top-k / top-p filter, recorded.

    Called with the scores of one step ``[B, V]`` (fp32 raw logits; HF runs custom processors
    before its own warpers, which must be off: ``temperature=1``, ``top_k=0``, ``top_p=1``), it
    returns ``z = fl32(scores) / fl32(T)`` with the entries outside each row's kept set at
    ``-inf`` (:func:`rl_engine.ops.logprob.canonical_prefix`) and appends the rows' records to
    :attr:`steps`. :meth:`kept` stacks them ``[B, steps]``.

    Other processors that change the scores before it (repetition penalty, bad words, ...) are
    not replayed by the trainer: leave them off.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature: expected > 0 (greedy decoding filters nothing), got {temperature!r}")
        if not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p: expected a value in (0, 1], got {top_p!r}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k or 0), float(top_p)
        self.steps: list[KeptSet] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        z = scale_logits(scores, self.temperature)
        if self.top_p >= 1.0 and (self.top_k <= 0 or self.top_k >= z.shape[-1]):
            # no filter: the kept set is the whole vocabulary whatever the logits, so the step
            # records keep-all rows without canonical_prefix's host copy and sort of [B, V]
            self.steps.append(KeptSet.everything((z.shape[0],), device=z.device))
            return z
        kept = canonical_prefix(z.detach(), self.top_k, self.top_p).kept.to(z.device)
        self.steps.append(kept)
        return z.masked_fill(~kept.mask(z), float("-inf"))

    def kept(self, rows: int, device: torch.device | str = "cpu") -> KeptSet:
        """The records ``[rows, steps]`` (keep-all rows when no step ran)."""
        if not self.steps:
            return KeptSet.everything((rows, 0), device=device)
        return KeptSet.stack(self.steps, dim=1).to(device)


def generate_with_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    top_k: int = 0,
    top_p: float = 1.0,
    **generate_kwargs,
) -> Rollout:
    r"""Run ``model.generate`` (KV cache) and record each generated token's processed log-prob.

    Sampling (``do_sample``) draws from rl_engine's canonical top-k / top-p filter at
    ``temperature`` (:class:`KeptSetRecorder`; HF's own warpers off). The log-prob is
    ``log softmax(z / T)[token]`` of the **raw** logits ``z`` returned by
    ``generate(output_logits=True)``, renormalised over the step's kept set, computed with
    :func:`rl_engine.ops.logprob.token_logprobs` (``kept=``) — the same op the training side
    uses (:func:`rl_engine.integrations.hf.train.train_token_logprobs`). Without filters the kept
    set is the whole vocabulary (the full log-prob, bit for bit). Greedy decoding uses ``T = 1``
    and filters nothing. ``eos_token_id`` is disabled unless given, so every row has ``N`` tokens.

    Shapes:
        input_ids, attention_mask: ``[B, P]`` (left padding); returns a :class:`Rollout`
        (``logprobs`` and ``kept`` ``[B, N]``).

    Raises:
        ValueError: ``input_ids`` and ``attention_mask`` disagree, or ``max_new_tokens < 1``.
    """
    from rl_engine.ops.logprob import token_logprobs

    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (input_ids'), got {tuple(attention_mask.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    generate_kwargs.setdefault("eos_token_id", None)
    recorder = None
    if do_sample:
        recorder = KeptSetRecorder(temperature, top_k, top_p)
        generate_kwargs.update(temperature=1.0, top_k=0, top_p=1.0,
                               logits_processor=[*generate_kwargs.get("logits_processor", []), recorder])
    torch.manual_seed(seed)
    # the weights are fixed for the whole generation: the CPU exact GEMM may reuse their slices
    with torch.no_grad(), frozen_weights():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             do_sample=do_sample, output_logits=True,
                             return_dict_in_generate=True, **generate_kwargs)
    P = input_ids.shape[1]
    new = out.sequences[:, P:].contiguous()
    z = torch.stack(out.logits, 1).float().contiguous()
    kept = recorder.kept(new.shape[0], z.device) if recorder is not None else KeptSet.everything(new.shape, z.device)
    lp = token_logprobs(z, new, temperature=temperature if do_sample else 1.0, kept=kept)
    mask = torch.cat([attention_mask, torch.ones_like(new, dtype=attention_mask.dtype)], 1)
    return Rollout(out.sequences, mask, P, lp, kept)
