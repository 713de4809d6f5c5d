"""Launchers that expose the attention kernels' fixed row sum on its own (imported only by the
Triton-interpreter and GPU tests, which have triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton.attention.device import rlk_attn_rowsum


@triton.jit
def rlk_test_adjacent_rowsum(x, BLOCK_M: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """The negative control: adjacent pairs (``x[2j] + x[2j+1]``) — also a fixed tree, but not
    the contract's fold, so it must differ from ``fold_sum`` for some rows."""
    for i in tl.static_range(LOG2N):
        x = tl.reshape(x, [BLOCK_M, N >> (i + 1), 2])
        a, b = tl.split(x)
        x = a + b
    return tl.reshape(x, [BLOCK_M])


@triton.jit
def rlk_test_rowsum(x_ptr, out_ptr, BLOCK_M: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr,
                    ADJACENT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    x = tl.load(x_ptr + rows[:, None] * N + tl.arange(0, N)[None, :])
    if ADJACENT:
        s = rlk_test_adjacent_rowsum(x, BLOCK_M, N, LOG2N)
    else:
        s = rlk_attn_rowsum(x, BLOCK_M, N, LOG2N)
    tl.store(out_ptr + rows, s)


def rowsum(x: torch.Tensor, block_m: int = 16, adjacent: bool = False) -> torch.Tensor:
    """Row sums of fp32 ``x [R, N]`` (``R`` a multiple of ``block_m``, ``N`` a power of two)."""
    r, n = x.shape
    out = x.new_empty(r)
    rlk_test_rowsum[(r // block_m,)](x, out, BLOCK_M=block_m, N=n, LOG2N=n.bit_length() - 1, ADJACENT=adjacent)
    return out
