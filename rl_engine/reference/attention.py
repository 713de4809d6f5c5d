"""References for ``attention.varlen_attention`` and ``attention.cached_attention`` in float64.

``softmax(QKᵀ·scale + mask)·V`` per sequence, with the causal (and optional sliding-window)
mask and GQA head sharing: query head ``h`` uses kv head ``h // (Hq / Hkv)``. Differentiable,
so tests take reference gradients from it too. No invariance promise.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def _attend_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                window: int | None) -> torch.Tensor:
    """Queries ``q [n, Hq, D]`` at positions ``q_pos`` over keys/values ``[L, Hkv, D]`` at 0..L-1."""
    G = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(G, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    kpos = torch.arange(k.shape[0], device=q.device)
    mask = kpos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kpos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), vv)


def varlen_attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention per packed sequence in float64; returns ``[T, Hq, D]`` float64."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = [int(c) for c in cu_seqlens.tolist()]
    outs = [q.new_zeros((0,) + tuple(q.shape[1:]), dtype=torch.float64)]
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            pos = torch.arange(e - s, device=q.device)
            outs.append(_attend_f64(q[s:e], k[s:e], v[s:e], pos, scale, window))
    return torch.cat(outs)


@register_reference("attention.varlen_attention")
def varlen_attention(q, k, v, cu_seqlens, scale=None, window=None):
    return varlen_attention_f64(q, k, v, cu_seqlens, scale, window).to(q.dtype)


@register_reference("attention.cached_attention")
def cached_attention(q, k_new, v_new, k_cache, v_cache, slot_mapping, page_rows, page_size, q_seq, q_pos, scale, window,
                     decode_only=False):
    """Same arguments as the CPU implementation: write the new rows, then attend in float64
    (``decode_only``, a scheduling hint of the GPU kernels, changes nothing here)."""
    k_cache.index_copy_(0, slot_mapping, k_new)
    v_cache.index_copy_(0, slot_mapping, v_new)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i in torch.unique(q_seq).tolist():
        rows = (q_seq == i).nonzero().squeeze(1)
        pos = q_pos[rows]
        kpos = torch.arange(int(pos.max()) + 1, device=q.device)
        if page_size >= 1 << 62:
            idx = page_rows[i, 0] + kpos
        else:
            idx = page_rows[i, torch.div(kpos, page_size, rounding_mode="floor")] + kpos % page_size
        out[rows] = _attend_f64(q[rows], k_cache[idx], v_cache[idx], pos, scale, window)
    return out.to(q.dtype)
