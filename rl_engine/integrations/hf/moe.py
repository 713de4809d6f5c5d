"""Replacement forwards of transformers' Qwen3-MoE block, built from ``rl_engine.ops.moe``.

transformers 5.x builds a sparse layer's MLP as ``Qwen3MoeSparseMoeBlock`` holding a router
(``gate``: ``Qwen3MoeTopKRouter``, weight ``[E, H]``) and the experts (``experts``:
``Qwen3MoeExperts``, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``). The install
(:data:`~rl_engine.integrations.hf.install.SUBSTITUTIONS`) binds one forward to each:

* :func:`router_forward` — ``logits = gemm.linear(x, weight)`` (the model dtype, as HF's
  ``F.linear``), ``weights, ids = moe.route(logits, top_k, norm_topk_prob)``; returns HF's
  ``(router_logits, router_scores, router_indices)`` with fp32 scores (HF casts them to the
  model dtype; the rl-kernel combine takes them in fp32);
* :func:`experts_forward` — ``moe.experts(x, gate_up_proj, down_proj, weights, ids)``;
* :func:`sparse_moe_block_forward` — HF's block: flatten the tokens, call ``self.gate`` and
  ``self.experts`` as modules (so hooks fire: the router-logits recorder behind
  ``output_router_logits``, and frameworks that gather parameters in module hooks), reshape.

Every token row goes through the same row-invariant operators in a training forward (padded
batch, all positions) and in each ``generate`` step (one new token per sequence), so its bits
do not depend on the batch or on how many tokens its experts received.
"""

from __future__ import annotations

import torch

__all__ = ["router_forward", "experts_forward", "sparse_moe_block_forward", "MOE_SUBSTITUTIONS"]


def router_forward(self, hidden_states: torch.Tensor):
    """``Qwen3MoeTopKRouter.forward``: ``[..., H] -> (logits [T, E], weights [T, K] fp32, ids [T, K])``."""
    from rl_engine.ops.gemm import linear
    from rl_engine.ops.moe import route

    x = hidden_states.reshape(-1, self.hidden_dim).contiguous()
    logits = linear(x, self.weight)
    weights, ids = route(logits, int(self.top_k), bool(self.norm_topk_prob))
    return logits, weights, ids


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """``Qwen3MoeExperts.forward``: ``x [T, H]``, ``ids [T, K]``, ``weights [T, K]`` → ``[T, H]``."""
    from rl_engine.ops.moe import experts

    if getattr(self.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: expected 'silu', got {self.config.hidden_act!r}")
    if getattr(self, "is_transposed", False) or not getattr(self, "is_concatenated", True) or getattr(self, "has_bias", False):
        raise ValueError("gate_up_proj: rl_engine's experts take transformers' concatenated [E, 2I, H] gate/up layout "
                         "without biases")
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError("experts: expert parallelism is not supported by the rl_engine HF install")
    return experts(hidden_states.contiguous(), self.gate_up_proj, self.down_proj, top_k_weights.float().contiguous(),
                   top_k_index.long().contiguous())


def sparse_moe_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3MoeSparseMoeBlock.forward``: ``[B, L, H] -> [B, L, H]`` through ``self.gate`` and ``self.experts``."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1]).contiguous()
    _, weights, ids = self.gate(x)
    return self.experts(x, ids, weights).reshape(shape)


#: transformers class name → replacement forward (merged into the install's table).
MOE_SUBSTITUTIONS = {
    "Qwen3MoeSparseMoeBlock": sparse_moe_block_forward,
    "Qwen3MoeTopKRouter": router_forward,
    "Qwen3MoeExperts": experts_forward,
}
