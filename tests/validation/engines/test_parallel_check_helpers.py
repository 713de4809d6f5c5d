"""Helpers of the parallel-layout check (``rlk check --engine vllm --tp N --train-engine megatron``)
that run without vLLM or Megatron: the packed batch the Megatron ranks score and the vLLM
workers' CPU binding."""

from __future__ import annotations

import os

import torch

from rl_engine.engine.executor import TrainSequence
from rl_engine.ops.logprob import KEEP_ALL_BOUNDARY, KeptSet
from rl_engine.utils.bits import same_bits
from rl_engine.validation.engines.megatron import _pack, megatron_layout_name
from rl_engine.validation.engines.vllm import cpu_binding


def test_pack_shifts_targets_and_their_kept_records():
    """Position ``i`` of a sequence predicts token ``i + 1`` and carries that token's record; the
    last position of each sequence (no next token) keeps everything."""
    a = TrainSequence(7, (5, 6, 7), (0, 1, 1), KeptSet(torch.tensor([float("-inf"), 1.5, 2.5]),
                                                       torch.tensor([KEEP_ALL_BOUNDARY, 11, 12], dtype=torch.int32)))
    b = TrainSequence(9, (8, 9), (0, 1))  # no record: keep-all
    p = _pack([a, b])
    assert p["ids"].tolist() == [5, 6, 7, 8, 9] and p["pos"].tolist() == [0, 1, 2, 0, 1]
    assert p["cu"].tolist() == [0, 3, 5] and p["tgt"].tolist() == [6, 7, 0, 9, 0]
    inf = float("-inf")
    assert same_bits(p["thr"], torch.tensor([1.5, 2.5, inf, inf, inf]))
    assert p["bnd"].tolist() == [11, 12] + [KEEP_ALL_BOUNDARY] * 3
    # negative control: an unshifted record would put token 0's record on position 0
    assert not same_bits(p["thr"][:3], a.kept.threshold)


def test_cpu_binding_splits_this_process_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_binding(1) == ",".join(map(str, cpus))
    shares = cpu_binding(len(cpus)).split("|")
    assert len(shares) == len(cpus) and all(len(s.split(",")) == 1 for s in shares)
    assert cpu_binding(len(cpus) + 1) == "nobind"
    assert megatron_layout_name(4) == "megatron-tp4"
