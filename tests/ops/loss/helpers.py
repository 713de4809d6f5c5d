"""Test helpers for the loss family: data, hypothesis strategies, and float64 formulas written
independently of rl_engine (plain masked sums, autograd for gradients)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from rl_engine.ops import loss as L

DTYPES = ("float32", "bfloat16")

# name -> (function, extra kwargs, kind for the f64 formula, (eps_low, eps_high), dual clip)
VARIANTS = {
    "ppo": (L.ppo_clip_loss, {}, "ppo", (0.2, 0.2), None),
    "ppo_dual": (L.ppo_clip_loss, {"dual_clip": 3.0}, "ppo", (0.2, 0.2), 3.0),
    "grpo": (L.grpo_loss, {}, "ppo", (0.2, 0.2), None),
    "dr_grpo": (L.dr_grpo_loss, {"loss_scale_factor": 48.0}, "ppo", (0.2, 0.2), None),
    "dapo": (L.dapo_loss, {}, "ppo", (0.2, 0.28), None),
    "gspo": (L.gspo_loss, {"eps_low": 0.02, "eps_high": 0.03}, "gspo", (0.02, 0.03), None),
    "cispo": (L.cispo_loss, {"eps_high": 0.15}, "cispo", (math.inf, 0.15), None),
    "cispo_low": (L.cispo_loss, {"eps_high": 0.15, "eps_low": 0.1}, "cispo", (0.1, 0.15), None),
}
DEFAULT_REDUCTION = {
    "ppo": "token-mean", "ppo_dual": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean", "gspo": "seq-mean-token-mean", "cispo": "token-mean", "cispo_low": "token-mean",
}


def make_batch(B: int, T: int, dtype: str, seed: int, *, p_active: float = 0.7, spread: float = 0.15, seq_adv: bool = False):
    """log_probs, old_log_probs, advantages, mask, is_weights — ``[B, T]``, random layout."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    lp = -torch.rand(B, T, generator=g) * 3.0
    old = (lp + torch.randn(B, T, generator=g) * spread).clamp(max=0.0)  # log-probs are <= 0
    if seq_adv:
        adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    else:
        adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < p_active
    w = torch.rand(B, T, generator=g) * 2.0
    return lp.to(dt), old.to(dt), adv.to(dt), mask, w.to(dt)


@st.composite
def splits(draw, B: int, max_splits: int = 2):
    """Splits of rows 0..B-1: a random permutation cut into random micro-batches."""
    out = []
    for _ in range(draw(st.integers(1, max_splits))):
        perm = list(draw(st.permutations(range(B))))
        k = draw(st.integers(1, max(1, min(B, 4))))
        cuts = sorted(draw(st.lists(st.integers(1, max(1, B - 1)), min_size=k - 1, max_size=k - 1, unique=True))) if B > 1 else []
        bounds = [0, *cuts, B]
        out.append([perm[a:b] for a, b in zip(bounds, bounds[1:]) if b > a])
    return out


# ----------------------------------------------------------------------------- float64 formulas


def f64_token_terms(kind, lp, old, adv, eps_low, eps_high, dual, mask):
    """Per-token loss of each algorithm (float64, differentiable w.r.t. lp)."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    if kind == "cispo":
        r = torch.exp(lp - old).detach()
        return -torch.clamp(r, lo, hi) * adv * lp
    if kind == "gspo":
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        s = torch.exp(((lp - old) * mask).sum(-1, keepdim=True) / n)
        ratio = s.detach() * torch.exp(lp - lp.detach())  # GSPO-token
    else:
        ratio = torch.exp(lp - old)
    t = torch.max(-adv * ratio, -adv * torch.clamp(ratio, lo, hi))
    if dual is not None:
        t = torch.where(adv < 0, torch.min(t, -adv * dual), t)
    return t


def f64_reduce(tok, mask, reduction, C=None):
    m = mask.double()
    S = (tok * m).sum(-1)
    n = m.sum(-1)
    G = (n > 0).sum()
    if reduction == "token-mean":
        return S.sum() / n.sum().clamp(min=1), S
    if reduction == "seq-mean-token-mean":
        per = torch.where(n > 0, S / n.clamp(min=1), torch.zeros_like(S))
        return per.sum() / G.clamp(min=1), per
    if reduction == "seq-mean-token-sum":
        return S.sum() / G.clamp(min=1), S
    return S.sum() / (G * C), S


def f64_kl(lp, ref, estimator):
    log_rho = ref - lp
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho**2
    return torch.exp(log_rho) - 1 - log_rho


def f64_group_adv(scores, gids, estimator, eps):
    s = scores.double()
    out = torch.empty_like(s)
    for i in range(s.numel()):
        same = gids == gids[i]
        grp = s[same]
        n = grp.numel()
        if estimator == "rloo":
            out[i] = s[i] - (grp.sum() - s[i]) / (n - 1)
            continue
        if n == 1:
            out[i] = 0.0
            continue
        dev = s[i] - grp.mean()
        out[i] = dev / (grp.std() + eps) if estimator == "grpo" else dev
    return out


def loss_call_inputs(device: str = "cpu", B: int = 4, length: int = 9):
    """``(log_probs, old_log_probs, advantages, mask)`` ``[B, length]`` on ``device``, the first
    sequence without active tokens."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(B, length, generator=g) * 3).to(device)
    old = (-torch.rand(B, length, generator=g) * 3).to(device)
    adv = torch.randn(B, length, generator=g).to(device)
    mask = (torch.rand(B, length, generator=g) > 0.3).to(device)
    mask[0] = False  # a sequence without active tokens
    return lp, old, adv, mask


def loss_call_cases(device: str = "cpu") -> dict[str, Callable[[], None]]:
    """``name -> run()``: each loss-family call with ``denominator=`` given (the micro-batch
    form), and its backward where it has one, on ``device`` (the host-read and GPU sync tests)."""
    lp, old, adv, mask = loss_call_inputs(device)
    den = 11.0

    def policy(fn, **kw):
        def run():
            x = lp.clone().requires_grad_()
            out = fn(x, old, adv, mask, denominator=den, **kw)
            out.loss.backward()
            return out
        return run

    def kl(estimator):
        def run():
            x = lp.clone().requires_grad_()
            L.kl_penalty(x, old, mask, estimator=estimator, denominator=den).loss.backward()
        return run

    def aggregate(fn, reduction):
        def run():
            v = adv.clone().requires_grad_()
            fn(v, mask, reduction=reduction, denominator=den).loss.backward()
        return run

    def combine():
        parts = [L.ppo_clip_loss(lp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], denominator=den)
                 for i in (0, 2)]
        L.combine_microbatch_losses(parts)

    return {
        "ppo_clip": policy(L.ppo_clip_loss, dual_clip=3.0),
        "grpo": policy(L.grpo_loss),
        "dr_grpo": policy(L.dr_grpo_loss),
        "dapo": policy(L.dapo_loss),
        "gspo": policy(L.gspo_loss),
        "cispo": policy(L.cispo_loss, eps_high=0.3),
        "kl_k1": kl("k1"), "kl_k2": kl("k2"), "kl_k3": kl("k3"),
        "masked_aggregate": aggregate(L.masked_aggregate, "seq-mean-token-mean"),
        "entropy_bonus": aggregate(L.entropy_bonus, "token-mean"),
        "combine": combine,
        "rollout_correction": lambda: L.rollout_correction(lp, old, mask, is_level="sequence", rs_level="token",
                                                              rs_threshold=2.0, veto_threshold=1e-4),
        "rollout_mismatch_metrics": lambda: L.rollout_mismatch_metrics(lp, old, mask),
    }
