"""Tensor- and data-parallel training whose bits do not depend on the parallel layout (WS2).

* :mod:`.transports` — collectives over a ``torch.distributed`` group (gloo, NCCL), each exact
  by construction, with a per-rank record of the bytes sent;
* :mod:`.algorithms` — canonical reduction orders: the reduction tree, the sharded-K exact GEMM,
  the vocabulary block merge;
* :mod:`.tensor_parallel` — column-, row- and vocabulary-parallel blocks, forward and backward;
* :mod:`.data_parallel` — the gradient reduction over micro-batches and ranks in one fixed tree;
* :mod:`.qwen3` — rl_engine's Qwen3 sharded for tensor parallelism, on these blocks;
* :mod:`.launch` — start a local world of ranks.

See docs/distributed.md. Nothing here initialises a process group on import.
"""
