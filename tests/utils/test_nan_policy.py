"""The NaN policy: which tensors each policy scans, and that the default never reads a GPU tensor
back to the host (so the default GPU path has no host synchronisation)."""

from __future__ import annotations

import threading

import pytest
import torch

from rl_engine.ops.gemm import linear
from rl_engine.utils.checks import NAN_POLICIES, current_nan_policy, nan_policy, reads_back, scans


def _nan(*shape, device="cpu"):
    x = torch.randn(*shape, device=device)
    x.view(-1)[1] = float("nan")
    return x


def test_default_is_auto_and_scans_host_activations():
    assert current_nan_policy() == "auto"
    x = torch.randn(3, 4)
    assert scans(x) and not scans(x, param=True) and reads_back(x)
    with pytest.raises(ValueError, match=r"^x: contains NaN"):
        linear(_nan(3, 4), torch.randn(5, 4))


@pytest.mark.parametrize("policy, act, param", [("auto", True, False), ("raise", True, False),
                                                ("raise_all", True, True), ("propagate", False, False)])
def test_what_each_policy_scans_on_the_host(policy, act, param):
    x = torch.randn(2, 2)
    with nan_policy(policy):
        assert (scans(x), scans(x, param=True)) == (act, param)


def test_propagate_lets_nan_through_and_scopes_per_thread():
    w = torch.randn(5, 4)
    with nan_policy("propagate"):
        y = linear(_nan(3, 4), w)  # negative control of the scan: no error, NaN in its own row only
        seen = []
        t = threading.Thread(target=lambda: seen.append(current_nan_policy()))
        t.start(), t.join()
    assert torch.isnan(y[0]).any() and not torch.isnan(y[1:]).any()
    assert seen == ["auto"] and current_nan_policy() == "auto"


def test_never_scanned():
    with nan_policy("raise_all"):
        assert not scans(torch.empty(0)) and not scans(torch.ones(3, dtype=torch.int64))
        assert not scans(torch.empty(3, device="meta")) and not reads_back(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="policy: expected one of"):
        with nan_policy("strict"):
            pass
    assert set(NAN_POLICIES) == {"auto", "raise", "raise_all", "propagate"}


@pytest.mark.gpu
def test_gpu_auto_reads_nothing_back_and_raise_does():
    x = _nan(3, 4, device="cuda")
    w = torch.randn(5, 4, device="cuda")
    assert not scans(x) and not reads_back(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = linear(x, w)  # default: no scan, no host synchronisation
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isnan(y[0]).any()
    with nan_policy("raise"), pytest.raises(ValueError, match=r"^x: contains NaN"):
        linear(x, w)  # the explicit policy scans on the GPU too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sum_first_scans_are_exact(dtype):
    """The NaN and finite checks reduce once and fall back to the elementwise test only when the
    sum is NaN / not finite: a NaN anywhere is found, +inf and -inf whose partial sums make a NaN
    sum are not taken for NaN, and finite values whose sum overflows are not taken for inf."""
    from rl_engine.utils.checks import _all_finite, _has_nan, check_finite, check_no_nan

    big = torch.finfo(dtype).max
    clean = torch.randn(64, 333).to(dtype)
    with_nan = clean.clone()
    with_nan[17, 200] = float("nan")
    both_infs = torch.tensor([float("inf"), 1.0, float("-inf"), 2.0], dtype=dtype)
    overflowing = torch.tensor([big, big, big, big], dtype=dtype)
    cancelling = torch.tensor([big, big, -big, -big], dtype=dtype)
    assert not _has_nan(clean) and _all_finite(clean)
    assert _has_nan(with_nan) and not _all_finite(with_nan)  # negative control: the scan does find a NaN
    assert bool(torch.isnan(both_infs.sum())) and not _has_nan(both_infs) and not _all_finite(both_infs)
    assert not torch.isfinite(overflowing.sum()) and _all_finite(overflowing) and not _has_nan(overflowing)
    assert not _has_nan(cancelling) and _all_finite(cancelling)
    check_no_nan("x", both_infs)
    check_finite("x", overflowing)
    with pytest.raises(ValueError, match="^x: contains NaN"):
        check_no_nan("x", with_nan)
    with pytest.raises(ValueError, match="^x: contains inf"):
        check_finite("x", both_infs)
