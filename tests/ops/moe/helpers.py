"""Inputs and native (HF-style) controls shared by the MoE operator tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def randn(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(dtype)


def block(T, H, E, I, dtype, seed=0):
    """``x [T, H]``, router ``[E, H]``, gate/up ``[E, 2I, H]``, down ``[E, H, I]``."""
    return (randn((T, H), dtype, seed), randn((E, H), dtype, seed + 1, H**-0.5),
            randn((E, 2 * I, H), dtype, seed + 2, H**-0.5), randn((E, H, I), dtype, seed + 3, I**-0.5))


def distinct_logits(T, E, dtype, seed=0) -> torch.Tensor:
    """Router logits whose values in every row are distinct and at least 2^-4 apart (in bf16 too):
    the top-k set is unambiguous, so float64 references pick the same experts."""
    g = torch.Generator().manual_seed(seed)
    base = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float()
    return (base * 0.25 - E * 0.125).to(dtype)


def ids_with_loads(T, E, K, seed=0) -> torch.Tensor:
    """``[T, K]`` distinct expert ids per token drawn at random (expert loads vary from batch to batch)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def native_experts(x, w_gate_up, w_down, weights, ids):
    """HF ``Qwen3MoeExperts.forward`` (transformers 5.x): per expert, ``F.linear`` on its tokens, then
    ``index_add_`` of ``weight · y`` in the model dtype. No invariance contract: the expert GEMMs see
    a row count that follows the batch."""
    out = torch.zeros_like(x)
    E = w_gate_up.shape[0]
    mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        k, t = torch.where(mask[e])
        if t.numel() == 0:
            continue
        gate, up = F.linear(x[t], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])
        out.index_add_(0, t, (y * weights[t, k, None].to(x.dtype)).to(x.dtype))
    return out


def thread_split_experts(x, w_gate_up, w_down, weights, ids):
    """:func:`native_experts` whose down projection splits its reduction into one partial product
    per intra-op thread and adds the partials, as a threaded BLAS may split a GEMM's K dimension
    (Intel MKL does for HF's eager experts at some shapes; AMD hosts may not): a thread-dependent
    control whose bits differ between 1 and 2 threads on any CPU."""
    out = torch.zeros_like(x)
    E = w_gate_up.shape[0]
    mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
    parts = torch.get_num_threads()
    for e in range(E):
        k, t = torch.where(mask[e])
        if t.numel() == 0:
            continue
        gate, up = F.linear(x[t], w_gate_up[e]).chunk(2, dim=-1)
        act = F.silu(gate) * up
        y = sum(F.linear(a, w) for a, w in zip(act.chunk(parts, -1), w_down[e].chunk(parts, -1)))
        out.index_add_(0, t, (y * weights[t, k, None].to(x.dtype)).to(x.dtype))
    return out


def native_route(logits, top_k, renormalize):
    """HF ``Qwen3MoeTopKRouter``: fp32 softmax, ``torch.topk`` of the probabilities, renormalised."""
    p = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, ids = torch.topk(p, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids
