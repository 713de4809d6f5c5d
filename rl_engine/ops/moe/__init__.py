r"""Mixture-of-experts entry points: router, expert gate/up, expert down + combine.

A sparse MoE block (Qwen3-MoE, no shared expert) over ``T`` tokens of width ``H`` with ``E``
experts of intermediate size ``I``, ``K`` experts per token::

    logits        = gemm.linear(x, W_router)                       # [T, E], x.dtype
    weights, ids  = route(logits, K, renormalize)                  # [T, K] fp32, [T, K] int64
    act           = expert_gate_up(x, W_gate_up, ids)              # [T, K, I]
    out           = expert_down_combine(act, W_down, weights, ids) # [T, H]

:func:`experts` is the last two in one call. A **slot** is one (token ``t``, rank ``j``) pair;
rank ``0`` is the expert with the largest logit. Slots are grouped by expert in one canonical
order — by expert, then by token position, then rank (:func:`expert_permutation`) — which fixes
the order in which each expert's weight gradient adds its tokens.

Every operator is **row invariant**: a token's bits depend on that token alone, never on how
many tokens its experts received, on the other tokens or on the batch size; so a decode step, a
chunked prefill and a training batch give one token the same bits. Gradients are deterministic
with fixed accumulation orders. Contracts: ``contracts/operators/moe.*.json``; the maths:
``docs/operators/moe.md``.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, check_finite, check_index_range, require_same_device, require_tensor
from rl_engine.utils.routing import ExpertPermutation, expert_permutation

__all__ = ["route", "expert_gate_up", "expert_down_combine", "experts", "expert_permutation", "ExpertPermutation"]


def _require_ids(ids: object, T: int, num_experts: int | None) -> torch.Tensor:
    require_tensor("ids", ids, dtypes=(torch.int64,), ndim=2)
    if ids.shape[0] != T:
        raise ValueError(f"ids: expected {T} rows (one per token), got shape {tuple(ids.shape)}")
    # read on the host where that is free (CPU, or the "raise" policies); on a GPU under the default
    # policy a device-side assertion, so an out-of-range id never indexes past the expert weights
    if num_experts is not None:
        check_index_range("ids", ids, num_experts, what="expert ids")
    return ids


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Choose ``top_k`` experts per token and their mixing weights.

    .. math::
        p_{t,e} = \frac{e^{z_{t,e} - m_t}}{\sum_{e'} e^{z_{t,e'} - m_t}}, \quad
        \mathrm{ids}_t = \operatorname{top}_K(z_t), \quad
        w_{t,j} = \frac{p_{t,\mathrm{ids}_{t,j}}}{\sum_{j'} p_{t,\mathrm{ids}_{t,j'}}}\ \text{(renormalize)}
        \ \text{or}\ p_{t,\mathrm{ids}_{t,j}}

    Computed in fp32 from the widened logits; the denominator is a fixed-order sum over the
    experts, the renormalisation a sum in rank order. **Tie rule:** the experts are ranked by
    their logits ``z`` with a stable descending sort, so equal logits go to the lower expert id
    (ranking the rounded probabilities instead would tie where the logits differ).

    Shapes:
        router_logits: ``[T, E]`` (float32 or bfloat16); returns ``weights [T, K]`` float32
        (differentiable w.r.t. the logits) and ``ids [T, K]`` int64 (rank 0 = largest logit).

    Contract ``moe.route``: **row** and **chunk** invariant (a token's routing depends on its
    row only), deterministic run to run, forward and backward.

    Raises:
        TypeError / ValueError: ``router_logits`` is not a 2-D contiguous float32/bfloat16
            tensor or holds NaN/inf where the NaN policy scans it (:mod:`rl_engine.utils.checks`);
            ``top_k`` is not an int in ``[1, E]``; ``renormalize`` is
            not a bool.
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("router_logits", router_logits, dtypes=FLOAT_DTYPES, ndim=2)
    check_finite("router_logits", router_logits, why="a router needs finite logits")
    E = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, {E}] (the number of experts), got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    req = make_request("moe.route", router_logits, features={"E": E, "K": top_k, "renormalize": renormalize})
    return dispatch(req, router_logits, top_k, renormalize)


def expert_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    r"""The gated first projection of every slot's expert.

    .. math:: [g, u] = x_t W^{\mathrm{gu}}_{e}{}^{\top}\ (\text{rounded to the dtype}),\quad
        \mathrm{act}_{t,j} = \operatorname{silu}(g) \odot u,\quad e = \mathrm{ids}_{t,j}

    with ``silu`` as :func:`rl_engine.ops.activation.silu_and_mul` (fp32, rounded once).

    Shapes:
        x: ``[T, H]``; w_gate_up: ``[E, 2I, H]`` (gate rows first, as HF's
        ``experts.gate_up_proj`` and vLLM's ``w13_weight``); ids: ``[T, K]`` int64; returns
        ``[T, K, I]`` in ``x.dtype``.

    Contract ``moe.expert_gate_up``: **row** invariant (a slot's bits depend only on its token
    row and its expert), **chunk** invariant over the intermediate features (the same columns of
    the gate and up halves, a tensor-parallel shard, give the same bits), deterministic run to
    run; backward ``dx`` row invariant, ``dW_gate_up`` deterministic (each expert's slots in the
    canonical order).

    Raises:
        TypeError / ValueError: wrong type, dtype, shape, device, non-contiguous, NaN in ``x``
            where the NaN policy scans it, or an id outside ``[0, E)`` (on a GPU under the default
            policy, which reads nothing back, a device-side assertion instead).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2, finite=True)
    require_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=3, finite="param")
    if w_gate_up.shape[2] != x.shape[1] or w_gate_up.shape[1] % 2 or w_gate_up.shape[1] == 0:
        raise ValueError(f"w_gate_up: expected shape [E, 2I, {x.shape[1]}] (an even, positive 2I and x's last dim), "
                         f"got {tuple(w_gate_up.shape)}")
    _require_ids(ids, x.shape[0], w_gate_up.shape[0])
    require_same_device(x=x, w_gate_up=w_gate_up, ids=ids)
    req = make_request("moe.expert_gate_up", x, features={"E": w_gate_up.shape[0], "H": x.shape[1],
                                                          "I": w_gate_up.shape[1] // 2})
    return dispatch(req, x, w_gate_up, ids)


def expert_down_combine(act: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    r"""The second projection of every slot and the weighted combine over a token's experts.

    .. math:: y_{t,j} = \mathrm{act}_{t,j} W^{\mathrm{d}}_{e}{}^{\top}\ (\text{fp32}),\quad
        \mathrm{out}_t = \operatorname{round}\Big(\big((w_{t,0} y_{t,0} + w_{t,1} y_{t,1}) + \dots\big)
        + w_{t,K-1} y_{t,K-1}\Big)

    with fp32 products and sums in rank order (no fused multiply-add) and one rounding to
    ``act.dtype``.

    Shapes:
        act: ``[T, K, I]``; w_down: ``[E, H, I]`` (HF ``experts.down_proj``, vLLM
        ``w2_weight``); weights: ``[T, K]`` float32; ids: ``[T, K]`` int64; returns ``[T, H]``
        in ``act.dtype``.

    Contract ``moe.expert_down_combine``: **row** invariant, **chunk** invariant over the
    output features (a slice of ``w_down``'s rows gives those columns' bits), deterministic run
    to run; backward ``dact`` and ``dweights`` row invariant, ``dW_down`` deterministic.

    Raises:
        TypeError / ValueError: wrong type, dtype, shape, device, non-contiguous, NaN in
            ``act``/``weights`` where the NaN policy scans them, or an id outside ``[0, E)`` (on a
            GPU under the default policy, which reads nothing back, a device-side assertion
            instead).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("act", act, dtypes=FLOAT_DTYPES, ndim=3, finite=True)
    T, K, I = act.shape
    require_tensor("w_down", w_down, dtypes=(act.dtype,), ndim=3, finite="param")
    if w_down.shape[2] != I or w_down.shape[1] == 0:
        raise ValueError(f"w_down: expected shape [E, H, {I}] (act's last dim), got {tuple(w_down.shape)}")
    require_tensor("weights", weights, dtypes=(torch.float32,), ndim=2, finite=True)
    if tuple(weights.shape) != (T, K):
        raise ValueError(f"weights: expected shape [{T}, {K}] (act's [T, K]), got {tuple(weights.shape)}")
    _require_ids(ids, T, w_down.shape[0])
    if ids.shape[1] != K:
        raise ValueError(f"ids: expected shape [{T}, {K}] (act's [T, K]), got {tuple(ids.shape)}")
    require_same_device(act=act, w_down=w_down, weights=weights, ids=ids)
    req = make_request("moe.expert_down_combine", act, features={"E": w_down.shape[0], "H": w_down.shape[1], "I": I})
    return dispatch(req, act, w_down, weights, ids)


def experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
    r"""The routed experts of a sparse MoE block:
    ``expert_down_combine(expert_gate_up(x, w_gate_up, ids), w_down, weights, ids)``.

    .. math:: \mathrm{out}_t = \sum_{j=0}^{K-1} w_{t,j}\,
        \big(\operatorname{silu}(x_t G_e^\top) \odot x_t U_e^\top\big) D_e^\top,\quad e = \mathrm{ids}_{t,j}

    Shapes:
        x: ``[T, H]``; w_gate_up: ``[E, 2I, H]``; w_down: ``[E, H, I]``; weights: ``[T, K]``
        float32; ids: ``[T, K]`` int64; returns ``[T, H]`` in ``x.dtype``.

    Raises: as :func:`expert_gate_up` and :func:`expert_down_combine`.
    """
    return expert_down_combine(expert_gate_up(x, w_gate_up, ids), w_down, weights, ids)
