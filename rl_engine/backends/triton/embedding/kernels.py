"""Triton kernels of ``embedding.embedding`` (imported on first call).

* ``rlk_embedding_fwd``       ``out[t] = weight[ids[t]]``: a bit copy of one weight row per
  token (grid: token × feature block); it asserts ``0 <= ids[t] < V`` on the device (compiled
  with ``debug=True``, launched with ``sanitize_overflow=False``: the assertion and nothing
  else), so the entry point launches no separate range check;
* ``rlk_embedding_bwd_tree``  the deterministic weight gradient, no atomics. The token ids are
  sorted stably (tokens grouped by id, each group in increasing token index) and ``fp32(dy)``
  gathered in that order into a scratch buffer; one program per (sorted token, feature block),
  of which the first token of each id group (``count > 0``) folds its own group in place with
  the CPU's pairwise tree — at step ``s = 1, 2, 4, ...``
  rank ``j ≡ 0 (mod 2s)`` adds rank ``j + s`` if it exists (``n = 3``: ``(g0 + g1) + g2``) — and
  writes the group's sum, rounded once, to ``dweight[id]``. Rows of ids that do not occur are
  +0. Groups are disjoint, so no two programs touch the same memory; within a program a
  barrier separates the tree's steps.

``dweight[v]`` depends only on the gradients of the tokens with id ``v`` and their relative
order: the same bits run to run, whatever the other tokens are (and, the tree being the CPU's
and every step an IEEE fp32 addition, the same bits as the CPU implementation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl_engine.backends.triton import device_guard

__all__ = ["forward", "backward", "KERNEL_NAMES"]

KERNEL_NAMES = ("rlk_embedding_fwd", "rlk_embedding_bwd_tree")
_BLOCK_H = 1024


@triton.jit(do_not_specialize=["N"], debug=True)
def rlk_embedding_fwd(ids_ptr, w_ptr, out_ptr, N, V, H, BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    v = tl.load(ids_ptr + tok).to(tl.int64)
    # the bound check of ids where they are read (the kernel is compiled with debug=True so the
    # assertion is kept): an out-of-range id stops the launch instead of reading past weight
    tl.device_assert((v >= 0) & (v < V), "ids: expected token ids in [0, V) (the rows of weight)")
    tl.store(out_ptr + tok * H + cols, tl.load(w_ptr + v * H + cols, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["N"])
def rlk_embedding_bwd_tree(buf_ptr, count_ptr, id_ptr, dw_ptr, N, H, BLOCK_H: tl.constexpr):
    start = tl.program_id(0).to(tl.int64)  # this program's sorted token
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    n = tl.load(count_ptr + start).to(tl.int64)  # its group's length if it starts one, else 0
    head = buf_ptr + start * H + cols
    step = 1
    while step < n:
        for j in range(0, n - step, 2 * step):
            left = head + j * H
            right = tl.load(head + (j + step) * H, mask=mask, other=0.0)
            tl.store(left, tl.load(left, mask=mask, other=0.0) + right, mask=mask)
        tl.debug_barrier()
        step *= 2
    if n > 0:  # the first token of its id group: write the group's sum
        v = tl.load(id_ptr + start).to(tl.int64)
        total = tl.load(head, mask=mask, other=0.0)
        tl.store(dw_ptr + v * H + cols, total.to(dw_ptr.dtype.element_ty), mask=mask)


def forward(ids_flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    N = ids_flat.shape[0]
    V, H = weight.shape
    out = weight.new_empty((N, H))
    if N == 0:
        return out
    block = min(_BLOCK_H, max(16, triton.next_power_of_2(H)))
    with device_guard(weight):
        rlk_embedding_fwd[(N, triton.cdiv(H, block))](ids_flat, weight, out, N, V, H, BLOCK_H=block, num_warps=4,
                                                       sanitize_overflow=False)
    return out


def backward(grad2: torch.Tensor, ids_flat: torch.Tensor, num_weights: int) -> torch.Tensor:
    """``dweight [num_weights, H]`` in ``grad2.dtype`` from ``grad2 [N, H]`` and ``ids_flat [N]``."""
    N, H = grad2.shape
    dw = grad2.new_zeros((num_weights, H))
    if N == 0 or H == 0:
        return dw
    sid, order = torch.sort(ids_flat.to(torch.int64), stable=True)
    buf = grad2.index_select(0, order).float()  # [N, H] fp32, grouped by id, token order within
    # Group bounds on the device (no host read, capturable): one program per sorted token; the
    # token that starts a group folds it, the others do nothing. A group's length is the
    # distance to the next group start (a reversed running minimum of the start positions).
    idx = torch.arange(N, device=grad2.device)
    is_start = torch.ones(N, dtype=torch.bool, device=grad2.device)
    is_start[1:] = sid[1:] != sid[:-1]
    start_at = torch.where(is_start, idx, N)
    next_start = torch.cat([start_at[1:].flip(0).cummin(0).values.flip(0), start_at.new_full((1,), N)])
    counts = torch.where(is_start, next_start - idx, 0)
    block = min(_BLOCK_H, max(16, triton.next_power_of_2(H)))
    with device_guard(grad2):
        rlk_embedding_bwd_tree[(N, triton.cdiv(H, block))](
            buf, counts, sid, dw, N, H, BLOCK_H=block, num_warps=4,
        )
    return dw
