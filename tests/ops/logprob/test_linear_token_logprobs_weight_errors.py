"""A non-finite LM-head weight is named as ``weight`` (not ``hidden``), under the default NaN
policy too (the weight is read for the diagnosis only when a logits row is not finite)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.logprob import linear_token_logprobs


@pytest.mark.parametrize("bad,match", [(float("nan"), "^weight: contains NaN"), (float("inf"), "^weight: contains inf")])
def test_non_finite_weight_is_blamed_on_weight(bad, match):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 8, generator=g)
    w[3, 2] = bad
    with pytest.raises(ValueError, match=match):
        linear_token_logprobs(torch.randn(4, 8, generator=g), w, torch.tensor([1, 2, 3, 4]))


def test_overflowing_hidden_is_still_blamed_on_hidden():
    w = torch.ones(10, 8)
    with pytest.raises(ValueError, match="^hidden: rows"):
        linear_token_logprobs(torch.full((2, 8), 3e38), w, torch.tensor([1, 2]))
