"""Reference executors: the train-side scorer and the rollout-side generator.

Both drive a model through an :class:`~rl_engine.engine.OpsProvider` (one per side), so
the same code runs the rl-kernel (``R``) and native (``P``) operators.

**Train side** (:func:`score`): teacher forcing. The log-prob of token ``t`` of a sequence is
taken from the logits at position ``t - 1``:
``logprob[t] = log softmax(z[t-1] / T)[tokens[t]]`` — renormalised over the kept set of token
``t`` when the sequence carries kept-set records (:attr:`TrainSequence.kept`, the *processed*
log-prob) — so position 0 has no log-prob (its mask is forced to 0). Layouts (:data:`LAYOUTS`)
change only how sequences are laid into the flat token stream the model sees; every active token
must come out with the same bits.

**Rollout side** (:class:`RolloutExecutor`): prefill (chunked) + decode against per-layer KV
caches with continuous batching: sequences arrive at different steps, finish after different
numbers of tokens, and a token budget makes prefills wait, so the batch changes every step.
Each sampled token's recorded log-prob is the **processed** log-prob: ``log softmax(z / T)``
renormalised over the tokens the top-k / top-p filter kept — the distribution the token was
drawn from — and the step's kept-set record (:class:`~rl_engine.ops.logprob.KeptSet`, 8 bytes)
travels with it (:attr:`RolloutSample.kept`), so the trainer can replay the same value. Without
filters the kept set is the whole vocabulary and the processed log-prob is the full one, bit for
bit. Greedy decoding (``temperature == 0``) records ``log softmax(z)`` (T = 1, nothing filtered).

**Sampling** (:func:`sample`): the uniform draw for (seed, sample id, position) comes from a
counter-based hash (SplitMix64), never from a stateful generator, so it does not depend on the
batch; the kept set is rl_engine's canonical top-k / top-p filter of the logits row
(:func:`rl_engine.ops.logprob.canonical_prefix`: float64 weights in the canonical order, ``z``
descending with ties by token id), and the draw inverts the kept prefix's running sums.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from rl_engine.backends.cpu.common import frozen_weights
from rl_engine.ops.logprob.kept import KeptSet, canonical_prefix, scale_logits

__all__ = [
    "SamplingParams",
    "LOGPROB_MODES",
    "uniform",
    "sample",
    "sample_token",
    "TrainSequence",
    "ScoredSequence",
    "Layout",
    "LAYOUTS",
    "layout",
    "layout_stream",
    "score",
    "RolloutRequest",
    "RolloutSample",
    "RolloutExecutor",
]

_M64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------
#: What the train side scores against a rollout's records: ``processed`` — renormalised over each
#: token's kept set (the distribution the rollout sampled from; what it reports) — or ``full`` —
#: the whole vocabulary (differs from the rollout's value wherever a filter dropped mass).
LOGPROB_MODES = ("processed", "full")


class SamplingParams(BaseModel):
    """Decoding parameters. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1``
    disable the filters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution the recorded log-prob is taken from (1 for greedy)."""
        return 1.0 if self.greedy else self.temperature


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, sample_id: int, position: int) -> float:
    """A uniform draw in ``[0, 1)`` that depends only on ``(seed, sample_id, position)``."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _M64) ^ (sample_id & _M64)) ^ (position & _M64))
    return (h >> 11) / float(1 << 53)


def sample(logits_row: torch.Tensor, params: SamplingParams, sample_id: int, position: int) -> tuple[int, KeptSet]:
    """The token at ``position`` of ``sample_id`` drawn from one row of logits ``[V]``, and the
    kept-set record (0-d :class:`~rl_engine.ops.logprob.KeptSet`) of the distribution it was
    drawn from.

    Greedy: the first index of the maximum, nothing filtered (the keep-all record). Otherwise the
    canonical filter of ``z = fl32(logits) / fl32(T)`` (:func:`rl_engine.ops.logprob.canonical_prefix`:
    top-k, then top-p of the top-k mass, over the float64 weights ``exp(z - max z)`` in the
    canonical order) keeps a prefix of ``n`` tokens with running sums ``c``; the draw is the
    first kept token with ``c > u · c_n``, ``u = uniform(seed, sample_id, position)``. Depends on
    the row and the triple only, not on the row's device, the batch, the thread count or the
    instruction set (the float64 arithmetic runs on the CPU: one ``[V]`` copy per token).
    """
    if params.greedy:
        return int(torch.argmax(logits_row.detach().to("cpu", torch.float64))), KeptSet.everything(())
    z = scale_logits(logits_row.detach().reshape(1, -1).to("cpu"), params.temperature)
    pre = canonical_prefix(z, params.top_k, params.top_p)
    n = int(pre.count[0])
    cum = pre.cumulative[0, :n]
    target = uniform(params.seed, sample_id, position) * float(cum[-1])
    idx = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64), right=True).item())
    return int(pre.order[0, min(idx, n - 1)]), pre.kept[0]


def sample_token(logits_row: torch.Tensor, params: SamplingParams, sample_id: int, position: int) -> int:
    """The token of :func:`sample` alone."""
    return sample(logits_row, params, sample_id, position)[0]


# ------------------------------------------------------------------------------------------
# Train side
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSequence:
    """One sequence to score: ``tokens`` (prompt + response), a per-token loss mask and, for
    processed log-probs, ``kept``: one kept-set record per token (``[L]``; keep-all for the prompt
    and unfiltered steps), the record of the sampling step that produced it."""

    sample_id: int
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]
    kept: KeptSet | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.loss_mask):
            raise ValueError(f"loss_mask: expected {len(self.tokens)} entries (one per token), got {len(self.loss_mask)}")
        if len(self.tokens) < 2:
            raise ValueError(f"tokens: sample {self.sample_id} needs at least 2 tokens to score, got {len(self.tokens)}")
        if self.kept is not None and tuple(self.kept.shape) != (len(self.tokens),):
            raise ValueError(f"kept: expected {len(self.tokens)} records (one per token) for sample {self.sample_id}, "
                             f"got shape {tuple(self.kept.shape)}")

    @classmethod
    def of(cls, sample: "RolloutSample", logprobs: str = "processed") -> "TrainSequence":
        """The train-side view of a rollout sample: the response is the active part; with
        ``logprobs="processed"`` the sample's kept-set records come along (scored renormalised
        over each token's kept set, as the rollout reported), with ``"full"`` they do not (the
        whole vocabulary)."""
        if logprobs not in LOGPROB_MODES:
            raise ValueError(f"logprobs: expected one of {LOGPROB_MODES}, got {logprobs!r}")
        mask = (0,) * len(sample.prompt) + (1,) * len(sample.response)
        kept = None
        if logprobs == "processed":
            kept = KeptSet.cat([KeptSet.everything((len(sample.prompt),)), sample.kept_set()])
        return cls(sample.sample_id, sample.tokens, mask, kept)


@dataclass
class ScoredSequence:
    """Per-position results for one sequence (index = token position)."""

    sample_id: int
    logprobs: torch.Tensor  # [L] fp32, position 0 is 0
    mask: torch.Tensor  # [L] bool, active tokens (loss_mask and position > 0)
    entropy: torch.Tensor | None = None  # [L] fp32 (entropy of the distribution predicting token t)


@dataclass(frozen=True)
class Layout:
    """How a list of sequences is laid out for the train forward.

    Attributes:
        name: label used in reports.
        padding: ``None`` (packed varlen), ``"left"`` or ``"right"``: each sequence occupies a
            row of the longest length; right pads share the row's causal segment (they come
            after every real token), left pads form their own segment so real tokens start at
            position 0 and never see them (what an attention mask does in a padded batch).
        permute_seed: shuffle the order of sequences (``None``: keep the given order).
        micro_batch: forward this many sequences at a time (``None``: all at once).
        token_chunk, vocab_chunk: chunk sizes of the fused LM-head log-prob.
    """

    name: str
    padding: str | None = None
    permute_seed: int | None = None
    micro_batch: int | None = None
    token_chunk: int | None = None
    vocab_chunk: int | None = None


LAYOUTS: dict[str, Layout] = {
    "packed": Layout("packed"),
    "padded-right": Layout("padded-right", padding="right"),
    "padded-left": Layout("padded-left", padding="left"),
    "permuted": Layout("permuted", permute_seed=1234),
    "micro-batched": Layout("micro-batched", micro_batch=2, permute_seed=99),
    "chunked": Layout("chunked", token_chunk=13, vocab_chunk=1024),
}


def layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"layout: expected one of {sorted(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def layout_stream(seqs: Sequence[TrainSequence], lay: Layout, pad_id: int):
    """One micro-batch laid out as ``lay`` says, as the model's train forward consumes it.

    Returns ``(ids [T], positions [T], cu_seqlens [B'+1], next-token targets [T], offsets)``:
    flat token ids (pad tokens included for padded layouts: left padding forms its own
    attention segment), their positions, the boundaries of the attention segments, the
    next token of each row (``pad_id`` where the row has none) and, for each sample id, the row
    where its tokens start. The validation chain and debugger reuse it so
    they see exactly the rows :func:`score` sees.
    """
    ids: list[int] = []
    pos: list[int] = []
    tgt: list[int] = []
    cu = [0]
    offsets: dict[int, int] = {}
    width = max(len(s.tokens) for s in seqs)

    def seg(tokens, start_pos, targets):
        ids.extend(tokens)
        pos.extend(range(start_pos, start_pos + len(tokens)))
        tgt.extend(targets)
        cu.append(len(ids))

    for s in seqs:
        L = len(s.tokens)
        nxt = list(s.tokens[1:]) + [pad_id]
        npad = width - L if lay.padding else 0
        if lay.padding == "left" and npad:
            seg([pad_id] * npad, 0, [pad_id] * npad)
        offsets[s.sample_id] = len(ids)
        if lay.padding == "right" and npad:
            seg(list(s.tokens) + [pad_id] * npad, 0, nxt + [pad_id] * npad)
        else:
            seg(list(s.tokens), 0, nxt)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return t(ids), t(pos), torch.tensor(cu, dtype=torch.int32), t(tgt), offsets


def stream_kept(seqs: Sequence[TrainSequence], offsets: dict[int, int], rows: int) -> KeptSet:
    """The kept-set records ``[rows]`` of a flat stream of :func:`layout_stream`: row ``o + p`` of
    a sequence predicts its token ``p + 1`` and takes that token's record; pads, the last row of
    each sequence and sequences without records keep everything."""
    thr = torch.full((rows,), float("-inf"), dtype=torch.float32)
    bnd = KeptSet.everything((rows,)).boundary
    for s in seqs:
        if s.kept is None:
            continue
        o, L = offsets[s.sample_id], len(s.tokens)
        thr[o : o + L - 1] = s.kept.threshold[1:]
        bnd[o : o + L - 1] = s.kept.boundary[1:].to(bnd.dtype)
    return KeptSet(thr, bnd)


def score(model: Any, ops: Any, seqs: Sequence[TrainSequence], lay: Layout | str = "packed", *,
          temperature: float = 1.0, with_entropy: bool = False, pad_id: int = 0) -> dict[int, ScoredSequence]:
    """Teacher-forcing log-probs (and entropy) of ``seqs`` under ``model`` on the train path.

    ``logprobs[t] = log softmax(z[t-1] / temperature)[tokens[t]]`` for ``t ≥ 1``, renormalised
    over token ``t``'s kept set for sequences with records (:attr:`TrainSequence.kept`). Gradients
    flow to the model parameters that require grad. Returns ``{sample_id: ScoredSequence}``.
    """
    if isinstance(lay, str):
        lay = layout(lay)
    if not seqs:
        raise ValueError("seqs: expected at least one sequence")
    if len({s.sample_id for s in seqs}) != len(seqs):
        raise ValueError("seqs: sample ids must be unique")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    order = list(seqs)
    if lay.permute_seed is not None:
        random.Random(lay.permute_seed).shuffle(order)
    mb = lay.micro_batch or len(order)
    out: dict[int, ScoredSequence] = {}
    W = model.lm_head_weight
    with_kept = any(s.kept is not None for s in order)
    for b in range(0, len(order), mb):
        group = order[b : b + mb]
        ids, pos, cu, tgt, offsets = layout_stream(group, lay, pad_id)
        dev = model.device
        kept = stream_kept(group, offsets, ids.shape[0]).to(dev) if with_kept else None
        hidden = model.hidden_train(ids.to(dev), pos.to(dev), cu.to(dev), ops)
        lp, ent = ops.lm_head_logprobs(hidden, W, tgt.to(dev), temperature, return_entropy=with_entropy,
                                       token_chunk=lay.token_chunk, vocab_chunk=lay.vocab_chunk, kept=kept)
        for s in group:
            o, L = offsets[s.sample_id], len(s.tokens)
            zero = lp.new_zeros(1)
            seq_lp = torch.cat([zero, lp[o : o + L - 1]])
            seq_ent = torch.cat([zero, ent[o : o + L - 1]]) if ent is not None else None
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)
            mask[0] = False
            out[s.sample_id] = ScoredSequence(s.sample_id, seq_lp, mask, seq_ent)
    return out


# ------------------------------------------------------------------------------------------
# Rollout side
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutRequest:
    """A prompt to complete; it joins the batch at ``arrival_step``."""

    sample_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"prompt: sample {self.sample_id} has an empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected ≥ 1, got {self.max_new_tokens}")


@dataclass
class RolloutSample:
    """A finished sequence: prompt, sampled response, each response token's processed log-prob
    and the kept-set record of the step that sampled it (``kept``: 0-d records, one per
    response token; an empty list means no filter ran: every step kept the whole vocabulary)."""

    sample_id: int
    prompt: tuple[int, ...]
    response: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # 0-d fp32 tensors, bits as recorded
    kept: list[KeptSet] = field(default_factory=list)  # 0-d records, one per response token

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.prompt) + tuple(self.response)

    def logprob_tensor(self) -> torch.Tensor:
        return torch.stack(self.logprobs) if self.logprobs else torch.empty(0)

    def kept_set(self) -> KeptSet:
        """The records ``[len(response)]`` (keep-all records when none were stored).

        Raises:
            ValueError: records are stored but not one per response token.
        """
        if not self.kept:
            return KeptSet.everything((len(self.response),))
        if len(self.kept) != len(self.response):
            raise ValueError(f"kept: sample {self.sample_id} has {len(self.kept)} kept-set records for "
                             f"{len(self.response)} response tokens")
        return KeptSet.stack([k.to("cpu") for k in self.kept])

    def filtered_tokens(self) -> int:
        """How many response tokens were drawn from a filtered distribution (a kept set smaller
        than the vocabulary)."""
        return int((~self.kept_set().keeps_everything()).sum()) if self.response else 0


@dataclass
class _Running:
    req: RolloutRequest
    slot: int
    sample: RolloutSample
    fed: int = 0  # tokens whose k/v are in the cache

    @property
    def known(self) -> int:
        return len(self.req.prompt) + len(self.sample.response)


class RolloutExecutor:
    """Continuous-batching generator over per-layer KV caches.

    Args:
        model: e.g. :class:`~rl_engine.models.qwen3.Qwen3ForCausalLM`.
        ops: the rollout side's provider.
        max_seqs: concurrent sequences (cache slots); later arrivals wait for a free slot.
        max_len: longest prompt + response.
        prefill_chunk: prompt tokens per sequence per step (chunked prefill).
        max_step_tokens: token budget of one step; a prefill that does not fit waits a step.
    """

    def __init__(self, model: Any, ops: Any, *, max_seqs: int = 8, max_len: int = 256,
                 prefill_chunk: int = 16, max_step_tokens: int = 48):
        if prefill_chunk < 1 or max_step_tokens < 1 or max_seqs < 1:
            raise ValueError("prefill_chunk, max_step_tokens and max_seqs must be ≥ 1")
        self.model, self.ops = model, ops
        self.max_seqs, self.max_len = max_seqs, max_len
        self.prefill_chunk, self.max_step_tokens = prefill_chunk, max_step_tokens
        self.batch_log: list[tuple[tuple[int, int], ...]] = []  # per step: (sample_id, n_tokens)

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams,
                 progress: Callable[[int, int], None] | None = None) -> dict[int, RolloutSample]:
        """Run every request to its ``max_new_tokens``; returns the samples by ``sample_id``.

        ``progress(done, total)``, if given, is called after every step with the tokens processed
        so far (prompt tokens fed plus tokens sampled) out of ``Σ len(prompt) + max_new_tokens``.
        The model's weights are fixed for the whole call, so the CPU exact GEMM reuses their
        slices (:func:`~rl_engine.backends.cpu.common.frozen_weights`).
        """
        with frozen_weights():
            return self._generate(requests, sampling, progress)

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams,
                  progress: Callable[[int, int], None] | None) -> dict[int, RolloutSample]:
        total_tokens = sum(len(r.prompt) + r.max_new_tokens for r in requests)
        done_tokens = 0
        for r in requests:
            if len(r.prompt) + r.max_new_tokens > self.max_len:
                raise ValueError(f"requests: sample {r.sample_id} needs {len(r.prompt) + r.max_new_tokens} "
                                 f"positions, max_len is {self.max_len}")
        pending = sorted(requests, key=lambda r: (r.arrival_step, r.sample_id))
        caches = self.model.new_kv_caches(self.ops, self.max_seqs, self.max_len)
        free = list(range(self.max_seqs))
        running: list[_Running] = []
        done: dict[int, RolloutSample] = {}
        dev = self.model.device
        W = self.model.lm_head_weight
        t_lp = sampling.logprob_temperature
        step = 0
        while pending or running:
            while pending and pending[0].arrival_step <= step and free:
                r = pending.pop(0)
                running.append(_Running(r, free.pop(0), RolloutSample(r.sample_id, tuple(r.prompt))))
            batch: list[tuple[_Running, int]] = []
            budget = self.max_step_tokens
            for st in running:  # decodes first (1 token each), then prefill chunks within budget
                if st.fed >= len(st.req.prompt):
                    batch.append((st, 1))
                    budget -= 1
            for st in running:
                if st.fed < len(st.req.prompt):
                    n = min(self.prefill_chunk, len(st.req.prompt) - st.fed, budget)
                    if n > 0:
                        batch.append((st, n))
                        budget -= n
            if not batch:
                step += 1
                continue
            ids, pos, cu, slots = [], [], [0], []
            for st, n in batch:
                toks = st.sample.tokens
                ids.extend(toks[st.fed : st.fed + n])
                pos.extend(range(st.fed, st.fed + n))
                cu.append(cu[-1] + n)
                slots.append(st.slot)
            self.batch_log.append(tuple((st.req.sample_id, n) for st, n in batch))
            hidden = self.model.hidden_cached(
                torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                caches, torch.tensor(slots, dtype=torch.int64, device=dev),
                torch.tensor(cu, dtype=torch.int32, device=dev), self.ops,
            )
            ready = []
            for j, (st, n) in enumerate(batch):
                st.fed += n
                done_tokens += n
                if st.fed == st.known:
                    ready.append((st, cu[j + 1] - 1))
            if ready:
                rows = torch.tensor([r for _, r in ready], dtype=torch.int64, device=dev)
                logits = self.ops.linear(hidden.index_select(0, rows), W)
                drawn = [sample(logits[k], sampling, st.req.sample_id, st.known) for k, (st, _) in enumerate(ready)]
                toks = [tok for tok, _ in drawn]
                kept = KeptSet.stack([k for _, k in drawn]).to(dev)
                lps = self.ops.token_logprobs(logits, torch.tensor(toks, dtype=torch.int64, device=dev), t_lp, kept=kept)
                for k, (st, _) in enumerate(ready):
                    st.sample.response.append(toks[k])
                    st.sample.logprobs.append(lps[k].detach().cpu())
                    st.sample.kept.append(drawn[k][1])
                    if len(st.sample.response) >= st.req.max_new_tokens:
                        for c in caches:
                            c.free(st.slot)
                        free.append(st.slot)
                        free.sort()
                        done[st.req.sample_id] = st.sample
                        done_tokens += 1  # the last sampled token, never fed back
                running = [st for st in running if st.req.sample_id not in done]
            step += 1
            if progress is not None:
                progress(done_tokens, total_tokens)
        return done
