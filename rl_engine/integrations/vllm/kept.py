"""Kept-set records of vLLM's sampling steps: made in the sampler, kept per worker, read by the client.

With ``logprobs_mode="processed_logprobs"`` the plugin's ``TopKTopPSampler`` forward runs
rl_engine's canonical top-k / top-p filter (:func:`rl_engine.ops.logprob.canonical_prefix`) on
the temperature-scaled logits vLLM hands it, samples (natively) from the filtered logits and
returns ``rl_engine.ops.logprob.log_softmax(z, kept=records)``: the processed log-probs,
renormalised over each row's kept set. The records (:class:`~rl_engine.ops.logprob.KeptSet`,
8 bytes per sampled token) must reach the trainer with the tokens, and vLLM's outputs have no
field for them, so:

* the plugin wraps ``GPUModelRunner._sample`` (the CPU runner inherits it) to publish, for the
  duration of the call, which request each logits row belongs to and at which sequence position
  its sampled token lands (``input_batch.req_ids`` and the step's ``optimistic_seq_lens_cpu``;
  rows whose sample vLLM discards — a prefill chunk that does not end the prompt — are marked);
* the sampler stores each kept row's record under ``(request id, position)`` in this worker's
  :data:`STORE`;
* the client asks every worker for its records (``collective_rpc("rlk_take_kept_sets")``, which
  also clears them) and :func:`kept_sets` lines them up with each output's tokens (vLLM's
  internal request id is the client's id plus a ``-<suffix>``).

Rank 0's records suffice at TP > 1 (every rank samples the same rows from the same logits).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["STORE", "sampling_rows", "current_rows", "record", "take", "kept_sets"]

#: ``(request ids, positions, discarded)`` of the logits rows of the ``_sample`` call in flight.
_ROWS: contextvars.ContextVar[tuple[list[str], list[int], list[bool]] | None] = contextvars.ContextVar(
    "rlk_vllm_sampling_rows", default=None)
#: This worker's records: request id -> {position: (threshold, boundary)}.
STORE: dict[str, dict[int, tuple[float, int]]] = {}
_LOCK = threading.Lock()


@contextlib.contextmanager
def sampling_rows(req_ids: Sequence[str], positions: Sequence[int], discarded: Sequence[bool]) -> Iterator[None]:
    """Publish the rows of one ``_sample`` call (restored on exit, also when it raises)."""
    token = _ROWS.set((list(req_ids), [int(p) for p in positions], [bool(d) for d in discarded]))
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_rows() -> tuple[list[str], list[int], list[bool]] | None:
    return _ROWS.get()


def record(kept, rows: int) -> bool:
    """Store the records ``kept`` (a ``KeptSet`` ``[rows]``) of the ``_sample`` call in flight.

    Returns ``False`` (nothing stored) when no call is in flight or its row count differs (a
    sampler call that is not one token per request, e.g. speculative decoding)."""
    cur = _ROWS.get()
    if cur is None or len(cur[0]) != rows:
        return False
    req_ids, positions, discarded = cur
    thr = kept.threshold.detach().cpu().tolist()
    bnd = kept.boundary.detach().cpu().tolist()
    with _LOCK:
        for i, rid in enumerate(req_ids):
            if not discarded[i]:
                STORE.setdefault(rid, {})[positions[i]] = (float(thr[i]), int(bnd[i]))
    return True


def take() -> dict[str, dict[int, tuple[float, int]]]:
    """This worker's records, removed from :data:`STORE` (the ``rlk_take_kept_sets`` RPC)."""
    with _LOCK:
        out = {rid: dict(recs) for rid, recs in STORE.items()}
        STORE.clear()
    return out


def _internal_ids(external: str, stored: dict[str, Any]) -> list[str]:
    return [rid for rid in stored if rid == external or rid.rsplit("-", 1)[0] == external]


def kept_sets(llm, outputs: Sequence[Any], *, require: bool = True) -> list[Any]:
    """The kept-set records of each generated token of ``outputs`` (vLLM ``RequestOutput``s of
    the last ``generate`` calls), one ``KeptSet`` ``[len(tokens)]`` per output (its first
    completion), taken from the workers (and removed there).

    Args:
        require: a sampled token without a record raises; with ``False`` it gets the keep-all
            record (an all-greedy step never reaches the filter).

    Raises:
        ValueError: a record is missing (``require``), or the workers do not run the plugin.
    """
    from rl_engine.ops.logprob import KEEP_ALL_BOUNDARY, KeptSet

    try:
        answers = llm.collective_rpc("rlk_take_kept_sets")
    except NotImplementedError as exc:
        raise ValueError(f"llm: its workers do not have the rl_engine plugin installed ({exc})") from None
    stored: dict[str, dict[int, tuple[float, int]]] = dict(answers[0]) if answers else {}
    out = []
    for o in outputs:
        ids = _internal_ids(str(o.request_id), stored)
        recs: dict[int, tuple[float, int]] = {}
        for rid in ids:
            recs.update(stored[rid])
        P = len(o.prompt_token_ids)
        toks = list(o.outputs[0].token_ids)
        thr, bnd = [], []
        for k in range(len(toks)):
            r = recs.get(P + k)
            if r is None:
                if require:
                    raise ValueError(f"kept: no kept-set record for token {k} (position {P + k}) of request "
                                     f"{o.request_id!r}; generate with logprobs_mode='processed_logprobs' under the plugin")
                r = (float("-inf"), KEEP_ALL_BOUNDARY)
            thr.append(r[0])
            bnd.append(r[1])
        out.append(KeptSet(torch.tensor(thr, dtype=torch.float32), torch.tensor(bnd, dtype=torch.int32)))
    return out
