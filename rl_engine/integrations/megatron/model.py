"""A Megatron-core ``GPTModel`` of a Qwen3 dense model on rl_engine's layers, with HF checkpoint conversion.

:class:`MegatronQwen3` builds ``GPTModel`` (``position_embedding_type="none"``, tied embedding)
from :func:`~rl_engine.integrations.megatron.layers.qwen3_block_spec`, replaces its word
embedding by a whole-block vocabulary shard (:func:`~rl_engine.distributed.tensor_parallel.vocab_parallel_embedding`)
and scores tokens with :func:`~rl_engine.distributed.tensor_parallel.vocab_parallel_logprobs`
on the final hidden states — so a token's log-prob is raw-bit equal to rl_engine's single-process
Qwen3 (the train side of ``rlk check``, hence its rollout side) at every TP size.

HF ↔ Megatron names, per TP rank ``r`` of ``p`` (``G`` KV groups of ``R = heads / G`` query heads):

======================================  ============================================================
HF tensor                               Megatron parameter (this rank's part)
======================================  ============================================================
``model.embed_tokens.weight``           ``embedding.word_embeddings.weight`` rows of the block-aligned
                                        vocabulary shard ``r``
``…input_layernorm.weight``             ``decoder.layers.i.input_layernorm.weight``
``…self_attn.{q,k,v}_proj.weight``      ``…self_attention.linear_qkv.weight``: per KV group
                                        ``[q heads of the group; k; v]`` (Megatron's grouped layout),
                                        groups ``r·G/p ..`` of this rank
``…self_attn.{q,k}_norm.weight``        ``…self_attention.{q,k}_layernorm.weight``
``…self_attn.o_proj.weight``            ``…self_attention.linear_proj.weight`` (rows ``[H/p, K]`` for
                                        ``full_k``, columns ``[H, K/p]`` otherwise)
``…post_attention_layernorm.weight``    ``…pre_mlp_layernorm.weight``
``…mlp.{gate,up}_proj.weight``          ``…mlp.linear_fc1.weight`` = ``[gate_r; up_r]``
``…mlp.down_proj.weight``               ``…mlp.linear_fc2.weight`` (as ``linear_proj``)
``model.norm.weight``                   ``decoder.final_layernorm.weight``
======================================  ============================================================

Megatron needs ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=p)`` on an
initialised ``torch.distributed`` world (gloo on CPU) before the model is built.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_engine.distributed.algorithms.vocab import VOCAB_BLOCK, vocab_partition
from rl_engine.distributed.tensor_parallel import vocab_parallel_embedding, vocab_parallel_logprobs
from rl_engine.distributed.transports import Group

__all__ = ["MegatronQwen3", "hf_to_megatron", "megatron_to_hf"]


class _VocabShardEmbedding(torch.nn.Module):
    """``word_embeddings`` slot: rows ``[start, start + V_r)`` of the tied table."""

    def __init__(self, rows: int, hidden: int, start: int, group: Group, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, hidden, dtype=dtype))
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.start, self.group)


def _qkv_grouped(q, k, v, spec) -> torch.Tensor:
    """HF ``q [Hq·D, H]``, ``k``, ``v [Hkv·D, H]`` → Megatron's grouped ``[G · (R + 2) · D, H]``."""
    D, G = spec.head_dim, spec.num_key_value_heads
    R = spec.num_attention_heads // G
    qg = q.reshape(G, R * D, -1)
    return torch.cat([qg, k.reshape(G, D, -1), v.reshape(G, D, -1)], dim=1).reshape(G * (R + 2) * D, -1)


def _qkv_ungrouped(w, spec):
    D, G = spec.head_dim, spec.num_key_value_heads
    R = spec.num_attention_heads // G
    g = w.reshape(G, (R + 2) * D, -1)
    q, k, v = g.split([R * D, D, D], dim=1)
    return q.reshape(G * R * D, -1), k.reshape(G * D, -1), v.reshape(G * D, -1)


def hf_to_megatron(sd: dict[str, torch.Tensor], spec, tp: int, rank: int, *, row_scheme: str = "full_k") -> dict[str, torch.Tensor]:
    """This TP rank's Megatron state dict from a HF Qwen3 state dict (names in the module table)."""
    H, I = spec.hidden_size, spec.intermediate_size
    out = {}
    lo, hi = vocab_partition(spec.vocab_size, tp)[rank]
    out["embedding.word_embeddings.weight"] = sd["model.embed_tokens.weight"][lo:hi]
    full_k = row_scheme == "full_k"

    def row(w):
        K = w.shape[1]
        return w[rank * (H // tp):(rank + 1) * (H // tp)] if full_k else w[:, rank * (K // tp):(rank + 1) * (K // tp)]

    for i in range(spec.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = _qkv_grouped(sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"],
                           sd[p + "self_attn.v_proj.weight"], spec)
        n = qkv.shape[0] // tp
        out[m + "self_attention.linear_qkv.weight"] = qkv[rank * n:(rank + 1) * n]
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[m + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = row(sd[p + "self_attn.o_proj.weight"])
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        f = I // tp
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"][rank * f:(rank + 1) * f],
                                                      sd[p + "mlp.up_proj.weight"][rank * f:(rank + 1) * f]])
        out[m + "mlp.linear_fc2.weight"] = row(sd[p + "mlp.down_proj.weight"])
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_to_hf(sd: dict[str, torch.Tensor], spec, group: Group, *, row_scheme: str = "full_k") -> dict[str, torch.Tensor]:
    """The HF Qwen3 state dict from every TP rank's Megatron state dict (a collective over ``group``;
    every rank gets the result). Also converts gradients (pass ``{name: p.grad}``)."""
    tp, I = group.size, spec.intermediate_size
    full_k = row_scheme == "full_k"
    sizes = [hi - lo for lo, hi in vocab_partition(spec.vocab_size, tp)]
    out = {"model.embed_tokens.weight": group.all_gather_sizes(sd["embedding.word_embeddings.weight"].contiguous(), sizes)}
    for i in range(spec.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _qkv_ungrouped(group.all_gather(sd[m + "self_attention.linear_qkv.weight"].contiguous()), spec)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"], out[p + "self_attn.v_proj.weight"] = q, k, v
        out[p + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[p + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
        out[p + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
        for hf, mg in (("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                       ("mlp.down_proj.weight", "mlp.linear_fc2.weight")):
            out[p + hf] = group.all_gather(sd[m + mg].contiguous(), dim=0 if full_k else 1)
        out[p + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        parts = group.all_gather(sd[m + "mlp.linear_fc1.weight"].contiguous()).chunk(tp)
        f = I // tp
        out[p + "mlp.gate_proj.weight"] = torch.cat([x[:f] for x in parts])
        out[p + "mlp.up_proj.weight"] = torch.cat([x[f:] for x in parts])
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    return out


class MegatronQwen3(torch.nn.Module):
    """A Qwen3 dense ``GPTModel`` of Megatron-core on rl_engine's layers (this TP rank's part).

    Args:
        spec: the model's :class:`~rl_engine.models.qwen3.Qwen3Spec` (tied embeddings, no
            attention bias).
        row_scheme: the row-parallel scheme (``full_k`` or ``exact_k``; ``native`` is the control).
        dtype: parameter dtype.

    Build with :meth:`from_hf_state_dict` / :meth:`from_pretrained` (a HF checkpoint directory).
    """

    def __init__(self, spec, *, row_scheme: str = "full_k", dtype: torch.dtype = torch.float32):
        super().__init__()
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        from rl_engine.integrations.megatron.layers import qwen3_block_spec

        if not spec.tie_word_embeddings:
            raise ValueError("spec.tie_word_embeddings: the Megatron adapter shards the tied embedding as the LM head")
        if spec.attention_bias:
            raise ValueError("spec.attention_bias: q/k/v/o biases are not supported by the Megatron adapter")
        self.spec, self.row_scheme = spec, row_scheme
        self.group = Group(parallel_state.get_tensor_model_parallel_group())
        tp, rank = self.group.size, self.group.rank
        cfg = TransformerConfig(
            num_layers=spec.num_hidden_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.intermediate_size,
            num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_key_value_heads,
            kv_channels=spec.head_dim, normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, use_cpu_initialization=True,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, bias_dropout_fusion=False, apply_rope_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        )
        cfg.rlk_row_scheme, cfg.rlk_rope_theta = row_scheme, spec.rope_theta
        self.config = cfg
        self.gpt = GPTModel(cfg, qwen3_block_spec(spec.num_hidden_layers), vocab_size=spec.vocab_size,
                            max_sequence_length=spec.max_position_embeddings, pre_process=True, post_process=True,
                            share_embeddings_and_output_weights=True, position_embedding_type="none")
        lo, hi = vocab_partition(spec.vocab_size, tp)[rank]
        self.vocab_start = lo
        self.blocks = [-(-(b - a) // VOCAB_BLOCK) for a, b in vocab_partition(spec.vocab_size, tp)]
        self.gpt.embedding.word_embeddings = _VocabShardEmbedding(hi - lo, spec.hidden_size, lo, self.group, dtype)
        self.gpt.output_layer = None  # log-probs come from the vocabulary-parallel head below

    # --- construction ----------------------------------------------------------------------
    def megatron_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the names of :func:`hf_to_megatron`."""
        return {k: v for k, v in self.gpt.named_parameters()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> "MegatronQwen3":
        """Copy this rank's part of a HF Qwen3 state dict into the parameters (exact copies)."""
        mine = hf_to_megatron(sd, self.spec, self.group.size, self.group.rank, row_scheme=self.row_scheme)
        params = self.megatron_state_dict()
        missing = sorted(set(params) - set(mine))
        if missing:
            raise ValueError(f"sd: no HF tensor converts to {missing[:3]}")
        with torch.no_grad():
            for k, p in params.items():
                if tuple(p.shape) != tuple(mine[k].shape):
                    raise ValueError(f"sd: {k} converts to shape {tuple(mine[k].shape)}, the model holds {tuple(p.shape)}")
                p.copy_(mine[k].to(p.dtype))
        return self

    @classmethod
    def from_hf_state_dict(cls, spec, sd: dict[str, torch.Tensor], **kw) -> "MegatronQwen3":
        return cls(spec, **kw).load_hf_state_dict(sd)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32, **kw) -> "MegatronQwen3":
        """Load ``config.json`` and the safetensors of a HF Qwen3 checkpoint directory."""
        from rl_engine.models.qwen3 import Qwen3ForCausalLM

        ref = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return cls.from_hf_state_dict(ref.spec, ref.to_hf_state_dict(), dtype=dtype, **kw)

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF state dict (gathered over the TP ranks; every rank gets it)."""
        sd = {k: v.detach() for k, v in self.megatron_state_dict().items()}
        return megatron_to_hf(sd, self.spec, self.group, row_scheme=self.row_scheme)

    # --- forward ---------------------------------------------------------------------------
    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states ``[T, H]`` of a packed batch (``ids``, ``positions`` ``[T]``)."""
        from rl_engine.integrations.megatron.layers import packed_batch

        with packed_batch(positions, cu_seqlens):
            emb = self.gpt.embedding(input_ids=ids[None], position_ids=positions[None])  # [T, 1, H]
            h = self.gpt.decoder(hidden_states=emb, attention_mask=None)
        return h[:, 0]

    def token_logprobs(self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0, *, kept=None) -> torch.Tensor:
        """``log softmax(h W_embᵀ / T)[targets]`` ``[T]`` float32 on every TP rank; with ``kept``
        (a :class:`~rl_engine.ops.logprob.KeptSet` ``[T]``, one record per target) renormalised
        over each token's kept set — the processed log-prob a top-k / top-p rollout reports."""
        h = self.hidden(ids, positions, cu_seqlens)
        return vocab_parallel_logprobs(h, self.gpt.embedding.word_embeddings.weight, targets, self.group,
                                       start=self.vocab_start, vocab_size=self.spec.vocab_size, blocks=self.blocks,
                                       temperature=temperature,
                                       kept_threshold=None if kept is None else kept.threshold,
                                       kept_boundary=None if kept is None else kept.boundary)
