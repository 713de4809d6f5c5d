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

from rl_engine.backends.shared.triton import arch_reasons, unavailable_reasons
from rl_engine.runtime.registry import Implementation, Request, register

__all__ = ["embedding_triton"]

_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    from rl_engine.backends.shared.triton.embedding import kernels

    return kernels


@torch.library.custom_op("rlk::embedding_triton", mutates_args=(), device_types="cuda")
def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _kernels().forward(ids.reshape(-1), weight).reshape(*ids.shape, weight.shape[1])


@embedding_triton.register_fake
def _(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("rlk::embedding_triton_backward", mutates_args=(), device_types="cuda")
def embedding_triton_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int) -> torch.Tensor:
    H = grad.shape[-1]
    return _kernels().backward(grad.reshape(-1, H), ids.reshape(-1), num_weights)


@embedding_triton_backward.register_fake
def _(grad, ids, num_weights):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _setup(ctx, inputs, output):
    ids, weight = inputs
    ctx.save_for_backward(ids)
    ctx.num_weights = weight.shape[0]


def _backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    return None, embedding_triton_backward(grad.contiguous(), ids, ctx.num_weights)


embedding_triton.register_autograd(_backward, setup_context=_setup)


def _call_reasons(request: Request) -> list[str]:
    return arch_reasons(request.platform.family, request.platform.arch)


register(
    Implementation(
        op="embedding.embedding",
        impl_id="triton.gather_sorted_tree",
        version="1",
        fn=embedding_triton,
        families=("cuda", "rocm"),
        untested_families=("rocm",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "chunk", "run_to_run"}),
        priority=5,
        static_check=unavailable_reasons,
        call_check=_call_reasons,
    )
)
