"""rl_engine's Qwen3 sharded for tensor parallelism on the TP-invariant blocks.

:func:`shard_qwen3` cuts a :class:`~rl_engine.models.qwen3.Qwen3ForCausalLM` into the parameters
of one TP rank and returns a model whose spec has this rank's heads and MLP width, plus
:class:`TensorParallelOps`, an operator provider that wraps the provider of a side
(:func:`rl_engine.engine.ops_for`) and routes each call by the parameter it receives:

================================  ================================================================
parameter                         operator on this rank
================================  ================================================================
``qkv_proj``, ``gate_up_proj``    :func:`~.tensor_parallel.column_parallel_linear` (this rank's
                                  q, k, v heads and gate, up rows; ``[gate_r; up_r]`` so that
                                  ``silu_and_mul`` splits the shard as it splits the full layer)
``o_proj``, ``down_proj``         :func:`~.tensor_parallel.row_parallel_linear` (scheme chosen
                                  at sharding, per layer with ``"auto"``; ``full_k`` rows
                                  ``[H/p, K]``, else ``[H, K/p]``)
``q_norm``, ``k_norm``            the side's ``rms_norm`` on all heads between
                                  :func:`~.tensor_parallel.gather_heads` and
                                  :func:`~.tensor_parallel.slice_heads` (replicated weight)
``embed_tokens`` (tied LM head)   :func:`~.tensor_parallel.vocab_parallel_embedding` and
                                  :func:`~.tensor_parallel.vocab_parallel_logprobs`, vocabulary
                                  shards of whole 1024-column blocks
everything else                   the side's operator, unchanged (norms, RoPE and attention run
                                  on this rank's heads or on replicated activations)
================================  ================================================================

The model assembly (``models/qwen3/model.py``) is unchanged: it calls ``ops.linear``,
``ops.rms_norm`` ... with the parameters it holds, and those are this rank's shards. Its stage
hook sees this rank's tensors: every stage is replicated except ``attention`` (this rank's heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.distributed.algorithms.vocab import VOCAB_BLOCK, vocab_partition
from rl_engine.distributed.tensor_parallel import (
    ROW_SCHEMES,
    choose_row_scheme,
    column_parallel_linear,
    gather_heads,
    row_parallel_linear,
    slice_heads,
    vocab_parallel_embedding,
    vocab_parallel_logprobs,
)
from rl_engine.distributed.transports import Group

__all__ = ["TPLayout", "shard_qwen3", "unshard_qwen3", "TensorParallelOps", "SHARDED_STAGES"]

#: Stages whose tensor is sharded across the TP ranks (along the last dim); all others are replicated.
SHARDED_STAGES = ("attention",)


@dataclass(frozen=True)
class TPLayout:
    """How one rank's parameters relate to the full model (``kinds``: parameter name → role)."""

    size: int
    rank: int
    row_scheme: str  # as asked: a scheme of ROW_SCHEMES or "auto"
    vocab: tuple[tuple[int, int], ...]  # every rank's vocabulary shard [start, end)
    kinds: dict[str, str]
    row_schemes: dict[str, str]  # row-parallel parameter (and bias) name -> the scheme it runs


def _heads(t: torch.Tensor, heads: int, d: int, size: int, rank: int) -> torch.Tensor:
    per = heads // size
    return t.reshape(heads, d, *t.shape[1:])[rank * per:(rank + 1) * per].reshape(per * d, *t.shape[1:])


def shard_qwen3(model, size: int, rank: int, *, row_scheme: str = "full_k"):
    """``(local_model, layout)``: rank ``rank`` of ``size``-way tensor parallelism of ``model``.

    Requires ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size`` divisible
    by ``size``, tied embeddings (the LM head is the embedding's vocabulary shard), and a
    vocabulary of at least ``size`` blocks of 1024.

    Raises:
        ValueError: a dimension that does not divide, an untied LM head, an unknown ``row_scheme``.
    """
    from rl_engine.models.qwen3 import Qwen3ForCausalLM

    s = model.spec
    if row_scheme not in ROW_SCHEMES + ("auto",):
        raise ValueError(f"row_scheme: expected one of {ROW_SCHEMES + ('auto',)}, got {row_scheme!r}")
    for name, v in (("num_attention_heads", s.num_attention_heads), ("num_key_value_heads", s.num_key_value_heads),
                    ("intermediate_size", s.intermediate_size), ("hidden_size", s.hidden_size)):
        if v % size:
            raise ValueError(f"spec.{name}: {v} is not divisible by the tensor-parallel size {size}")
    if not s.tie_word_embeddings:
        raise ValueError("spec.tie_word_embeddings: the TP assembly shards the tied embedding as the LM head; "
                         "an untied lm_head is not supported")
    if not 0 <= rank < size:
        raise ValueError(f"rank: expected 0 <= rank < {size}, got {rank}")
    vocab = tuple(vocab_partition(s.vocab_size, size))
    local_spec = s.model_copy(update={"num_attention_heads": s.num_attention_heads // size,
                                      "num_key_value_heads": s.num_key_value_heads // size,
                                      "intermediate_size": s.intermediate_size // size})
    P, D, I, H = model.params, s.head_dim, s.intermediate_size, s.hidden_size
    out: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    schemes: dict[str, str] = {}
    for k, v in P.items():
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            sch = row_scheme if row_scheme != "auto" else choose_row_scheme(v.shape[1], v.shape[0], v.dtype, v.device.type)
            schemes[k] = schemes[k.replace(".weight", ".bias")] = sch
    for k, v in P.items():
        full_k = schemes.get(k) == "full_k"
        v = v.detach()
        if k == "model.embed_tokens.weight":
            lo, hi = vocab[rank]
            t, kind = v[lo:hi], "vocab"
        elif ".self_attn.qkv_proj." in k:
            q, kk, vv = v.split([s.q_size, s.kv_size, s.kv_size])
            t = torch.cat([_heads(q, s.num_attention_heads, D, size, rank), _heads(kk, s.num_key_value_heads, D, size, rank),
                           _heads(vv, s.num_key_value_heads, D, size, rank)])
            kind = "column"
        elif k.endswith("mlp.gate_up_proj.weight"):
            n = I // size
            t, kind = torch.cat([v[rank * n:(rank + 1) * n], v[I + rank * n:I + (rank + 1) * n]]), "column"
        elif k.endswith("self_attn.o_proj.weight") or k.endswith("mlp.down_proj.weight"):
            K = v.shape[1]
            t = v[rank * (H // size):(rank + 1) * (H // size)] if full_k else v[:, rank * (K // size):(rank + 1) * (K // size)]
            kind = "row"
        elif k.endswith("self_attn.o_proj.bias"):
            t, kind = (v[rank * (H // size):(rank + 1) * (H // size)] if full_k else v), "row_bias"
        elif k.endswith("self_attn.q_norm.weight") or k.endswith("self_attn.k_norm.weight"):
            t, kind = v, "head_norm"
        else:
            t, kind = v, "replicated"
        out[k] = t.contiguous().clone()
        kinds[k] = kind
    return Qwen3ForCausalLM(local_spec, out), TPLayout(size, rank, row_scheme, vocab, kinds, schemes)


class TensorParallelOps:
    """The operators of one side (``base``: an :class:`~rl_engine.engine.OpsProvider`), with the
    calls on sharded parameters of ``model`` routed to the tensor-parallel blocks.

    Args:
        base: the side's provider (plan letters apply to the local arithmetic).
        model: the local model from :func:`shard_qwen3`; layout: its :class:`TPLayout`.
        group: the TP :class:`~rl_engine.distributed.transports.Group` (size = ``layout.size``).
    """

    def __init__(self, base, model, layout: TPLayout, group: Group):
        if group.size != layout.size or group.rank != layout.rank:
            raise ValueError(f"group: rank {group.rank} of {group.size}, but the layout is rank {layout.rank} of {layout.size}")
        self.base, self.layout, self.group = base, layout, group
        self._kind = {id(t): layout.kinds[k] for k, t in model.params.items()}
        self._scheme = {id(t): layout.row_schemes[k] for k, t in model.params.items() if k in layout.row_schemes}
        self._vocab_size = sum(hi - lo for lo, hi in layout.vocab)
        self._blocks = [-(-(hi - lo) // VOCAB_BLOCK) for lo, hi in layout.vocab]

    def __getattr__(self, name):  # every operator not overridden: the side's own
        return getattr(self.base, name)

    def _k(self, t) -> str | None:
        return self._kind.get(id(t))

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._k(weight) != "vocab":
            return self.base.embedding(ids, weight)
        return vocab_parallel_embedding(ids, weight, self.layout.vocab[self.layout.rank][0], self.group)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kind = self._k(weight)
        if kind == "column":
            n_total = weight.shape[0] * self.group.size
            return column_parallel_linear(x, weight, bias, self.group, n_total=n_total)
        if kind == "row":
            return row_parallel_linear(x, weight, bias, self.group, scheme=self._scheme[id(weight)])
        return self.base.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._k(weight) != "head_norm":
            return self.base.rms_norm(x, weight, eps)
        full = gather_heads(x, self.group, dim=1)
        return slice_heads(self.base.rms_norm(full.contiguous(), weight, eps), self.group, dim=1)

    def lm_head_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, *, return_entropy: bool = False,
                         token_chunk: int | None = None, vocab_chunk: int | None = None, kept=None):
        if self._k(weight) != "vocab":
            extra = {"kept": kept} if kept is not None else {}
            return self.base.lm_head_logprobs(hidden, weight, targets, temperature, return_entropy=return_entropy,
                                              token_chunk=token_chunk, vocab_chunk=vocab_chunk, **extra)
        if kept is not None:
            raise ValueError("kept: top-k / top-p kept-set records are not supported by the vocabulary-parallel "
                             "log-prob; score the full distribution (kept=None)")
        out = vocab_parallel_logprobs(hidden, weight, targets, self.group, start=self.layout.vocab[self.layout.rank][0],
                                      vocab_size=self._vocab_size, blocks=self._blocks, temperature=temperature,
                                      return_entropy=return_entropy, token_chunk=token_chunk)
        return (out[0], out[1]) if return_entropy else (out, None)


def unshard_qwen3(local: dict[str, torch.Tensor], model_spec, layout: TPLayout, group: Group) -> dict[str, torch.Tensor]:
    """The full tensors of the model's parameter names from every TP rank's ``local`` shards
    (parameters or their gradients; a collective over ``group``, every rank gets the result).

    Args:
        local: this rank's tensors by parameter name (``None`` entries are taken as zeros).
        model_spec: the **full** model's spec; layout: this rank's :class:`TPLayout`.
    """
    s = model_spec
    p = group.size
    I = s.intermediate_size
    vocab_sizes = [hi - lo for lo, hi in layout.vocab]
    out: dict[str, torch.Tensor] = {}
    for k in sorted(local):
        t = local[k]
        kind = layout.kinds[k]
        full_k = layout.row_schemes.get(k) == "full_k"
        if kind in ("replicated", "head_norm") or (kind == "row_bias" and not full_k):
            out[k] = t
            continue
        if kind == "vocab":
            out[k] = group.all_gather_sizes(t.contiguous(), vocab_sizes, dim=0)
            continue
        if kind in ("row", "row_bias"):
            out[k] = group.all_gather(t.contiguous(), dim=0 if (full_k or t.dim() == 1) else 1)
            continue
        parts = group.all_gather(t.contiguous(), dim=0).chunk(p, dim=0)
        if ".self_attn.qkv_proj." in k:
            qn, kvn = s.q_size // p, s.kv_size // p
            split = [q.split([qn, kvn, kvn]) for q in parts]
            out[k] = torch.cat([torch.cat([x[i] for x in split]) for i in range(3)])
        else:  # gate_up: [gate_r; up_r] per rank
            n = I // p
            out[k] = torch.cat([torch.cat([q[:n] for q in parts]), torch.cat([q[n:] for q in parts])])
    return out
