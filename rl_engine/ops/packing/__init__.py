"""Packing: padded ``[B, L, ...]`` batches ⇄ packed (varlen) ``[T, ...]`` token streams.

Pure data movement — every value is copied bit for bit — so packing can never change an
active token's bits; what this module guarantees is the **layout**: ``cu_seqlens`` (int32,
``[B + 1]``, the varlen attention convention), per-token ``position_ids`` that restart at 0 for
every sequence whatever the padding side, and validation that a mask really is padding::

    p = packing.pack(input_ids, attention_mask, padding_side="left")
    p.values          # [T] the active tokens, sequence after sequence
    p.cu_seqlens      # int32 [B + 1]: sequence b is values[cu_seqlens[b]:cu_seqlens[b + 1]]
    p.position_ids    # int64 [T]: 0 .. len_b - 1 within each sequence
    adv = p.pack_other(advantages)        # any other [B, L, ...] tensor, same layout
    lp_padded = p.unpack(token_logprobs)  # back to [B, L] in the original (left) layout

Left- and right-padded batches of the same sequences pack to identical tensors (layout
invariance); each sequence's packed values depend only on its own row (row invariance).
Gradients flow through :func:`pack` and :func:`unpack` (a gather and a scatter over distinct
positions: exact and deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rl_engine.runtime.registry import dispatch, make_request
from rl_engine.utils.checks import require_same_device, require_tensor

__all__ = ["PaddingSide", "Packed", "pack", "unpack", "padding_mask", "position_ids"]

PaddingSide = Literal["left", "right"]
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Packed:
    """A packed batch and the layout needed to pack more tensors like it or to unpack it.

    Attributes:
        values: ``[T, ...]`` the active positions of each row, rows in batch order.
        cu_seqlens: int32 ``[B + 1]``, ``cu_seqlens[0] = 0``, ``cu_seqlens[b + 1] - cu_seqlens[b] = lengths[b]``.
        position_ids: int64 ``[T]``, the position of each token within its sequence (from 0).
        lengths: int32 ``[B]`` active length of each row.
        indices: int64 ``[T]``, flat index ``b * L + l`` of each token in the padded ``[B, L]`` grid.
        max_seqlen: the longest sequence (0 for an empty batch).
        padded_len: ``L`` of the padded layout.
        padding_side: where the padding was (``"left"`` or ``"right"``).
    """

    values: torch.Tensor
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    indices: torch.Tensor
    max_seqlen: int
    padded_len: int
    padding_side: PaddingSide

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def pack_other(self, padded: torch.Tensor) -> torch.Tensor:
        """Pack another ``[B, L, ...]`` tensor with this layout (``[T, ...]``)."""
        B, L = self.batch_size, self.padded_len
        require_tensor("padded", padded, min_ndim=2)
        if tuple(padded.shape[:2]) != (B, L):
            raise ValueError(f"padded: expected leading dims ({B}, {L}) of the packed layout, got {tuple(padded.shape)}")
        require_same_device(padded=padded, indices=self.indices)
        return padded.reshape(B * L, *padded.shape[2:]).index_select(0, self.indices)

    def unpack(self, values: torch.Tensor | None = None, pad_value: float | int | bool = 0) -> torch.Tensor:
        """``values`` (default: this batch's own) back to ``[B, L, ...]`` in the original layout."""
        v = self.values if values is None else values
        return unpack(v, self.cu_seqlens, self.padded_len, padding_side=self.padding_side, pad_value=pad_value)


def _side(padding_side: object) -> PaddingSide:
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: expected 'left' or 'right', got {padding_side!r}")
    return padding_side  # type: ignore[return-value]


def padding_mask(lengths: torch.Tensor | Sequence[int], max_len: int, *, padding_side: PaddingSide = "right") -> torch.Tensor:
    """Boolean ``[B, max_len]`` mask with ``lengths[b]`` ones on the non-padded side of row ``b``.

    Raises:
        TypeError / ValueError: ``lengths`` is not a 1-D integer tensor or a sequence of ints, or
            holds a value outside ``[0, max_len]`` (nothing is clipped); ``max_len`` is not a
            non-negative int; a bad ``padding_side``.
    """
    side = _side(padding_side)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len: expected a non-negative int, got {max_len!r}")
    if isinstance(lengths, torch.Tensor):
        require_tensor("lengths", lengths, dtypes=_INT_DTYPES, ndim=1, contiguous=False)
        n = lengths.to(torch.int64)
    elif isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in lengths
    ):
        n = torch.tensor(list(lengths), dtype=torch.int64)
    else:
        raise TypeError(f"lengths: expected a 1-D integer tensor or a sequence of ints, got {type(lengths).__name__}")
    if n.numel() and n.device.type != "meta" and (int(n.min()) < 0 or int(n.max()) > max_len):
        raise ValueError(f"lengths: expected values in [0, {max_len}] (max_len), got min {int(n.min())}, max {int(n.max())}")
    cols = torch.arange(max_len, device=n.device)
    if side == "right":
        return cols.unsqueeze(0) < n.unsqueeze(1)
    return cols.unsqueeze(0) >= (max_len - n).unsqueeze(1)


def _check_cu_seqlens(cu_seqlens: object) -> torch.Tensor:
    """``cu_seqlens``: a 1-D int32/int64 tensor, 0 first, non-decreasing; returns it as int64.
    Checked on the host before any indexing op reads it (a decreasing offset would make
    ``repeat_interleave`` write past its output)."""
    require_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, contiguous=False, non_empty=True)
    cu = cu_seqlens.to(torch.int64)
    if cu.device.type == "meta":
        raise ValueError("cu_seqlens: expected a tensor with values (got a meta tensor)")
    host = cu.cpu()
    if int(host[0]) != 0 or bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected 0 followed by non-decreasing offsets, got {host.tolist()[:16]}")
    return cu


def position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]`` positions that restart at 0 at every sequence start of ``cu_seqlens``.

    Raises:
        TypeError / ValueError: ``cu_seqlens`` is not a non-empty 1-D int32/int64 tensor starting
            at 0 with non-decreasing offsets (float offsets are rejected, not truncated).
    """
    cu = _check_cu_seqlens(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts


def _lengths_from_mask(mask: object, B: int, L: int, side: PaddingSide) -> torch.Tensor:
    require_tensor("attention_mask", mask, ndim=2, contiguous=False)
    if mask.dtype != torch.bool and mask.dtype not in _INT_DTYPES:
        raise ValueError(f"attention_mask: expected dtype bool or an integer dtype, got {mask.dtype}")
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"attention_mask: expected shape ({B}, {L}) (the leading dims of padded), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask: expected only 0 and 1 values")
        mask = mask != 0
    lengths = mask.sum(dim=1)
    bad = (mask != padding_mask(lengths, L, padding_side=side)).any(dim=1)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        row = "".join("1" if x else "0" for x in mask[b, :64].tolist()) + ("..." if L > 64 else "")
        want = "ones then zeros" if side == "right" else "zeros then ones"
        raise ValueError(
            f"attention_mask: row {b} is not a contiguous run of ones on the {'left' if side == 'right' else 'right'} "
            f"(padding_side={side!r} expects {want}), got {row}"
        )
    return lengths


def _lengths_from_arg(lengths: object, B: int, L: int, device: torch.device) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        require_tensor("lengths", lengths, dtypes=_INT_DTYPES, ndim=1, contiguous=False)
        t = lengths.to(torch.int64)
    elif isinstance(lengths, Sequence) and all(isinstance(v, int) and not isinstance(v, bool) for v in lengths):
        t = torch.tensor(list(lengths), dtype=torch.int64, device=device)
    else:
        raise TypeError(f"lengths: expected an integer tensor or a sequence of ints, got {type(lengths).__name__}")
    if t.shape != (B,):
        raise ValueError(f"lengths: expected {B} lengths (one per row of padded), got shape {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > L):
        raise ValueError(f"lengths: expected values in [0, {L}], got min {int(t.min())}, max {int(t.max())}")
    return t


def pack(
    padded: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    lengths: torch.Tensor | Sequence[int] | None = None,
    padding_side: PaddingSide = "right",
) -> Packed:
    r"""Pack the active positions of a padded batch into one token stream.

    .. math:: \text{values}[c_b + p] = \text{padded}[b, s_b + p], \quad 0 \le p < n_b, \quad
              c_b = \textstyle\sum_{b' < b} n_{b'}

    with ``s_b = 0`` for right padding and ``s_b = L - n_b`` for left padding.

    Shapes:
        padded: ``[B, L, ...]`` any dtype; attention_mask: ``[B, L]`` bool or 0/1 integers, or
        lengths: ``[B]`` ints in ``[0, L]`` (exactly one of the two); returns :class:`Packed`
        with ``values`` ``[T, ...]``, ``T = Σ n_b``.

    Contract ``packing.pack``: exact (bit-for-bit copies), row invariant, layout invariant (left
    and right padding of the same sequences give identical results), deterministic.

    Raises:
        TypeError / ValueError: wrong types or shapes; a mask row that is not one contiguous run
            of ones on the non-padded side (``padding_side`` says which); lengths out of
            ``[0, L]``; both or neither of ``attention_mask`` and ``lengths``; a bad
            ``padding_side``; tensors on different devices (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    side = _side(padding_side)
    require_tensor("padded", padded, min_ndim=2, contiguous=False)
    B, L = padded.shape[0], padded.shape[1]
    if (attention_mask is None) == (lengths is None):
        raise ValueError("attention_mask: pass exactly one of attention_mask and lengths")
    if attention_mask is not None:
        require_tensor("attention_mask", attention_mask, contiguous=False)
        require_same_device(padded=padded, attention_mask=attention_mask)
        n = _lengths_from_mask(attention_mask, B, L, side)
    else:
        n = _lengths_from_arg(lengths, B, L, padded.device)
        require_same_device(padded=padded, lengths=n)
    req = make_request("packing.pack", padded, features={"padding_side": side})
    values, cu_seqlens, pos, idx = dispatch(req, padded, n, side)
    max_seqlen = int(n.max()) if n.numel() else 0
    return Packed(values, cu_seqlens, pos, n.to(torch.int32), idx, max_seqlen, L, side)


def unpack(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int | None = None,
    *,
    padding_side: PaddingSide = "right",
    pad_value: float | int | bool = 0,
) -> torch.Tensor:
    r"""Scatter a packed token stream back into a padded ``[B, max_len, ...]`` batch.

    .. math:: \text{out}[b, s_b + p] = \text{values}[c_b + p], \quad \text{pad\_value elsewhere}

    Shapes:
        values: ``[T, ...]``; cu_seqlens: int32/int64 ``[B + 1]`` (0, non-decreasing, ending
        at ``T``); returns ``[B, max_len, ...]`` in ``values.dtype``; ``max_len`` defaults to
        the longest sequence.

    Contract ``packing.unpack``: exact, row invariant, layout invariant (``unpack(pack(x))``
    restores every active position bit for bit on either padding side), deterministic.

    Raises:
        TypeError / ValueError: malformed ``cu_seqlens``, ``max_len`` shorter than a sequence,
            bad ``padding_side``, tensors on different devices (the message names the argument).
        NoEligibleImplementation: strict policy and no implementation covers the request.
    """
    side = _side(padding_side)
    require_tensor("values", values, min_ndim=1, contiguous=False)
    require_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, contiguous=False)
    require_same_device(values=values, cu_seqlens=cu_seqlens)
    cu = _check_cu_seqlens(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    if int(cu[-1]) != values.shape[0]:
        raise ValueError(f"cu_seqlens: expected the last offset to equal values.shape[0] = {values.shape[0]}, got {int(cu[-1])}")
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_len is None:
        max_len = longest
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < longest:
        raise ValueError(f"max_len: expected an int >= the longest sequence ({longest}), got {max_len!r}")
    req = make_request("packing.unpack", values, features={"padding_side": side})
    return dispatch(req, values, lengths, max_len, side, pad_value)
