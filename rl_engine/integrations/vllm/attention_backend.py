"""A vLLM V1 attention backend over vLLM's paged KV cache, computed by rl_engine attention.

vLLM resolves backends by class path; :func:`~.plugin.install` points
``AttentionBackendEnum.CPU_ATTN`` (on CPU, where the platform always picks it) and
``AttentionBackendEnum.CUSTOM`` (selectable on CUDA with ``attention_backend="CUSTOM"``) at
:class:`RlkAttentionBackend`.

KV cache layout. vLLM allocates one buffer and views it per layer as the logical
``[num_blocks, num_kv_heads, block_size, C]`` with ``C = 2 · head_size`` (what the content
means is the backend's business) in the physical order the backend declares. This backend
declares ``KVCacheLayout.LBHNC`` (per layer a contiguous ``[num_blocks, Hkv, block_size, 2D]``
tensor, one ``2 · block_size · Hkv · D`` run per block) and reads each block's run as
``[2, block_size, Hkv, D]``: the block's keys, then its values. Viewed as rows
``[2 · num_blocks · block_size, Hkv, D]``, block ``b``'s key of offset ``o`` is row
``2b · block_size + o`` and its value is ``block_size`` rows further. So with ``bs =
block_size``::

    rows    = kv_cache.view(-1, Hkv, D)                     # contiguous
    k_cache = rows[:-bs].view(2·num_blocks - 1, bs, Hkv, D)  # "block" 2b = keys of block b
    v_cache = rows[bs:].view(2·num_blocks - 1, bs, Hkv, D)   # same index → values of block b
    block_table' = 2 · block_table,  slot' = 2 · (slot // bs) · bs + slot % bs

and :func:`rl_engine.ops.attention.paged_attention` (``page_rows = block_table' · bs``) sees
two contiguous caches with its own paged layout — the form every ``attention.cached_attention``
implementation (CPU and Triton) indexes. vLLM zero-fills the buffer, and only rows of a
sequence's own positions are read.

Each forward (prefill, chunked prefill, decode or any mix: the metadata carries
``query_start_loc``, ``seq_lens``, ``block_table`` and ``slot_mapping``) is one
:func:`~rl_engine.ops.attention.paged_attention_step` call with the step's plan
(:func:`~rl_engine.ops.attention.plan_paged_attention`, made once by the first layer and kept
on the shared metadata): it writes the new tokens' keys and values into the cache and
dispatches to the ``attention.cached_attention`` implementations, exactly as one
:func:`~rl_engine.ops.attention.paged_attention` call, so every output row has the bits
:func:`~rl_engine.ops.attention.varlen_attention` gives the same token in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from rl_engine.integrations.vllm import stats

if TYPE_CHECKING:
    from rl_engine.ops.attention import PagedAttentionPlan

__all__ = ["RlkAttentionBackend", "RlkAttentionMetadata", "RlkAttentionMetadataBuilder", "RlkAttentionImpl"]


class RlkAttentionBackend(AttentionBackend):
    """rl_engine attention for vLLM decoder layers (causal, full or sliding window)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type["RlkAttentionImpl"]:
        return RlkAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["RlkAttentionMetadataBuilder"]:
        return RlkAttentionMetadataBuilder


@dataclass
class RlkAttentionMetadata:
    """One step's batch: ``num_actual_tokens`` query rows, ``query_start_loc [B+1]``,
    ``seq_lens [B]`` (tokens per sequence including this step's), and the block table
    ``[B, W]`` / slot mapping ``[T]`` already mapped to the split key/value blocks
    (``2 · block``; see the module docstring)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    #: The step's validated metadata (``plan_paged_attention``), made by the first layer that runs
    #: and reused by the others: one validation per step, not one per layer.
    plan: PagedAttentionPlan | None = None


class RlkAttentionMetadataBuilder(AttentionMetadataBuilder[RlkAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RlkAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise ValueError("causal: rl_engine attention is causal only")
        B, T = m.num_reqs, m.num_actual_tokens
        bs = self.kv_cache_spec.block_size
        slots = m.slot_mapping[:T].to(torch.int64)
        return RlkAttentionMetadata(
            num_actual_tokens=T,
            query_start_loc=m.query_start_loc[: B + 1],
            seq_lens=m.seq_lens[:B],
            block_table=m.block_table_tensor[:B].to(torch.int64) * 2,
            slot_mapping=torch.div(slots, bs, rounding_mode="floor") * (2 * bs) + slots % bs,
        )


class RlkAttentionImpl(AttentionImpl[RlkAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("alibi_slopes")
        if logits_soft_cap:
            unsupported.append("logits_soft_cap")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype={kv_cache_dtype}")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attn_type={attn_type}")
        if kv_sharing_target_layer_name is not None:
            unsupported.append("kv_sharing_target_layer_name")
        if sinks is not None:
            unsupported.append("sinks")
        if unsupported:
            raise ValueError(f"attention: rl_engine's vLLM backend does not support {', '.join(unsupported)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: RlkAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, kv_cache ``[num_blocks, Hkv, block_size, 2D]``
        (LBHNC, contiguous), output ``[T', Hq, D]`` with ``T' >= T`` (padding rows untouched)."""
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("output_scale: fused output quantization is not supported by rl_engine attention")
        if attn_metadata is None:  # profiling / warm-up run without a batch
            return output
        T = attn_metadata.num_actual_tokens
        D, Hkv = self.head_size, self.num_kv_heads
        nb, _, bs, _ = kv_cache.shape
        if not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache: expected the contiguous LBHNC layer view, got strides {kv_cache.stride()}")
        rows = kv_cache.view(2 * nb * bs, Hkv, D)
        k_cache = rows[:-bs].view(2 * nb - 1, bs, Hkv, D)
        v_cache = rows[bs:].view(2 * nb - 1, bs, Hkv, D)
        out = stats.run("Attention", _paged, query[:T], key[:T], value[:T], k_cache, v_cache,
                        attn_metadata, bs, self.scale, self.sliding_window)
        output[:T].copy_(out)
        return output


def _paged(q, k, v, k_cache, v_cache, md: RlkAttentionMetadata, block_size: int, scale: float, window):
    """One layer: the step's plan (made by the first layer: the metadata is shared by the layers
    of a step), then :func:`~rl_engine.ops.attention.paged_attention_step` — the bits of one
    :func:`~rl_engine.ops.attention.paged_attention` call."""
    from rl_engine.ops.attention import paged_attention_step, plan_paged_attention

    plan = md.plan
    if plan is None or plan.num_blocks != k_cache.shape[0] or plan.block_size != block_size or plan.device != q.device:
        plan = md.plan = plan_paged_attention(md.slot_mapping, md.block_table, block_size, md.query_start_loc,
                                              md.seq_lens, num_blocks=k_cache.shape[0])
    return paged_attention_step(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, plan, scale=scale,
                                window=window)
