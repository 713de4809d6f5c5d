"""Invariant CPU mixture-of-experts operators: router, expert gate/up, expert down + combine.

Shapes: ``T`` tokens, ``H`` hidden features, ``E`` experts, ``K`` experts per token, ``I`` the
expert intermediate size; a **slot** is one (token ``t``, rank ``j``) pair, ``s = t·K + j``.

**Router** (``moe.route``), per token row, fp32::

    z = float(logits[t]);  u_e = exp(z_e - max z)  (portable exp);  S = fixed_order_sum(u)
    p_e = u_e / S;  ids[t] = the K largest z (stable descending sort: ties to the lower id)
    s = ((p_ids0 + p_ids1) + ...) ;  w_j = p_idsj / s    (w_j = p_idsj without renormalize)

**Gate/up** (``moe.expert_gate_up``): the slots are grouped by expert
(:func:`~rl_engine.utils.routing.expert_permutation`); each group is one exact-sum GEMM
(:func:`~rl_engine.backends.cpu.common.exact_matmul`, whose output rows depend only on their own
input row and the weight), rounded to ``x.dtype``, then the invariant ``silu_and_mul``.

**Down + combine** (``moe.expert_down_combine``): ``y[s] = act[s] W_down[e]ᵀ`` per group, rounded
once to fp32; ``out[t] = round(((w_0 y_0 + w_1 y_1) + ...) + w_{K-1} y_{K-1})`` with separate
fp32 products and sums in rank order. Its backward scales by the routing weight where a GPU
does it at no cost: ``dact[s] = round(w_s · fp32(g[t] W_down[e]))`` (after the GEMM) and
``dW_down[e] = Σ_s round(w_s · g[t])ᵀ act[s]`` (the scaled gradient rounded to the activation
dtype, so the GEMM takes 16-bit operands).

Every step is an exact GEMM, an IEEE elementwise operation, a fixed-order sum or an exact index
operation, so each token's forward bits (and its ``dx``/``dact``/``dweights`` rows) depend only on
that token — not on how many tokens an expert received, the batch, the thread count or the
instruction set — and the weight gradients, sums over an expert's slots in the canonical order,
are the same bits run to run.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_moe_expert_down_combine, wire_moe_expert_gate_up, wire_moe_route
from rl_engine.backends.cpu.activation import silu_and_mul_cpu, silu_and_mul_cpu_backward
from rl_engine.backends.cpu.common import exact_matmul
from rl_engine.runtime.custom_ops import call_op
from rl_engine.runtime.registry import Implementation, register
from rl_engine.utils import portable
from rl_engine.utils.reductions import fixed_order_sum
from rl_engine.utils.routing import ExpertPermutation, expert_permutation

_DTYPES = (torch.float32, torch.bfloat16)
_GUARANTEES = frozenset({"row", "chunk", "run_to_run", "threads", "isa"})


# --------------------------------------------------------------------------- router


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``softmax`` of each row of ``logits [T, E]`` (portable exp, fixed-order denominator)."""
    z = logits.float()
    u = portable.exp(z - z.amax(-1, keepdim=True))
    return u.div_(fixed_order_sum(u).unsqueeze(-1))


def _rank_sum(a: torch.Tensor) -> torch.Tensor:
    """``((a[:, 0] + a[:, 1]) + ...) + a[:, K-1]``: the sum over ranks in rank order."""
    acc = a[:, 0].clone()
    for j in range(1, a.shape[1]):
        acc.add_(a[:, j])
    return acc


def _select(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, K]`` ids of the ``top_k`` largest logits of each row (ties: the lower expert id)."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()


@torch.library.custom_op("rlk::moe_route_cpu", mutates_args=(), device_types="cpu")
def moe_route_cpu(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _select(logits, top_k)
    p = _softmax(logits).gather(-1, ids)
    if renormalize and top_k:
        p = p.div_(_rank_sum(p).unsqueeze(-1))
    return p, ids


@torch.library.custom_op("rlk::moe_route_cpu_backward", mutates_args=(), device_types="cpu")
def moe_route_cpu_backward(grad: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    p = _softmax(logits)
    p_sel = p.gather(-1, ids)
    g = grad.float()
    if renormalize and ids.shape[1]:
        s = _rank_sum(p_sel).unsqueeze(-1)
        c = _rank_sum(g * (p_sel / s)).unsqueeze(-1)
        dp_sel = (g - c).div_(s)
    else:
        dp_sel = g
    inner = _rank_sum(p_sel * dp_sel).unsqueeze(-1) if ids.shape[1] else p.new_zeros((p.shape[0], 1))
    dp = torch.zeros_like(p).scatter_(-1, ids, dp_sel)  # distinct ids per row: each slot written once
    return p.mul_(dp.sub_(inner)).to(logits.dtype)


wire_moe_route(moe_route_cpu, moe_route_cpu_backward)


# --------------------------------------------------------------------------- grouped GEMMs


def _grouped(rows: torch.Tensor, perm: ExpertPermutation, weight: torch.Tensor, out: torch.Tensor,
             row_index: str) -> torch.Tensor:
    """``out[s] = rows[r(s)] · weight[e(s)]ᵀ`` for every slot ``s`` (exact-sum GEMM per expert).

    ``rows`` is indexed by token (``row_index="token"``) or by slot (``"slot"``); ``weight`` is
    ``[E, N, Kd]`` (or a transposed view); ``out`` is ``[T·K, N]`` and fixes the output dtype.
    """
    for e, s0, s1 in perm.groups():
        slots = perm.order[s0:s1]
        src = rows[perm.tokens[s0:s1]] if row_index == "token" else rows[slots]
        out[slots] = exact_matmul(src, weight[e], out_dtype=out.dtype)
    return out


def _gate_up(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, perm: ExpertPermutation) -> torch.Tensor:
    """``[T·K, 2I]`` gate/up GEMM outputs in ``x.dtype``, one row per slot."""
    h = torch.empty((ids.numel(), w.shape[1]), dtype=x.dtype)
    return _grouped(x, perm, w, h, "token")


@torch.library.custom_op("rlk::moe_expert_gate_up_cpu", mutates_args=(), device_types="cpu")
def moe_expert_gate_up_cpu(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    T, K = ids.shape
    perm = expert_permutation(ids, w_gate_up.shape[0])
    act = call_op(silu_and_mul_cpu, _gate_up(x, w_gate_up, ids, perm))
    return act.view(T, K, w_gate_up.shape[1] // 2)


@torch.library.custom_op("rlk::moe_expert_gate_up_cpu_backward", mutates_args=(), device_types="cpu")
def moe_expert_gate_up_cpu_backward(grad: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor,
                                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = ids.shape
    H = x.shape[1]
    perm = expert_permutation(ids, w_gate_up.shape[0])
    h = _gate_up(x, w_gate_up, ids, perm)
    dh = call_op(silu_and_mul_cpu_backward, grad.reshape(T * K, -1).contiguous(), h)  # [T·K, 2I] in x.dtype
    dx_slots = torch.zeros((T * K, H), dtype=torch.float32)
    dw = torch.zeros_like(w_gate_up)
    for e, s0, s1 in perm.groups():
        slots = perm.order[s0:s1]
        dh_e = dh[slots]
        dx_slots[slots] = exact_matmul(dh_e, w_gate_up[e].t(), out_dtype=torch.float32)
        # [2I, H] = dh_eᵀ x_e: the reduction runs over the expert's slots (exact sums)
        dw[e] = exact_matmul(dh_e.t(), x[perm.tokens[s0:s1]].t(), out_dtype=w_gate_up.dtype)
    if K == 0:
        return torch.zeros_like(x), dw
    return _rank_sum(dx_slots.view(T, K, H)).to(x.dtype), dw


wire_moe_expert_gate_up(moe_expert_gate_up_cpu, moe_expert_gate_up_cpu_backward)


def _slot_outputs(act: torch.Tensor, w_down: torch.Tensor, perm: ExpertPermutation) -> torch.Tensor:
    """``[T, K, H]`` fp32: ``y[t, j] = act[t, j] · W_down[ids[t, j]]ᵀ`` rounded once to fp32."""
    T, K, I = act.shape
    y = torch.empty((T * K, w_down.shape[1]), dtype=torch.float32)
    return _grouped(act.reshape(T * K, I), perm, w_down, y, "slot").view(T, K, w_down.shape[1])


@torch.library.custom_op("rlk::moe_expert_down_combine_cpu", mutates_args=(), device_types="cpu")
def moe_expert_down_combine_cpu(act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                                ids: torch.Tensor) -> torch.Tensor:
    T, K, _ = act.shape
    if K == 0:
        return act.new_zeros((T, w_down.shape[1]))
    y = _slot_outputs(act, w_down, expert_permutation(ids, w_down.shape[0]))
    acc = weights[:, 0, None] * y[:, 0]
    for j in range(1, K):
        acc.add_(weights[:, j, None] * y[:, j])
    return acc.to(act.dtype)


@torch.library.custom_op("rlk::moe_expert_down_combine_cpu_backward", mutates_args=(), device_types="cpu")
def moe_expert_down_combine_cpu_backward(grad: torch.Tensor, act: torch.Tensor, w_down: torch.Tensor,
                                         weights: torch.Tensor, ids: torch.Tensor
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K, I = act.shape
    perm = expert_permutation(ids, w_down.shape[0])
    g = grad.to(act.dtype)
    y = _slot_outputs(act, w_down, perm)
    dweights = fixed_order_sum(g.float()[:, None, :] * y)  # [T, K]
    w_flat = weights.reshape(T * K)
    act_flat = act.reshape(T * K, I)
    dact = torch.zeros((T * K, I), dtype=act.dtype)
    dw = torch.zeros_like(w_down)
    for e, s0, s1 in perm.groups():
        slots = perm.order[s0:s1]
        g_e = g[perm.tokens[s0:s1]]  # the slots' output-gradient rows, act.dtype
        w_e = w_flat[slots, None]
        # dact = round(w · fp32(g W_down[e])): the routing weight scales the GEMM's fp32 result
        dact[slots] = (w_e * exact_matmul(g_e, w_down[e].t(), out_dtype=torch.float32)).to(act.dtype)
        # dW_down[e] = Σ round(w · g)ᵀ act over the slots: [H, I], the scaled gradient rounded to act.dtype
        dy_e = (w_e * g_e.float()).to(act.dtype)
        dw[e] = exact_matmul(dy_e.t(), act_flat[slots].t(), out_dtype=w_down.dtype)
    return dact.view(T, K, I), dw, dweights


wire_moe_expert_down_combine(moe_expert_down_combine_cpu, moe_expert_down_combine_cpu_backward)


for _op, _fn, _version in (("moe.route", moe_route_cpu, "1"), ("moe.expert_gate_up", moe_expert_gate_up_cpu, "1"),
                           ("moe.expert_down_combine", moe_expert_down_combine_cpu, "2")):
    register(
        Implementation(
            op=_op,
            impl_id="cpu.exact_sum",
            version=_version,
            fn=_fn,
            families=("cpu",),
            dtypes=_DTYPES,
            guarantees=_GUARANTEES,
            priority=10,
        )
    )
