"""Reference for ``packing.*``: one row at a time with slicing and ``torch.cat`` (the diagnostic
fallback, and an independent implementation the vectorised one is tested against)."""

from __future__ import annotations

import torch

from rl_engine.runtime.registry import register_reference


def _span(n: int, L: int, padding_side: str) -> slice:
    return slice(0, n) if padding_side == "right" else slice(L - n, L)


@register_reference("packing.pack")
def pack(padded: torch.Tensor, lengths: torch.Tensor, padding_side: str):
    B, L = padded.shape[0], padded.shape[1]
    values, cu, pos, idx = [], [0], [], []
    for b, n in enumerate(int(v) for v in lengths.tolist()):
        span = _span(n, L, padding_side)
        values.append(padded[b, span])
        cu.append(cu[-1] + n)
        pos.extend(range(n))
        idx.extend(b * L + i for i in range(span.start, span.stop))
    dev = padded.device
    vals = torch.cat(values) if values else padded.new_empty((0, *padded.shape[2:]))
    return (
        vals,
        torch.tensor(cu, dtype=torch.int32, device=dev),
        torch.tensor(pos, dtype=torch.int64, device=dev),
        torch.tensor(idx, dtype=torch.int64, device=dev),
    )


@register_reference("packing.unpack")
def unpack(values: torch.Tensor, lengths: torch.Tensor, max_len: int, padding_side: str, pad_value=0):
    rows, k = [], 0
    for n in (int(v) for v in lengths.tolist()):
        row = values.new_full((max_len, *values.shape[1:]), pad_value)
        row[_span(n, max_len, padding_side)] = values[k : k + n]
        rows.append(row)
        k += n
    if not rows:
        return values.new_empty((0, max_len, *values.shape[1:]))
    return torch.stack(rows)
