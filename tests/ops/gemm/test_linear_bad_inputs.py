"""``gemm.linear`` with an empty reduction dimension: a clear error naming ``x``."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops.gemm import linear


@pytest.mark.parametrize("x_shape,w_shape", [((3, 0), (4, 0)), ((0, 0), (0, 0)), ((2, 5, 0), (1, 0))])
def test_k_zero_is_a_clear_error(x_shape, w_shape):
    with pytest.raises(ValueError, match=r"^x: expected a last \(reduction\) dimension K >= 1"):
        linear(torch.zeros(x_shape), torch.zeros(w_shape))


def test_empty_rows_and_outputs_still_work():
    assert linear(torch.zeros(0, 4), torch.zeros(3, 4)).shape == (0, 3)
    assert linear(torch.zeros(2, 4), torch.zeros(0, 4)).shape == (2, 0)
