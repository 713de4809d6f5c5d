"""``embedding``'s docstring and behaviour agree on NaN weights: under the default ``"auto"``
policy the table (a parameter) is not scanned and a NaN row is copied; ``"raise_all"`` rejects it."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.embedding import embedding
from rl_engine.utils.checks import current_nan_policy, nan_policy


def test_default_policy_copies_a_nan_row_as_the_docstring_says():
    doc = " ".join(embedding.__doc__.split())
    assert 'contains NaN **under** ``nan_policy("raise_all")`` only' in doc
    assert 'under the default ``"auto"`` policy the table is not scanned' in doc
    assert current_nan_policy() == "auto"  # the docstring names the policy in effect by default
    w = torch.randn(5, 3)
    w[2, 1] = float("nan")
    out = embedding(torch.tensor([2, 0]), w)
    assert torch.equal(out[1], w[0]) and bool(torch.isnan(out[0, 1]))
    with nan_policy("raise_all"), pytest.raises(ValueError, match="^weight: contains NaN"):
        embedding(torch.tensor([0]), w)
