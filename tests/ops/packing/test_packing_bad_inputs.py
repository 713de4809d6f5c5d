"""Packing rejects malformed layouts before any torch call reads them: non-monotone or float
``cu_seqlens``, lengths outside ``[0, max_len]`` (never clipped)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rl_engine.ops import packing

_PROBE = """
import torch
from rl_engine.ops import packing
try:
    packing.position_ids(torch.tensor({cu}))
except ValueError as exc:
    print("ValueError:", exc)
"""


@pytest.mark.parametrize("cu", ["[0, 500, 3]", "[0, 5, 2, 7]", "[2, 3]"])
def test_position_ids_rejects_a_non_monotone_cu_seqlens_in_a_clean_subprocess(cu):
    # a subprocess: without the check this input corrupts the heap and aborts the interpreter
    out = subprocess.run([sys.executable, "-c", _PROBE.format(cu=cu)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ValueError: cu_seqlens: expected 0 followed by non-decreasing offsets"), out.stdout


@pytest.mark.parametrize(
    "cu,match",
    [
        (torch.tensor([0.0, 1.5, 3.0]), r"^cu_seqlens: expected dtype in \[torch.int32, torch.int64\]"),
        (torch.tensor([], dtype=torch.int64), "^cu_seqlens: expected a non-empty tensor"),
        (torch.tensor([[0, 2]]), "^cu_seqlens: expected 1 dimensions"),
        ([0, 2, 3], "^cu_seqlens: expected a torch.Tensor"),
    ],
)
def test_position_ids_rejects_malformed_cu_seqlens(cu, match):
    with pytest.raises((TypeError, ValueError), match=match):
        packing.position_ids(cu)


def test_position_ids_of_a_valid_layout():
    assert packing.position_ids(torch.tensor([0, 2, 2, 5], dtype=torch.int32)).tolist() == [0, 1, 0, 1, 2]
    assert packing.position_ids(torch.tensor([0])).tolist() == []


@pytest.mark.parametrize(
    "lengths,max_len,match",
    [
        (torch.tensor([-1, 3]), 4, r"^lengths: expected values in \[0, 4\]"),
        (torch.tensor([2, 5]), 4, r"^lengths: expected values in \[0, 4\]"),
        ([1, 9], 4, r"^lengths: expected values in \[0, 4\]"),
        (torch.tensor([1.5, 2.0]), 4, "^lengths: expected dtype in"),
        ([1.5, 2], 4, "^lengths: expected a 1-D integer tensor or a sequence of ints"),
        (torch.tensor([1, 2]), -1, "^max_len: expected a non-negative int"),
        (torch.tensor([1, 2]), 2.0, "^max_len: expected a non-negative int"),
    ],
)
def test_padding_mask_rejects_bad_lengths_instead_of_clipping(lengths, max_len, match):
    with pytest.raises((TypeError, ValueError), match=match):
        packing.padding_mask(lengths, max_len)


def test_padding_mask_of_valid_lengths():
    assert packing.padding_mask([0, 2, 3], 3).long().tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert packing.padding_mask(torch.tensor([1]), 3, padding_side="left").long().tolist() == [[0, 0, 1]]


def test_unpack_rejects_float_cu_seqlens():
    with pytest.raises(ValueError, match="^cu_seqlens: expected dtype in"):
        packing.unpack(torch.zeros(3), torch.tensor([0.0, 1.5, 3.0]))
