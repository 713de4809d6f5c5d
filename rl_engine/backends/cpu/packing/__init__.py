"""Packing as vectorised index arithmetic (no arithmetic on values: bit-exact copies).

Token ``k`` of the packed stream belongs to row ``b`` (``repeat_interleave`` of the row ids by
length), sits at position ``p = k - cu_seqlens[b]`` and comes from flat padded index
``b·L + s_b + p`` (``s_b = 0`` right padding, ``L - n_b`` left padding). :func:`pack` is one
``index_select`` over those indices and :func:`unpack` one ``index_copy`` into a ``pad_value``
buffer; both are differentiable through autograd (a gather and a scatter over distinct indices,
so exact and deterministic). Plain torch indexing runs on whatever device the tensors are on.
"""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import Implementation, register

__all__ = ["pack", "unpack", "layout_indices"]

_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)


def layout_indices(lengths: torch.Tensor, L: int, padding_side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu_seqlens int32 [B+1], position_ids int64 [T], flat indices int64 [T])`` for ``lengths``."""
    n = lengths.to(torch.int64)
    B = n.shape[0]
    cu = torch.zeros(B + 1, dtype=torch.int64, device=n.device)
    torch.cumsum(n, 0, out=cu[1:])
    total = int(cu[-1])
    rows = torch.repeat_interleave(torch.arange(B, device=n.device), n, output_size=total)
    pos = torch.arange(total, device=n.device) - cu[:-1][rows]
    start = rows * L
    if padding_side == "left":
        start = start + (L - n)[rows]
    return cu.to(torch.int32), pos, start + pos


def pack(padded: torch.Tensor, lengths: torch.Tensor, padding_side: str):
    B, L = padded.shape[0], padded.shape[1]
    cu, pos, idx = layout_indices(lengths, L, padding_side)
    values = padded.reshape(B * L, *padded.shape[2:]).index_select(0, idx)
    return values, cu, pos, idx


def unpack(values: torch.Tensor, lengths: torch.Tensor, max_len: int, padding_side: str, pad_value=0):
    B = lengths.shape[0]
    _, _, idx = layout_indices(lengths, max_len, padding_side)
    out = values.new_full((B * max_len, *values.shape[1:]), pad_value)
    return out.index_copy(0, idx, values).reshape(B, max_len, *values.shape[1:])


for _op, _fn in (("packing.pack", pack), ("packing.unpack", unpack)):
    register(
        Implementation(
            op=_op,
            impl_id="torch.index",
            version="1",
            fn=_fn,
            families=("cpu", "cuda", "rocm"),
            dtypes=_DTYPES,
            guarantees=frozenset({"row", "layout", "run_to_run", "threads", "isa"}),
            priority=10,
            untested_families=("cuda", "rocm"),
        )
    )
