"""The distributed blocks through NCCL on one CUDA device (world size 1): the multi-GPU code path.

Bits checked on the device: the column-parallel and ``full_k`` row-parallel forwards are
``gemm.linear`` on the GPU; the sharded exact GEMM (``exact_k`` forward, every sharded
backward reduction) is exact integer arithmetic in float64, so its bits are the CPU's
``exact_matmul``; the vocabulary-parallel log-prob equals the canonical log-sum-exp run in one
piece on the same device. It is not claimed equal to ``ops.logprob`` on the GPU: the torch-level
log-sum-exp of ``backends/cpu/logprob/lse.py`` run on CUDA tensors differs from the Triton op
(which has the CPU's bits) by one ulp on some rows (H200, torch 2.11: 2 of 13 tokens), see
docs/distributed.md. Runs on the device with zero skips (marker ``gpu``); multi-GPU runs are not
part of this suite.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.backends.cpu.common import exact_matmul
from rl_engine.utils.bits import same_bits
from tests.distributed import workers as W


@pytest.fixture(scope="module")
def nccl():
    from rl_engine.distributed.launch import spawn

    return spawn(W.nccl_checks, 1, backend="nccl")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W.DTYPES, ids=str)
def test_nccl_world_of_one(nccl, dtype):
    assert nccl["backend"] == "nccl"
    x, w, _, dy = W.linear_inputs(dtype)
    y, dx, ref_y = nccl[("column", dtype)]
    assert same_bits(y, ref_y)  # gemm.linear on the GPU, column-chunk invariant
    assert same_bits(dx, exact_matmul(dy, w.t()))  # the exact reduction: the CPU's bits
    y_full, dx_full = nccl[("full_k", dtype)]
    assert same_bits(y_full, ref_y) and same_bits(dx_full, exact_matmul(dy, w.t()))
    y_exact, dx_exact = nccl[("exact_k", dtype)]
    assert same_bits(y_exact, exact_matmul(x, w))
    lp, ent, dh, logits, one_piece, gpu_op = nccl[("logprobs", dtype)]
    # the shard merge reproduces the canonical log-sum-exp run in one piece on the same device
    assert same_bits(lp, one_piece)
    assert dh.shape == (W.T, W.H) and bool(torch.isfinite(dh).all())
    emb = nccl[("embedding", dtype)]
    _, table, ids, *_ = W.vocab_inputs(dtype)
    assert same_bits(emb, table[ids])


@pytest.mark.gpu
def test_nccl_tree_reductions(nccl):
    out, t = nccl["tree_all_reduce"]
    assert same_bits(out, t)  # one rank: the tree of one leaf
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in nccl["dp"])
