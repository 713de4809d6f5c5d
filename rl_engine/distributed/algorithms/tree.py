"""The canonical reduction tree: recursive halving over an ordered list of leaves.

The sum of leaves ``g_0 .. g_{n-1}`` is defined as ``S(0, n)`` with

.. math:: S(lo, hi) = g_{lo} \\ (hi - lo = 1), \\qquad
          S(lo, hi) = S(lo, m) + S(m, hi), \\quad m = lo + \\lceil (hi - lo) / 2 \\rceil

(the left half takes the odd leaf: ``n = 3`` gives ``(g_0 + g_1) + g_2``, ``n = 4``
``(g_0 + g_1) + (g_2 + g_3)``, like the pairwise trees of the embedding backward). Every ``+``
is one elementwise IEEE addition of whole tensors, so the result's bits depend only on the
leaves and their order — never on who computed which subtree.

**Decomposition across ranks.** A block of leaves ``[lo, hi)`` is a node of the tree iff the
recursion reaches it (:func:`is_node`). When ``p`` ranks each hold ``b`` consecutive leaves
(``n = p · b``) and ``p`` is a power of two, every rank's block is a node, and the nodes above
them are the tree over the ``p`` block sums — so "each rank reduces its block, then the ``p``
block sums are reduced by the same rule" gives the bits of the single-process tree for every
such ``p`` (:func:`check_blocks`). Likewise, when ``p`` consecutive leaves are reduced together
(one from each rank) and ``n / p`` is a power of two, those groups are nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

__all__ = ["split_point", "is_node", "check_blocks", "tree_sum", "TreeAccumulator"]


def split_point(lo: int, hi: int) -> int:
    """The split ``m`` of node ``[lo, hi)`` (``hi - lo >= 2``): ``lo + ceil((hi - lo) / 2)``."""
    return lo + (hi - lo + 1) // 2


@lru_cache(maxsize=256)
def _nodes(n: int) -> frozenset[tuple[int, int]]:
    out = set()
    stack = [(0, n)]
    while stack:
        lo, hi = stack.pop()
        out.add((lo, hi))
        if hi - lo >= 2:
            m = split_point(lo, hi)
            stack += [(lo, m), (m, hi)]
    return frozenset(out)


def is_node(n: int, lo: int, hi: int) -> bool:
    """Whether leaves ``[lo, hi)`` form a subtree of the canonical tree over ``n`` leaves."""
    return (lo, hi) in _nodes(n)


def check_blocks(n: int, parts: int, *, name: str = "parts", interleaved: bool = False) -> None:
    """Raise ``ValueError`` unless ``parts`` equal blocks of the ``n`` leaves are subtrees.

    ``interleaved=False``: block ``r`` is leaves ``[r·n/parts, (r+1)·n/parts)`` (needs ``parts``
    a power of two dividing ``n``). ``interleaved=True``: the groups reduced together are
    ``[j·parts, (j+1)·parts)`` (needs ``n / parts`` a power of two).
    """
    if parts < 1 or n % parts:
        raise ValueError(f"{name}: {parts} must divide the number of leaves {n}")
    b = n // parts
    blocks = ([(j * parts, (j + 1) * parts) for j in range(b)] if interleaved
              else [(r * b, (r + 1) * b) for r in range(parts)])
    bad = [blk for blk in blocks if not is_node(n, *blk)]
    if bad:
        need = f"{n} // {parts} = {b} to be a power of two" if interleaved else f"{parts} to be a power of two"
        raise ValueError(f"{name}: splitting {n} leaves into {parts} {'interleaved groups' if interleaved else 'blocks'} "
                         f"does not follow the canonical tree (blocks {bad[:2]} are not subtrees; needs {need})")


def tree_sum(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical tree sum of ``leaves`` (equal shapes and dtypes), a new tensor."""
    if not leaves:
        raise ValueError("leaves: expected at least one tensor")

    def rec(lo: int, hi: int) -> torch.Tensor:
        if hi - lo == 1:
            return leaves[lo].clone()
        m = split_point(lo, hi)
        return rec(lo, m).add_(rec(m, hi))

    return rec(0, len(leaves))


class TreeAccumulator:
    """Streaming :func:`tree_sum` over ``n`` leaves that arrive in order, holding at most
    ``O(log n)`` partial sums.

    After leaf ``i`` is added, every node that ends at ``i + 1`` and whose two children are on
    top of the stack is merged (left + right), which is the order :func:`tree_sum` uses.
    """

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected a positive number of leaves, got {n!r}")
        self.n = n
        self._stack: list[tuple[int, int, torch.Tensor]] = []
        self._count = 0

    @property
    def count(self) -> int:
        """Leaves added so far."""
        return self._count

    def add(self, leaf: torch.Tensor) -> None:
        """Add the next leaf (copied)."""
        if self._count >= self.n:
            raise ValueError(f"leaf: all {self.n} leaves were already added")
        i = self._count
        self._count += 1
        self._stack.append((i, i + 1, leaf.clone()))
        while len(self._stack) >= 2:
            lo, m, left = self._stack[-2]
            m2, hi, right = self._stack[-1]
            if m != m2 or not is_node(self.n, lo, hi) or split_point(lo, hi) != m:
                break
            self._stack[-2:] = [(lo, hi, left.add_(right))]

    def result(self) -> torch.Tensor:
        """The tree sum (all ``n`` leaves must have been added)."""
        if self._count != self.n or len(self._stack) != 1:
            raise ValueError(f"leaves: {self._count} of {self.n} added; the tree sum needs all of them")
        return self._stack[0][2]
