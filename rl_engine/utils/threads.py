"""Scoped torch intra-op thread count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["intra_op_threads"]


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (None: unchanged); restores the count in ``finally``.

    The thread count is process-wide torch state, so this scopes it to one block of one caller;
    the CPU backend's bits do not depend on it (the ``threads`` invariance).
    """
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
