"""``rlk check --train-engine megatron``: the train side of the check scored by Megatron-core.

The rollout's finished sequences (prompt + response, with each response token's kept-set record
under ``--logprobs processed``) are packed into one varlen batch and teacher-forced by
:class:`~rl_engine.integrations.megatron.model.MegatronQwen3` — a Megatron-core ``GPTModel`` on
rl_engine's tensor-parallel layers — at ``--train-tp`` ranks started on gloo
(:func:`~rl_engine.distributed.launch.spawn`), from the same HF checkpoint the rollout engine
loaded. The per-token log-probs come from the vocabulary-parallel head
(:func:`~rl_engine.distributed.tensor_parallel.vocab_parallel_logprobs`), replicated on every
rank, so rank 0's are the layout's result.

The plan's train letter picks the row-parallel reduction (the part of the model whose order a
TP size changes): ``R`` is the full-K gather scheme (``full_k``: the bits of TP = 1 at every TP
size), ``P`` Megatron's native reduction — each rank's K-shard partial product, summed by a float
all-reduce (``native``) — the negative control, which differs from the rollout at TP > 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["MEGATRON_ROW_SCHEMES", "MegatronUnavailable", "check_megatron_layout", "megatron_layout_name",
           "require_megatron", "score_megatron"]

#: The row-parallel scheme of each plan letter on the train side.
MEGATRON_ROW_SCHEMES = {"R": "full_k", "P": "native"}


class MegatronUnavailable(ImportError):
    """megatron-core cannot be imported here."""


def require_megatron() -> None:
    """Import megatron-core, or raise :class:`MegatronUnavailable` naming the fix."""
    try:
        import megatron.core  # noqa: F401
    except Exception as exc:
        raise MegatronUnavailable(f"--train-engine megatron needs megatron-core 0.16.1 ({type(exc).__name__}: {exc}); "
                                  "pip install megatron-core==0.16.1 torch==2.13.0 (both make setup environments "
                                  "have it)") from exc


def megatron_layout_name(tp: int) -> str:
    """The layout's name in the check result: ``megatron-tp<N>`` (one packed batch)."""
    return f"megatron-tp{tp}"


def check_megatron_layout(spec, tp: int) -> None:
    """Raise ``ValueError`` naming ``--train-tp`` when ``spec`` cannot be split ``tp`` ways by
    the adapter (query heads, KV heads and the MLP width must divide; tied embedding, no
    attention bias)."""
    from rl_engine.models.qwen3 import Qwen3Spec

    if type(spec) is not Qwen3Spec:  # a Qwen3-MoE spec is a subclass: its experts have no Megatron slots here
        raise ValueError(f"--train-engine megatron: the adapter builds dense Qwen3 models, got {type(spec).__name__} "
                         f"{getattr(spec, 'name', '')!r}")
    if tp < 1 or tp & (tp - 1):
        raise ValueError(f"--train-tp: expected a power of two, got {tp}")
    bad = [f"{name} = {v}" for name, v in (("num_attention_heads", spec.num_attention_heads),
                                          ("num_key_value_heads", spec.num_key_value_heads),
                                          ("intermediate_size", spec.intermediate_size)) if v % tp]
    if bad:
        raise ValueError(f"--train-tp: {tp} ranks cannot split model {spec.name!r} ({', '.join(bad)} not divisible "
                         f"by {tp}); use --preset tiny-tp or a smaller --train-tp")
    if not spec.tie_word_embeddings or spec.attention_bias:
        raise ValueError(f"--train-engine megatron: model {spec.name!r} needs tied embeddings and no attention bias "
                         "(the adapter shards the tied embedding as the LM head)")


def _pack(seqs) -> dict[str, torch.Tensor]:
    """One varlen batch of the train sequences: ids, positions, bounds, each position's next
    token as target (0 after a sequence's last token) and that target's kept-set record."""
    from rl_engine.ops.logprob import KeptSet

    ids, pos, tgt, cu = [], [], [], [0]
    thr, bnd = [], []
    for s in seqs:
        n = len(s.tokens)
        ids += s.tokens
        pos += range(n)
        tgt += list(s.tokens[1:]) + [0]
        cu.append(cu[-1] + n)
        kept = s.kept if s.kept is not None else KeptSet.everything((n,))
        rest = KeptSet.everything((1,))
        thr.append(torch.cat([kept.threshold[1:].float(), rest.threshold]))
        bnd.append(torch.cat([kept.boundary[1:].to(torch.int64), rest.boundary.to(torch.int64)]))
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return {"ids": t(ids), "pos": t(pos), "cu": torch.tensor(cu, dtype=torch.int32), "tgt": t(tgt),
            "thr": torch.cat(thr), "bnd": torch.cat(bnd)}


def _rank(group, model_dir: str, batch: dict[str, torch.Tensor], dtype: str, temperature: float, row_scheme: str,
          with_kept: bool) -> torch.Tensor:
    """One Megatron rank: build the TP group, load this rank's part of the checkpoint, score."""
    from megatron.core import parallel_state

    from rl_engine.integrations.megatron.model import MegatronQwen3
    from rl_engine.models.qwen3 import dtype_from_name
    from rl_engine.ops.logprob import KeptSet

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=group.size)
    try:
        model = MegatronQwen3.from_pretrained(model_dir, dtype=dtype_from_name(dtype), row_scheme=row_scheme)
        kept = KeptSet(batch["thr"], batch["bnd"]) if with_kept else None
        with torch.no_grad():
            return model.token_logprobs(batch["ids"], batch["pos"], batch["cu"], batch["tgt"], temperature, kept=kept)
    finally:
        parallel_state.destroy_model_parallel()


def score_megatron(model_dir: str | Path, seqs, *, tp: int, dtype: str, temperature: float, train_letter: str,
                   threads: int = 1) -> dict[int, Any]:
    """Score ``seqs`` (:class:`~rl_engine.engine.executor.TrainSequence`, kept sets used when
    present) with Megatron at ``tp`` ranks; returns ``{sample_id: ScoredSequence}`` like the
    other train layouts (position 0 carries 0 and is inactive).

    Raises:
        MegatronUnavailable: megatron-core is not importable.
        ValueError: an unknown plan letter.
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback is in the message).
    """
    from rl_engine.distributed.launch import spawn
    from rl_engine.engine.executor import ScoredSequence

    require_megatron()
    if train_letter not in MEGATRON_ROW_SCHEMES:
        raise ValueError(f"plan: the train side of --train-engine megatron is R or P, got {train_letter!r}")
    batch = _pack(seqs)
    with_kept = any(s.kept is not None for s in seqs)
    per_rank = spawn(_rank, tp, str(model_dir), batch, dtype, float(temperature), MEGATRON_ROW_SCHEMES[train_letter],
                     with_kept, threads=threads)
    lp = per_rank[0]
    scored = {}
    for s, st in zip(seqs, batch["cu"][:-1].tolist()):
        n = len(s.tokens)
        out = torch.zeros(n, dtype=torch.float32)
        out[1:] = lp[st:st + n - 1]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        mask[0] = False
        scored[s.sample_id] = ScoredSequence(s.sample_id, out, mask)
    return scored
