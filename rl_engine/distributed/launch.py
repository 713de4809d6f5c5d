"""Start a local world of ranks (one process each) and collect what every rank returns.

:func:`spawn` runs ``fn(group, *args)`` on ``world_size`` fresh interpreter processes (start
method ``spawn``: a forked child of a process whose OpenMP pool already ran can hang), joined by
a ``torch.distributed`` process group (gloo by default) rendezvoused through a file, and
returns the per-rank results in rank order. ``rlk validate ws2``, the distributed tests and
benchmarks all start their worlds through it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["spawn", "MAX_LOCAL_WORLD"]

#: Largest world :func:`spawn` starts on one host (CPU CI: 2 cores shared, so keep worlds small).
MAX_LOCAL_WORLD = 8


def _entry(rank: int, fn: Callable, world_size: int, backend: str, init_file: str, out_dir: str,
           threads: int, timeout_s: float, args: tuple) -> None:
    import datetime

    import torch.distributed as dist

    from rl_engine.distributed.transports import Group

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(Group(), *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", threads: int = 1,
          timeout_s: float = 900.0) -> list[Any]:
    """Run ``fn(group, *args)`` on ``world_size`` ranks; returns ``[result of rank 0, ...]``.

    Args:
        fn: a module-level (picklable) function taking a :class:`~rl_engine.distributed.transports.Group`
            first; its return value must be loadable by ``torch.load`` (tensors, dicts, lists, numbers, str).
        world_size: number of ranks, 1 to :data:`MAX_LOCAL_WORLD`.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one CUDA device per rank).
        threads: torch intra-op threads of each rank.
        timeout_s: a collective that waits longer raises on its rank (the process group's timeout).

    Raises:
        ValueError: ``world_size`` out of range or an unknown ``backend``.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_LOCAL_WORLD:
        raise ValueError(f"world_size: expected an int in [1, {MAX_LOCAL_WORLD}], got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    with tempfile.TemporaryDirectory(prefix="rlk-world-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        mp.start_processes(_entry, args=(fn, world_size, backend, init_file, tmp, threads, timeout_s, args), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
