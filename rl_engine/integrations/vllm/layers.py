"""Out-of-tree replacements of vLLM's Qwen3 layers, built from rl_engine operators.

Each class subclasses the vLLM layer it replaces and is registered with vLLM's own extension
point (``CustomOp.register_oot`` / ``PluggableLayer.register_oot``): when a model builds, say,
``RMSNorm(...)``, vLLM instantiates :class:`RlkRMSNorm` instead. Parameters, weight loaders
and module names are vLLM's, so checkpoints, TRL weight sync (``load_weights``) and
``named_parameters`` keep working; only the arithmetic changes.

=========================== ===================================================================
vLLM class                  rl_engine replacement
=========================== ===================================================================
RMSNorm                     ``norm.rms_norm``; with a residual ``norm.fused_add_rms_norm``
SiluAndMul                  ``activation.silu_and_mul``
RotaryEmbedding             ``rope.apply_rope`` (neox / rotate-half, theta = ``base``)
QKVParallelLinear,          ``gemm.linear`` with the merged weight, one call (column-chunk
MergedColumnParallelLinear, invariance: the q/k/v and gate/up column slices have the bits of
ColumnParallelLinear,       separate projections)
ReplicatedLinear
RowParallelLinear           TP=1: ``gemm.linear``. TP>1: run as column-parallel with full K
                            (see :class:`RlkRowParallelLinear`) so the K reduction order is the
                            unsharded one
VocabParallelEmbedding      ``embedding.embedding`` (TP>1: masked shard lookup + all-reduce of
                            one value and zeros, which is exact)
ParallelLMHead              ``gemm.linear`` for the logits (vocab shards are column slices;
                            the logits all-gather is a concatenation)
GateLinear, RoutedExperts,  the MoE layer: ``gemm.linear`` router, ``moe.route``,
MoERunner                   ``moe.expert_gate_up`` / ``moe.expert_down_combine`` (TP>1 without
                            partial-sum all-reduce; :mod:`.moe`)
=========================== ===================================================================

Linear layers keep plain weights: the swapped quant method's ``process_weights_after_loading``
does nothing, where vLLM-CPU's would replace the weight by a prepacked handle (which is what
breaks TRL's weight sync with ``'Parameter' object has no attribute 'weight_loader'``).

This module imports vLLM; only :func:`~.plugin.install` imports it.
"""

from __future__ import annotations

import torch
from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
    get_masked_input_and_mask,
)

from rl_engine.integrations.vllm import stats

__all__ = ["OOT_CLASSES", "RlkLinearMethod", "RlkEmbeddingMethod"]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from rl_engine.ops.gemm import linear

    return linear(x.contiguous(), weight, bias)


# --------------------------------------------------------------------------------------------
# quant methods: plain weights, rl_engine GEMM


class RlkLinearMethod(UnquantizedLinearMethod):
    """``UnquantizedLinearMethod`` whose ``apply`` is ``rl_engine.ops.gemm.linear`` and which
    keeps the loaded weight as a plain ``Parameter`` (no CPU prepacking)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return stats.run(type(layer).__name__.removeprefix("Rlk"), _linear, x, layer.weight, bias)


class RlkEmbeddingMethod(UnquantizedEmbeddingMethod):
    """``UnquantizedEmbeddingMethod`` with rl_engine's embedding lookup and LM-head GEMM."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return stats.run("ParallelLMHead", _linear, x, layer.weight, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        from rl_engine.ops.embedding import embedding

        return stats.run("VocabParallelEmbedding", embedding, input_.contiguous(), layer.weight)


def _swap_linear_method(layer: torch.nn.Module) -> None:
    if type(layer.quant_method) is not UnquantizedLinearMethod:
        raise TypeError(
            f"quant_method: the rl_engine vLLM plugin supports unquantized linear layers only, "
            f"{getattr(layer, 'prefix', type(layer).__name__)} uses {type(layer.quant_method).__name__}"
        )
    layer.quant_method = RlkLinearMethod()


# --------------------------------------------------------------------------------------------
# elementwise / norm / rope


class RlkRMSNorm(RMSNorm):
    """``RMSNorm`` → ``norm.rms_norm`` / ``norm.fused_add_rms_norm`` (out of place)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        from rl_engine.ops.norm import fused_add_rms_norm, rms_norm

        if self.variance_size_override is not None or not self.has_weight:
            raise ValueError("x: rl_engine RMSNorm needs a weight and the full hidden size for the variance")
        eps = float(self.variance_epsilon)
        if residual is None:
            return stats.run("RMSNorm", rms_norm, x.contiguous(), self.weight.data, eps)
        return stats.run("RMSNorm", fused_add_rms_norm, x.contiguous(), residual.contiguous(), self.weight.data, eps)


class RlkSiluAndMul(SiluAndMul):
    """``SiluAndMul`` → ``activation.silu_and_mul``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from rl_engine.ops.activation import silu_and_mul

        return stats.run("SiluAndMul", silu_and_mul, x.contiguous())


class RlkRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` (neox style) → ``rope.apply_rope`` at the given positions, with
    rl_engine's own cos/sin table (``rope.rope_cos_sin``; vLLM's ``cos_sin_cache`` is unused)."""

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        from rl_engine.ops.rope import apply_rope

        if not self.is_neox_style:
            raise ValueError("query: rl_engine RoPE implements the neox (rotate-half) layout only")
        pos = positions.flatten().contiguous()
        T = pos.shape[0]
        D, R, theta = self.head_size, self.rotary_dim, float(self.base)

        def rot(x: torch.Tensor) -> torch.Tensor:
            return apply_rope(x.reshape(T, -1, D).contiguous(), pos, theta=theta, rotary_dim=R).view(x.shape)

        q = stats.run("RotaryEmbedding", rot, query)
        k = stats.run("RotaryEmbedding", rot, key) if key is not None else None
        return q, k


# --------------------------------------------------------------------------------------------
# linear layers


def _column_forward(self, input_):
    bias = self.bias if not self.skip_bias_add else None
    out = self.quant_method.apply(self, input_, bias)
    if getattr(self, "gather_output", False) and getattr(self, "tp_size", 1) > 1:
        out = tensor_model_parallel_all_gather(out)  # concatenation: exact
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)


class RlkReplicatedLinear(ReplicatedLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_linear_method(self)

    forward = _column_forward


class RlkColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_linear_method(self)

    forward = _column_forward


class RlkMergedColumnParallelLinear(MergedColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_linear_method(self)

    forward = _column_forward


class RlkQKVParallelLinear(QKVParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_linear_method(self)

    forward = _column_forward


class RlkRowParallelLinear(RowParallelLinear):
    r"""Row-parallel linear with the **unsharded** K reduction order at any TP size.

    vLLM shards ``W [N, K]`` along K and all-reduces the ranks' partial products: a different
    summation order from the TP=1 trainer, so the bits change with the TP size. Here, for
    ``tp > 1``, each rank holds the rows ``N/tp · r .. N/tp · (r+1)`` of ``W`` **with full K**
    (same memory as vLLM's shard, loaded by :meth:`weight_loader_v2` from the full checkpoint
    tensor, also by TRL weight sync), and the forward is::

        x_full = all_gather(x_r, dim=-1)          # [T, K]  exact (concatenation)
        y_r    = gemm.linear(x_full, W_r)         # [T, N/tp]  full-K rows: the TP=1 bits of these columns
        y      = all_gather(y_r, dim=-1)          # [T, N]  exact

    FLOPs per rank are vLLM's (``T·K·N/tp``); communication is two all-gathers (``T·K`` and
    ``T·N`` elements in total) instead of one all-reduce of ``T·N``. Column-chunk invariance of
    ``gemm.linear`` makes ``y`` raw-bit equal to the TP=1 product.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _swap_linear_method(self)
        if self.tp_size > 1:
            if not self.reduce_results:
                raise ValueError(f"reduce_results: rl_engine's TP-invariant row-parallel linear always returns the full "
                                 f"output; {getattr(self, 'prefix', '')} asks for unreduced partial sums")
            if self.output_size % self.tp_size:
                raise ValueError(f"output_size: {self.output_size} is not divisible by tp_size={self.tp_size}")
            n = self.output_size // self.tp_size
            w = self.weight
            w.data = torch.empty((n, self.input_size), dtype=w.dtype, device=w.device)

    def weight_loader(self, param, loaded_weight: torch.Tensor):
        if self.tp_size == 1 or param is not self.weight:
            return super().weight_loader(param, loaded_weight)
        self._load_output_shard(param, loaded_weight)

    def weight_loader_v2(self, param, loaded_weight: torch.Tensor):
        if self.tp_size == 1 or param is not self.weight:
            return super().weight_loader_v2(param, loaded_weight)
        self._load_output_shard(param, loaded_weight)

    def _load_output_shard(self, param, loaded_weight: torch.Tensor) -> None:
        n = param.data.shape[0]
        if tuple(loaded_weight.shape) != (self.output_size, self.input_size):
            raise ValueError(f"loaded_weight: expected the full [{self.output_size}, {self.input_size}] weight of "
                             f"{getattr(self, 'prefix', 'the layer')}, got {tuple(loaded_weight.shape)}")
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, input_):
        if self.tp_size == 1:
            return _column_forward(self, input_)
        x = input_
        if self.input_is_parallel:
            x = tensor_model_parallel_all_gather(input_.contiguous(), dim=-1)
        n = self.weight.shape[0]
        bias = None
        if self.bias is not None and not self.skip_bias_add:
            bias = self.bias.narrow(0, self.tp_rank * n, n).contiguous()
        y = self.quant_method.apply(self, x, bias)
        y = tensor_model_parallel_all_gather(y, dim=-1)
        if not self.return_bias:
            return y
        return y, (self.bias if self.skip_bias_add else None)


# --------------------------------------------------------------------------------------------
# embedding / LM head


class RlkVocabParallelEmbedding(VocabParallelEmbedding):
    """Token embedding through ``embedding.embedding``. TP>1: each rank looks up its vocabulary
    shard, zeroes the other rows and all-reduces — every output element is one value plus
    zeros, which any summation order returns exactly (a ``-0.0`` entry would become ``+0.0``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.quant_method) is not UnquantizedEmbeddingMethod:
            raise TypeError(f"quant_method: unquantized embeddings only, got {type(self.quant_method).__name__}")
        self.quant_method = RlkEmbeddingMethod()
        self.use_fused_embedding = False

    def forward(self, input_):
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_.long())
        si = self.shard_indices
        masked, mask = get_masked_input_and_mask(input_, si.org_vocab_start_index, si.org_vocab_end_index,
                                                 si.num_org_vocab_padding, si.added_vocab_start_index,
                                                 si.added_vocab_end_index)
        out = self.quant_method.embedding(self, masked.long())
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out


class RlkParallelLMHead(ParallelLMHead):
    """LM head whose logits GEMM is ``gemm.linear`` (through :class:`RlkEmbeddingMethod`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.quant_method) is not UnquantizedEmbeddingMethod:
            raise TypeError(f"quant_method: unquantized LM heads only, got {type(self.quant_method).__name__}")
        self.quant_method = RlkEmbeddingMethod()
        self.use_fused_embedding = False


#: vLLM class → its replacement (registered with ``register_oot`` under the vLLM class name).
OOT_CLASSES: dict[type, type] = {
    RMSNorm: RlkRMSNorm,
    SiluAndMul: RlkSiluAndMul,
    RotaryEmbedding: RlkRotaryEmbedding,
    ReplicatedLinear: RlkReplicatedLinear,
    ColumnParallelLinear: RlkColumnParallelLinear,
    MergedColumnParallelLinear: RlkMergedColumnParallelLinear,
    QKVParallelLinear: RlkQKVParallelLinear,
    RowParallelLinear: RlkRowParallelLinear,
    VocabParallelEmbedding: RlkVocabParallelEmbedding,
    ParallelLMHead: RlkParallelLMHead,
}

# the mixture-of-experts layers (GateLinear, RoutedExperts, MoERunner): rl_engine.integrations.vllm.moe
from rl_engine.integrations.vllm.moe import MOE_OOT_CLASSES  # noqa: E402  (moe.py uses the helpers above)

OOT_CLASSES.update(MOE_OOT_CLASSES)
