"""Embedding entry point: ``embedding`` (token-id lookup)."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import checks_indices, dispatch, make_request
from rl_engine.utils.checks import check_index_range, FLOAT_DTYPES, reads_back, require_same_device, require_tensor

__all__ = ["embedding"]


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    r"""Look up one weight row per token id.

    .. math:: \text{out}_{\dots, :} = W_{\text{ids}_{\dots}, :}

    The forward is a gather (a bit copy of weight rows). The gradient to ``weight`` sums the
    upstream rows of the tokens sharing an id in a fixed order — a pairwise tree over those
    tokens in increasing flattened token index, in fp32, rounded once to ``weight.dtype`` —
    with no atomics, so ``dweight[v]`` is identical run to run and depends only on the
    gradients of the tokens with id ``v``.

    Shapes:
        ids: any shape ``[...]``, int32 or int64, values in ``[0, V)``; weight: ``[V, H]``;
        returns ``[..., H]`` in ``weight.dtype``.

    Contract ``embedding.embedding``: fp32 or bf16; **row** and **chunk invariant** (each
    token's row is a copy; any split of the token list gives the same rows); deterministic run
    to run, forward and backward (``ids`` get no gradient).

    Raises:
        TypeError / ValueError: ``ids`` is not a contiguous int32/int64 tensor or holds an id
            outside ``[0, V)``; ``weight`` is not a contiguous 2-D fp32/bf16 tensor with
            ``V, H > 0``; ``weight`` contains NaN **under** ``nan_policy("raise_all")`` only (a
            parameter: under the default ``"auto"`` policy the table is not scanned and a NaN
            row is copied like any other, see :mod:`rl_engine.utils.checks`); the two are on
            different devices (the message names the argument). An out-of-range id on a GPU
            under the default policy, which reads nothing back, stops the process at a
            device-side assertion instead (``docs/design/host-path.md``).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    require_tensor("ids", ids, dtypes=(torch.int64, torch.int32))
    require_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2, finite="param")
    V, H = weight.shape
    if V == 0 or H == 0:
        raise ValueError(f"weight: expected a non-empty [V, H] table, got shape {tuple(weight.shape)}")
    require_same_device(ids=ids, weight=weight)
    req = make_request("embedding.embedding", weight, features={"H": H})
    if reads_back(ids) or not checks_indices(req):
        # where ids cannot be read back, an implementation that asserts their range in its own
        # kernel needs no separate check (a GPU under the default policy: no extra launches)
        check_index_range("ids", ids, V, what="token ids", note=" (the rows of weight)")
    return dispatch(req, ids, weight)
