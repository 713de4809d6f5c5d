"""Out-of-tree replacements of vLLM's mixture-of-experts layers, built from ``rl_engine.ops.moe``.

vLLM 0.32 builds a Qwen3-MoE block's experts with ``FusedMoEFactory``: a ``MoERunner`` (the
layer's forward: gate, router, experts, the final all-reduce) holding a ``GateLinear`` (the
router GEMM) and a ``RoutedExperts`` (the ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]``
parameters and their checkpoint loaders). All three are ``PluggableLayer``s, so the plugin
replaces each with ``register_oot`` under its class name:

========================= ==============================================================
vLLM class                rl_engine replacement
========================= ==============================================================
GateLinear                ``gemm.linear`` with a plain weight (no CPU prepacking)
RoutedExperts             vLLM's parameters and loaders; the quant method's
                          ``process_weights_after_loading`` is skipped (no repacking or
                          padding); TP>1: ``w2`` holds full-``I`` rows of ``H/tp`` features
MoERunner                 ``forward`` = ``gemm.linear`` (router logits) → ``moe.route`` →
                          ``moe.expert_gate_up`` → ``moe.expert_down_combine``; no all-reduce
========================= ==============================================================

**Tensor parallelism.** vLLM shards the experts' intermediate dimension ``I`` on both GEMMs and
all-reduces the ranks' partial down-projection sums: another summation order at every TP size.
Here rank ``r`` keeps vLLM's ``w13`` shard (the gate and up rows of its ``I`` slice) and loads
``w2`` as the rows ``H/tp·r .. H/tp·(r+1)`` with the **full** ``I`` (same memory as vLLM's
shard)::

    act_r = expert_gate_up(x, w13_r, ids)               # [T, K, I/tp]: act's columns, exactly
    act   = all_gather(act_r, dim=-1)                    # [T, K, I]   concatenation: exact
    out_r = expert_down_combine(act, w2_r, weights, ids) # [T, H/tp]   those columns of the TP=1 result
    out   = all_gather(out_r, dim=-1)                    # [T, H]      exact

The chunk invariances of the two operators (``contracts/operators/moe.*.json``) make ``out``
raw-bit equal to the TP=1 result, and to the training side's.

Supported: softmax top-k routing with or without renormalisation, SiLU, unquantized weights, no
shared experts, expert/data/sequence/context parallelism off. Anything else raises at build time
naming the setting. This module imports vLLM; only :func:`~.plugin.install` imports it.
"""

from __future__ import annotations

import torch
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from rl_engine.integrations.vllm import stats
from rl_engine.integrations.vllm.layers import _linear, _swap_linear_method

__all__ = ["MOE_OOT_CLASSES", "RlkGateLinear", "RlkRoutedExperts", "RlkMoERunner"]


class RlkGateLinear(GateLinear):
    """The router GEMM through ``gemm.linear`` in the model dtype (the training side's ``linear``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_linear_method(self)

    def forward(self, x: torch.Tensor):
        if self.out_dtype is not None and self.out_dtype != self.weight.dtype:
            raise ValueError(f"out_dtype: rl_engine's router GEMM returns the weight dtype {self.weight.dtype}, "
                             f"{getattr(self, 'prefix', 'the gate')} asks for {self.out_dtype}")
        out = stats.run("GateLinear", _linear, x, self.weight, self.bias if not self.skip_bias_add else None)
        return self._return(out)


def _tp(moe_config) -> tuple[int, int]:
    pc = moe_config.moe_parallel_config
    return pc.tp_size, pc.tp_rank


class RlkRoutedExperts(RoutedExperts):
    """vLLM's expert parameters kept as loaded (``[E, 2I/tp, H]`` and, at TP>1, ``[E, H/tp, I]``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.quant_config is not None:
            raise TypeError(f"quant_config: the rl_engine vLLM plugin supports unquantized experts only, "
                            f"{self.layer_name} uses {type(self.quant_config).__name__}")
        # Keep the weights in the checkpoint layout: vLLM-CPU would pad and repack them for its kernels.
        self.quant_method.process_weights_after_loading = lambda layer: None
        tp, _ = _tp(self.moe_config)
        if tp > 1:
            E, H, I_r = self.w2_weight.shape
            if H % tp:
                raise ValueError(f"hidden_size: {H} is not divisible by tp_size={tp} ({self.layer_name})")
            w = self.w2_weight
            w.data = torch.empty((E, H // tp, I_r * tp), dtype=w.dtype, device=w.device)

    def _load_w2(self, expert_data, shard_dim, loaded_weight, tp_rank, load_full=False):
        tp, _ = _tp(self.moe_config)
        if tp == 1:
            return super()._load_w2(expert_data, shard_dim, loaded_weight, tp_rank, load_full)
        n, full_i = expert_data.shape
        if tuple(loaded_weight.shape) != (n * tp, full_i):
            raise ValueError(f"loaded_weight: expected an expert's full [{n * tp}, {full_i}] down_proj of "
                             f"{self.layer_name}, got {tuple(loaded_weight.shape)}")
        expert_data.copy_(loaded_weight.narrow(0, tp_rank * n, n))


class RlkMoERunner(MoERunner):
    """A MoE layer whose forward runs rl_engine's router and experts (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        re, cfg = self.routed_experts, self.moe_config
        name = self.layer_name
        problems = []
        if not isinstance(re, RlkRoutedExperts):
            problems.append("routed_experts were built before the plugin was installed")
        if self.gate is None or not isinstance(self.gate, RlkGateLinear):
            problems.append("the layer has no rl_engine gate (GateLinear) of its own")
        if self._shared_experts is not None or self.shared_expert_gate is not None:
            problems.append("shared experts")
        if self.routed_input_transform is not None or self.routed_output_transform is not None:
            problems.append("routed input/output transforms")
        if self.routed_scaling_factor != 1.0 or re.routed_scaling_factor != 1.0:
            problems.append(f"routed_scaling_factor {re.routed_scaling_factor}")
        if re.scoring_func != "softmax" or re.use_grouped_topk or re.custom_routing_function is not None \
                or re.e_score_correction_bias is not None:
            problems.append(f"routing other than softmax top-k (scoring_func={re.scoring_func!r}, grouped top-k "
                            f"{re.use_grouped_topk}, custom {re.custom_routing_function is not None})")
        if getattr(re.activation, "name", str(re.activation)).lower() not in ("silu",):
            problems.append(f"activation {re.activation}")
        if re.apply_router_weight_on_input:
            problems.append("apply_router_weight_on_input")
        pc = cfg.moe_parallel_config
        if pc.use_ep or pc.dp_size > 1 or pc.pcp_size > 1 or cfg.is_sequence_parallel:
            problems.append("expert, data, context or sequence parallelism")
        if problems:
            raise ValueError(f"{name}: the rl_engine vLLM plugin does not support " + "; ".join(problems))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, input_ids=None,
                shared_experts_input=None) -> torch.Tensor:
        # vLLM's custom-op indirection (torch.compile) into _forward_impl; no all-reduce after it:
        # every rank returns the full output
        return self._forward_entry(hidden_states, router_logits, None, input_ids, self._encode_layer_name(), 0)

    def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
        x = hidden_states.contiguous()
        logits = self.gate(x)  # RlkGateLinear: gemm.linear, counted as GateLinear
        logits = logits[0] if isinstance(logits, tuple) else logits
        return stats.run("FusedMoE", self._rlk_moe, x, logits)

    def _rlk_moe(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        from rl_engine.ops import moe

        re = self.routed_experts
        weights, ids = moe.route(logits, int(re.top_k), bool(re.renormalize))
        w13, w2 = re.w13_weight, re.w2_weight
        if w13.shape[1] != 2 * re.intermediate_size_per_partition:
            raise ValueError(f"w13_weight: expected [E, {2 * re.intermediate_size_per_partition}, H], got "
                             f"{tuple(w13.shape)} ({self.layer_name}: padded or repacked experts)")
        if _tp(self.moe_config)[0] == 1:
            return moe.experts(x, w13, w2, weights, ids)
        act = tensor_model_parallel_all_gather(moe.expert_gate_up(x, w13, ids).contiguous(), dim=-1)
        return tensor_model_parallel_all_gather(moe.expert_down_combine(act, w2, weights, ids), dim=-1)


#: vLLM class → its replacement (registered with ``register_oot`` under the vLLM class name).
MOE_OOT_CLASSES: dict[type, type] = {
    GateLinear: RlkGateLinear,
    RoutedExperts: RlkRoutedExperts,
    MoERunner: RlkMoERunner,
}
