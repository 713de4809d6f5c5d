"""Triton ``embedding.embedding`` for CUDA (validated on sm90) and ROCm (declared, untested).

Same public semantics as the CPU implementation (``rl_engine/backends/cpu/embedding``): the
forward is a gather (each output row a bit copy of a weight row: **row** and **chunk
invariant**); the weight gradient sums the upstream rows of the tokens sharing an id with the
same pairwise tree in increasing token order, in fp32, rounded once — sorted-ids segmented
reduction, **no atomics**, so **deterministic run to run** (see ``kernels.py``).

Nothing here imports triton: the kernels (``kernels.py``) are imported on the first call.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_embedding
from rl_engine.backends.triton import register_triton

__all__ = ["embedding_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.triton.embedding import kernels

    return kernels


@torch.library.custom_op("rlk::embedding_triton", mutates_args=(), device_types="cuda")
def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _kernels().forward(ids.reshape(-1), weight).reshape(*ids.shape, weight.shape[1])


@torch.library.custom_op("rlk::embedding_triton_backward", mutates_args=(), device_types="cuda")
def embedding_triton_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int) -> torch.Tensor:
    H = grad.shape[-1]
    return _kernels().backward(grad.reshape(-1, H), ids.reshape(-1), num_weights)


wire_embedding(embedding_triton, embedding_triton_backward)


register_triton(
    "embedding.embedding",
    "triton.gather_sorted_tree",
    embedding_triton,
    dtypes=_DTYPES,
    guarantees=frozenset({"row", "chunk", "run_to_run"}),
    device_index_checks=True,
)
