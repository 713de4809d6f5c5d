"""Raw-bit comparison (``rl_engine.utils.bits.same_bits``): the equality every invariance and parity
check uses. Signed zeros differ, any NaN fails, the first mismatch is reported; on the GPU the
count is taken on the device and only a mismatch's details come to the host."""

from __future__ import annotations

import pytest
import torch

from rl_engine.utils.bits import int_view, same_bits

gpu = pytest.mark.gpu


def test_equal_tensors_compare_equal_and_int_view_keeps_the_bits():
    a = torch.tensor([1.5, -2.0, 0.0, 3e-39], dtype=torch.float32)
    r = same_bits(a, a.clone())
    assert r and r.mismatched == 0 and r.numel == 4 and "raw-bit equal" in str(r)
    assert int_view(a).dtype == torch.int32 and int_view(a.bfloat16()).dtype == torch.int16


def test_signed_zeros_differ_and_the_first_mismatch_is_named():
    a = torch.tensor([1.0, 0.0, 2.0])
    b = torch.tensor([1.0, -0.0, 2.5])
    r = same_bits(a, b)
    assert not r and r.mismatched == 2 and r.first_index == (1,) and r.max_abs_diff == 0.5
    assert "2/3 elements differ" in str(r)


def test_nan_fails_even_against_the_same_nan_bits():
    a = torch.tensor([float("nan"), 1.0])
    r = same_bits(a, a.clone())
    assert not r and r.nan_count == 1 and r.max_abs_diff == float("inf")


def test_dtype_and_shape_differences_are_reported():
    a = torch.zeros(3)
    assert "dtype differs" in str(same_bits(a, a.double()))
    assert "shape differs" in str(same_bits(a, torch.zeros(4)))


@gpu
def test_device_tensors_compare_on_the_device_and_across_devices():
    a = torch.randn(64, 64, device="cuda").bfloat16()
    assert same_bits(a, a.clone())
    b = a.clone()
    b[3, 5] = -b[3, 5]
    r = same_bits(a, b)
    assert not r and r.mismatched == 1 and r.first_index == (3, 5)
    assert same_bits(a, a.cpu()) and not same_bits(a, b.cpu())
