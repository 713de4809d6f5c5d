"""Native PyTorch ("production", plan letter ``P``) versions of every module a model uses.

These are what a typical engine runs: ``F.linear`` on the whole batch, SDPA (per sequence in
training, against a KV cache in rollout), ``torch.log_softmax``, HF-style RMSNorm / RoPE /
SiLU. They are numerically sensible but carry **no** invariance contract: on CPU the same
token's log-prob differs between the train and rollout paths. ``rlk check --plan P/P`` runs
them as the negative control; the ablation tooling mixes them with the ``R`` (rl-kernel)
operators one module at a time. Signatures mirror the ``rl_engine.ops`` entry points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "linear",
    "embedding",
    "rms_norm",
    "silu_and_mul",
    "apply_rope",
    "varlen_attention",
    "NativeKVCache",
    "cached_attention",
    "token_logprobs",
    "entropy",
    "moe_route",
    "moe_experts",
]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``Qwen3RMSNorm``: normalise in fp32, round to the input dtype, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, *, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """HF rotate-half RoPE on ``x [T, H, D]``: cos/sin in fp32, cast to ``x.dtype``."""
    d = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    xr, xp = x[..., :d], x[..., d:]
    x1, x2 = xr[..., : d // 2], xr[..., d // 2 :]
    rot = torch.cat((-x2, x1), dim=-1)
    out = xr * cos + rot * sin
    return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, q_offset: int) -> torch.Tensor:
    """q ``[n, Hq, D]`` at positions ``q_offset..q_offset+n-1`` over k/v ``[L, Hkv, D]`` (causal)."""
    n, L = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_offset == 0 and n == L:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        qpos = torch.arange(q_offset, q_offset + n, device=q.device)[:, None]
        mask = torch.arange(L, device=q.device)[None, :] <= qpos
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def varlen_attention(q, k, v, cu_seqlens, *, scale=None, window=None):
    """Causal attention per sequence of a packed batch, one SDPA call per sequence."""
    if window is not None:
        raise NotImplementedError("window: the native reference path has no sliding window")
    outs = []
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            outs.append(_sdpa(q[s:e], k[s:e], v[s:e], scale, 0))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


class NativeKVCache:
    """A contiguous KV cache as a plain engine keeps it: ``[max_seqs, max_len, Hkv, D]``."""

    def __init__(self, max_seqs, max_len, num_kv_heads, head_dim, *, dtype=torch.float32, device="cpu"):
        self.k = torch.zeros(max_seqs, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lens = [0] * max_seqs

    def seq_len(self, seq_id: int) -> int:
        return self.lens[seq_id]

    def free(self, seq_id: int) -> None:
        self.lens[seq_id] = 0

    def snapshot(self) -> list[int]:
        """The lengths (rows past a length are never read): :meth:`restore` undoes later appends."""
        return list(self.lens)

    def restore(self, snap: list[int]) -> None:
        self.lens = list(snap)


def cached_attention(q, k_new, v_new, cache: NativeKVCache, seq_ids, cu_seqlens_q, *, scale=None, window=None):
    """Append each sequence's new k/v to ``cache`` and attend causally over everything cached."""
    if window is not None:
        raise NotImplementedError("window: the native reference path has no sliding window")
    ids = seq_ids.tolist() if isinstance(seq_ids, torch.Tensor) else list(seq_ids)
    bounds = cu_seqlens_q.tolist()
    outs = []
    for sid, s, e in zip(ids, bounds[:-1], bounds[1:]):
        start = cache.lens[sid]
        end = start + (e - s)
        cache.k[sid, start:end] = k_new[s:e]
        cache.v[sid, start:end] = v_new[s:e]
        cache.lens[sid] = end
        if e > s:
            outs.append(_sdpa(q[s:e], cache.k[sid, :end], cache.v[sid, :end], scale, start))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def _scaled(logits: torch.Tensor, temperature: float, kept, targets: torch.Tensor | None = None) -> torch.Tensor:
    """``logits / T`` in fp32, ``-inf`` outside each row's kept set (``kept``: a
    ``rl_engine.ops.logprob.KeptSet`` of shape ``logits.shape[:-1]``, or ``None``; ``targets``
    count as kept)."""
    z = logits.float() / temperature
    if kept is None:
        return z
    keep = kept.mask(z)
    if targets is not None:
        keep = keep.scatter(-1, targets.long().unsqueeze(-1), True)
    return z.masked_fill(~keep, float("-inf"))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, kept=None) -> torch.Tensor:
    lp = torch.log_softmax(_scaled(logits, temperature, kept, targets), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor, temperature: float = 1.0, kept=None) -> torch.Tensor:
    lp = torch.log_softmax(_scaled(logits, temperature, kept), dim=-1)
    p = lp.exp()
    return -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``Qwen3MoeTopKRouter``: fp32 softmax, ``torch.topk`` of the probabilities (no documented tie
    order), renormalised, the weights cast to the logits' dtype."""
    p = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    w, ids = torch.topk(p, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(router_logits.dtype), ids


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """HF ``Qwen3MoeExperts`` (eager): per expert, ``F.linear`` on the tokens routed to it, SiLU gate,
    ``F.linear`` down, scaled by the routing weight and ``index_add_``-ed in the model dtype."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w_gate_up.shape[0]).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
        rank, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])
        out.index_add_(0, tok, (y * weights[tok, rank, None].to(y.dtype)).to(out.dtype))
    return out
