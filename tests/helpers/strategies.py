"""Hypothesis strategies shared by operator tests: batch trials (subsets, permutations, positions)."""

from __future__ import annotations

from hypothesis import strategies as st

DTYPES = ("float32", "bfloat16")


@st.composite
def row_trials(draw, n_rows: int, max_trials: int = 3):
    """Index lists into ``[0, n_rows)``: a single row, a random subset in random order, a
    permutation of all rows, and a batch where one row moves to a random position."""
    trials = [[draw(st.integers(0, n_rows - 1))]]
    k = draw(st.integers(1, n_rows))
    trials.append(draw(st.permutations(range(n_rows)))[:k])
    if max_trials >= 3:
        perm = draw(st.permutations(range(n_rows)))
        trials.append(list(perm))
    return trials
