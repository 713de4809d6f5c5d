r"""Outcome-advantage estimators for critic-free RL: GRPO, GRPO without std (Dr. GRPO), RLOO,
REINFORCE++-baseline.

Inputs: one scalar ``scores[b]`` per sequence (the outcome reward), ``group_ids[b]`` (samples of
the same prompt share an id; any integers) and the token ``mask`` ``[B, L]``. Output: float32
token advantages ``[B, L]``, the sequence's advantage on each active token and ``+0.0``
elsewhere, ready for the policy losses. No gradients.

A *group* is the set of samples sharing an id, so it is never empty; a **singleton group** has
advantage 0 for GRPO and REINFORCE++-baseline (its own score is its baseline; verl instead passes
the raw score through) and is an error for RLOO (the leave-one-out mean of nothing is undefined).

Contract ``loss.advantages``: group sums are taken in ascending-value order, batch sums over
per-sequence fixed-order sums in ascending-value order, so every advantage depends only on the
multiset of ``(group id, score)`` pairs (and active-token counts): permuting the batch or
changing padding changes no bit; deterministic run to run.
"""

from __future__ import annotations

import torch

from rl_engine.ops.loss._common import as_mask, check_number
from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import FLOAT_DTYPES, require_same_device, require_tensor

__all__ = ["grpo_advantages", "rloo_advantages", "reinforce_pp_baseline_advantages"]

_ID_DTYPES = (torch.int32, torch.int64)


def _advantages(estimator: str, scores, group_ids, mask, eps: float) -> torch.Tensor:
    m = as_mask(mask)
    require_tensor("scores", scores, dtypes=FLOAT_DTYPES, ndim=1, finite=True)
    require_tensor("group_ids", group_ids, dtypes=_ID_DTYPES, ndim=1)
    B = m.shape[0]
    if scores.shape[0] != B:
        raise ValueError(f"scores: expected shape ({B},) (one score per row of mask), got {tuple(scores.shape)}")
    if group_ids.shape[0] != B:
        raise ValueError(f"group_ids: expected shape ({B},) (one id per row of mask), got {tuple(group_ids.shape)}")
    require_same_device(mask=m, scores=scores, group_ids=group_ids)
    gid = group_ids.to(torch.int64)
    if estimator == "rloo" and B:
        uniq, counts = torch.unique(gid, return_counts=True)
        single = uniq[counts < 2]
        if single.numel():
            raise ValueError(
                f"group_ids: RLOO needs at least 2 samples per group; group(s) {single[:5].tolist()} have 1 "
                "(drop them or use grpo_advantages)"
            )
    req = make_request("loss.advantages", scores, features={"estimator": estimator, "B": B})
    return dispatch(req, scores, gid, m, estimator, eps)


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *,
                    norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    r"""GRPO group-normalised advantages (Shao et al. 2024, arXiv:2402.03300).

    .. math:: A_i = \frac{s_i - \bar s_{g(i)}}{σ_{g(i)} + ε}
              \quad\text{or, with } \texttt{norm\_by\_std=False}\text{ (Dr. GRPO): } A_i = s_i - \bar s_{g(i)}

    :math:`\bar s_g` is the group mean and :math:`σ_g` the **unbiased** group standard deviation
    (``torch.std``, as verl). A singleton group gives 0; a flat group gives 0.

    Shapes:
        scores ``[B]`` (float32/bfloat16), group_ids ``[B]`` (int32/int64), mask ``[B, L]``;
        returns ``[B, L]`` float32.

    Raises:
        TypeError / ValueError: wrong type, dtype, shape (``B`` must match ``mask``), device,
            non-contiguous tensor, NaN score (where the NaN policy scans ``scores``), ``mask`` not
            0/1, ``eps < 0`` (names the argument).
    """
    if not isinstance(norm_by_std, bool):
        raise ValueError(f"norm_by_std: expected a bool, got {norm_by_std!r}")
    e = check_number("eps", eps, low=0.0)
    return _advantages("grpo" if norm_by_std else "grpo_no_std", scores, group_ids, mask, e if norm_by_std else 0.0)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    .. math:: A_i = s_i - \frac{1}{n-1}\sum_{j \ne i,\, g(j)=g(i)} s_j = \frac{n}{n-1}\,(s_i - \bar s_{g(i)})

    computed in the right-hand form (verl's). Shapes as :func:`grpo_advantages`.

    Raises:
        ValueError: a group has a single sample (``group_ids``), or as :func:`grpo_advantages`.
    """
    return _advantages("rloo", scores, group_ids, mask, 0.0)


def reinforce_pp_baseline_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *,
                                     eps: float = 1e-8) -> torch.Tensor:
    r"""REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262; verl's
    ``reinforce_plus_plus_baseline``): subtract the group mean, then whiten over the batch's
    active **tokens**.

    .. math::
        a_i = s_i - \bar s_{g(i)},\qquad x_{b,t} = a_b \;(m_{b,t}=1),\qquad
        A_{b,t} = \frac{x_{b,t} - μ}{\sqrt{σ^2 + ε}}

    with :math:`μ` and :math:`σ^2` the mean and unbiased variance over all active tokens
    (long sequences weigh more, as in verl's ``masked_whiten``). This is the outcome-reward
    variant; the token-level KL-in-reward and discounting of the original REINFORCE++ are not
    applied. Shapes and Raises as :func:`grpo_advantages`.
    """
    e = check_number("eps", eps, low=0.0)
    return _advantages("reinforce_pp_baseline", scores, group_ids, mask, e)
