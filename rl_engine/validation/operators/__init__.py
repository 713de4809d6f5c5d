"""Per-operator input generators for the WS1 operator suite.

:data:`CASES` maps an operator id to an :class:`OpCase`: how to draw inputs for ``rows`` rows
in a dtype (``make_inputs(dtype, rows, seed) -> (row_args, shared_args)``), how to call one
registered implementation's function on them (``call(fn, *row_args, *shared_args)``, adapting
to the implementation's full signature) and the float64 reference (the ``*_f64`` functions of
``rl_engine/reference/<family>.py``). Row arguments share a leading row dimension: the unit
the invariance checks re-batch (a token row, or a whole sequence for varlen attention).

Operators without an entry are reported ``n.a.`` with the reason in :data:`NOT_COVERED`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.reference import activation as ref_act
from rl_engine.reference import attention as ref_attn
from rl_engine.reference import embedding as ref_emb
from rl_engine.reference import gemm as ref_gemm
from rl_engine.reference import logprob as ref_lp
from rl_engine.reference import moe as ref_moe
from rl_engine.reference import norm as ref_norm
from rl_engine.reference import rope as ref_rope

__all__ = ["OpCase", "CASES", "NOT_COVERED"]

Inputs = tuple[list[torch.Tensor], list[Any]]


@dataclass(frozen=True)
class OpCase:
    """Inputs, call adapter and float64 reference of one operator (see module docstring)."""

    make_inputs: Callable[[torch.dtype, int, int], Inputs]
    call: Callable[..., Any]
    reference_f64: Callable[..., Any]
    grad_rows: bool = True  # gradients w.r.t. the row arguments exist (else only shared ones)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, g, scale=1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=g, dtype=torch.float32)).to(dtype)


# --- gemm / norm / activation / rope / embedding -------------------------------------------------
def _linear_inputs(dtype, R, seed):
    g = _g(seed)
    return [_randn((R, 48), dtype, g)], [_randn((40, 48), dtype, g, 48 ** -0.5), _randn((40,), dtype, g, 0.1)]


def _rms_inputs(dtype, R, seed):
    g = _g(seed)
    return [_randn((R, 64), dtype, g, 2.0)], [(1 + 0.1 * torch.randn(64, generator=g)).to(dtype), 1e-6]


def _fused_inputs(dtype, R, seed):
    g = _g(seed)
    return [_randn((R, 64), dtype, g), _randn((R, 64), dtype, g)], [(1 + 0.1 * torch.randn(64, generator=g)).to(dtype), 1e-6]


def _silu_inputs(dtype, R, seed):
    return [_randn((R, 2 * 40), dtype, _g(seed), 2.0)], []


def _rope_inputs(dtype, R, seed):
    g = _g(seed)
    pos = torch.randint(0, 4096, (R,), generator=g)
    return [_randn((R, 3, 32), dtype, g), pos], [1_000_000.0]


def _rope_ref(x, positions, theta):
    return ref_rope.apply_rope_f64(x, positions, theta=theta)


def _emb_inputs(dtype, R, seed):
    g = _g(seed)
    return [torch.randint(0, 300, (R,), generator=g)], [_randn((300, 48), dtype, g, 0.25)]


# --- log-probs ------------------------------------------------------------------------------------
def _logits_inputs(dtype, R, seed):
    g = _g(seed)
    return [_randn((R, 777), dtype, g, 3.0)], [0.7]


def _tok_inputs(dtype, R, seed):
    g = _g(seed)
    return [_randn((R, 777), dtype, g, 3.0), torch.randint(0, 777, (R,), generator=g)], [0.7]


def _lin_tok_inputs(dtype, R, seed):
    g = _g(seed)
    return ([_randn((R, 48), dtype, g), torch.randint(0, 1500, (R,), generator=g)],
            [_randn((1500, 48), dtype, g, 0.5), 0.9])


def _lin_tok_call(fn, hidden, targets, weight, temperature):
    return fn(hidden, weight, targets, temperature, True, token_chunk=5, vocab_chunk=1024)


def _lin_tok_ref(hidden, targets, weight, temperature):
    return ref_lp.linear_token_logprobs_f64(hidden, weight, targets, temperature, True)


# --- varlen attention: one row = one sequence (padded to L), packed inside the call ---------------
_ATTN_L = 11


def _attn_inputs(dtype, R, seed):
    g = _g(seed)
    lengths = torch.tensor([1 + (3 * i + seed) % _ATTN_L for i in range(R)], dtype=torch.int64)
    q = _randn((R, _ATTN_L, 4, 16), dtype, g)
    k = _randn((R, _ATTN_L, 2, 16), dtype, g)
    v = _randn((R, _ATTN_L, 2, 16), dtype, g)
    return [q, k, v, lengths], [16 ** -0.5]


def _packed(q, k, v, lengths):
    keep = torch.arange(q.shape[1])[None, :] < lengths[:, None]
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return q[keep], k[keep], v[keep], cu, keep


def _unpack(out, keep, like):
    full = like.new_zeros(like.shape[:2] + out.shape[1:], dtype=out.dtype)
    return full.masked_scatter(keep[:, :, None, None].expand_as(full), out)


def _attn_call(fn, q, k, v, lengths, scale):
    qp, kp, vp, cu, keep = _packed(q, k, v, lengths)
    return _unpack(fn(qp, kp, vp, cu, scale, None), keep, q)


def _attn_ref(q, k, v, lengths, scale):
    qp, kp, vp, cu, keep = _packed(q, k, v, lengths)
    return _unpack(ref_attn.varlen_attention_f64(qp, kp, vp, cu, scale), keep, q)


# --- mixture of experts: one row = one token (its logits, its hidden row, its K slots) -------------
_MOE_E, _MOE_K, _MOE_H, _MOE_I = 6, 2, 32, 12


def _moe_ids(R, seed):
    """Distinct experts per token, drawn per row (expert loads differ between re-batchings)."""
    g = _g(seed + 3)
    return torch.stack([torch.randperm(_MOE_E, generator=g)[:_MOE_K] for _ in range(R)])


def _route_inputs(dtype, R, seed):
    # distinct logits a quarter apart in every row (exact in bf16): the top-k set is unambiguous,
    # so the float64 reference chooses the same experts
    g = _g(seed)
    z = torch.stack([torch.randperm(_MOE_E, generator=g) for _ in range(R)]).float() * 0.25
    return [z.to(dtype)], [_MOE_K, True]


def _gate_up_inputs(dtype, R, seed):
    g = _g(seed)
    return ([_randn((R, _MOE_H), dtype, g), _moe_ids(R, seed)],
            [_randn((_MOE_E, 2 * _MOE_I, _MOE_H), dtype, g, _MOE_H ** -0.5)])


def _down_inputs(dtype, R, seed):
    g = _g(seed)
    weights = torch.softmax(torch.randn((R, _MOE_K), generator=g), -1)
    return ([_randn((R, _MOE_K, _MOE_I), dtype, g), weights, _moe_ids(R, seed)],
            [_randn((_MOE_E, _MOE_H, _MOE_I), dtype, g, _MOE_I ** -0.5)])


CASES: dict[str, OpCase] = {
    "gemm.linear": OpCase(_linear_inputs, lambda fn, x, w, b: fn(x, w, b), ref_gemm.linear_f64),
    "norm.rms_norm": OpCase(_rms_inputs, lambda fn, x, w, eps: fn(x, w, eps), ref_norm.rms_norm_f64),
    "norm.fused_add_rms_norm": OpCase(_fused_inputs, lambda fn, x, r, w, eps: fn(x, r, w, eps), ref_norm.fused_add_rms_norm_f64),
    "activation.silu_and_mul": OpCase(_silu_inputs, lambda fn, x: fn(x), ref_act.silu_and_mul_f64),
    "rope.apply_rope": OpCase(_rope_inputs, lambda fn, x, p, th: fn(x, p, th, x.shape[-1]), _rope_ref),
    "embedding.embedding": OpCase(_emb_inputs, lambda fn, ids, w: fn(ids, w), ref_emb.embedding_f64, grad_rows=False),
    "logprob.log_softmax": OpCase(_logits_inputs, lambda fn, z, t: fn(z, t), ref_lp.log_softmax_f64),
    "logprob.token_logprobs": OpCase(_tok_inputs, lambda fn, z, y, t: fn(z, y, t), ref_lp.token_logprobs_f64),
    "logprob.entropy": OpCase(_logits_inputs, lambda fn, z, t: fn(z, t), ref_lp.entropy_f64),
    "logprob.linear_token_logprobs": OpCase(_lin_tok_inputs, _lin_tok_call, _lin_tok_ref),
    "attention.varlen_attention": OpCase(_attn_inputs, _attn_call, _attn_ref),
    "moe.route": OpCase(_route_inputs, lambda fn, z, k, r: fn(z, k, r), ref_moe.route_f64),
    "moe.expert_gate_up": OpCase(_gate_up_inputs, lambda fn, x, ids, w: fn(x, w, ids),
                                 lambda x, ids, w: ref_moe.expert_gate_up_f64(x, w, ids)),
    "moe.expert_down_combine": OpCase(_down_inputs, lambda fn, a, wt, ids, w: fn(a, w, wt, ids),
                                      lambda a, wt, ids, w: ref_moe.expert_down_combine_f64(a, w, wt, ids)),
}

NOT_COVERED: dict[str, str] = {
    "attention.cached_attention": "needs a KV-cache driver; prefill/decode invariance is checked by the model chain (decode cells)",
    "loss.advantages": "group-level operator (no row unit); covered by tests/ops/loss with the micro-batch checker",
    "loss.aggregate": "loss operator; covered by tests/ops/loss with the micro-batch checker",
    "loss.kl": "loss operator; covered by tests/ops/loss with the micro-batch checker",
    "loss.policy": "loss operator; covered by tests/ops/loss with the micro-batch checker",
    "loss.rollout_correction": "loss operator; covered by tests/ops/loss with the micro-batch checker",
    "models.qwen3": "model-level contract; checked by the model chain suite (rlk validate chain)",
    "models.qwen3_moe": "model-level contract; checked by the model chain suite (rlk validate chain --workload ws1-moe-tiny)",
    "packing.pack": "pure index movement (no arithmetic); covered by tests/ops/packing",
    "packing.unpack": "pure index movement (no arithmetic); covered by tests/ops/packing",
}
