"""The elementwise primitives the invariant CPU backend rests on give the same bits for an
element whatever code path computes it (vectorised body, scalar tail, strided loop), and the
ones it avoids do not (the negative control of this guard)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.utils.bits import same_bits

_N = 1 << 18


def _paths_agree(fn, x) -> bool:
    """fn over the whole contiguous tensor (vectorised body) vs over a strided view (scalar
    loop) vs in 3-element pieces (scalar tail)."""
    body = fn(x)
    strided = fn(torch.stack([x, x], 1)[:, 0]).contiguous()
    tails = torch.cat([fn(x[i : i + 3]) for i in range(0, 3000, 3)])
    return bool(same_bits(strided, body)) and bool(same_bits(tails, body[:3000]))


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(_N, generator=g, dtype=torch.float64) * 30).to(dtype)


@pytest.mark.parametrize(
    "name,fn",
    [
        ("exp", torch.exp),
        ("neg_exp_plus_1", lambda t: torch.exp(-t) + 1.0),
        ("reciprocal", lambda t: t.reciprocal()),
        ("div", lambda t: t / (t.abs() + 3.0)),
        ("sqrt", lambda t: torch.sqrt(t.abs())),
        ("mul_add_sub", lambda t: (t * 1.5 - 0.25) * t + t),
    ],
)
def test_fp32_primitives_are_path_independent(name, fn):
    assert _paths_agree(fn, _inputs(torch.float32)), name


@pytest.mark.parametrize(
    "name,fn",
    [
        ("round", lambda t: torch.round(t * 0.6366197723675814)),
        ("mul_add", lambda t: (t * 1.5 + 0.25) * t - t),
        ("to_fp32", lambda t: t.to(torch.float32)),
    ],
)
def test_fp64_primitives_are_path_independent(name, fn):
    assert _paths_agree(fn, _inputs(torch.float64)), name


def test_negative_control_sigmoid_is_caught():
    assert not _paths_agree(torch.sigmoid, _inputs(torch.float32))
