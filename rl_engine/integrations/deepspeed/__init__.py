"""DeepSpeed as the training engine of a transformers model with rl_engine installed.

:func:`initialize` installs rl_engine into the HF model (:mod:`~rl_engine.integrations.hf.install`)
*before* ``deepspeed.initialize`` wraps it, so the engine's forward (every ZeRO stage; ZeRO-3
gathers each module's parameters in its hooks, and every replacement calls its sub-modules)
runs our operators. :func:`full_parameters` gathers ZeRO-3 partitions for the rollout
(``generate``) on the same weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rl_engine.integrations.hf.install import HFInstall, install

__all__ = ["initialize", "full_parameters"]


def initialize(model: torch.nn.Module, *, config: dict[str, Any], optimizer: torch.optim.Optimizer | None = None,
               **kwargs) -> tuple[Any, Any, HFInstall]:
    """``install(model)`` then ``deepspeed.initialize(model=model, optimizer=optimizer, config=config)``.

    Returns ``(engine, optimizer, install)``; ``install.unapply()`` restores the HF modules.
    Pass a torch optimizer on CPU: DeepSpeed's own JIT-builds C++ ops (slow, needs a compiler).

    Raises:
        InstallConflict: see :func:`~rl_engine.integrations.hf.install.install`.
    """
    import deepspeed

    inst = install(model)
    try:
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, **kwargs)
    except BaseException:
        inst.unapply()
        raise
    return engine, opt, inst


@contextlib.contextmanager
def full_parameters(engine) -> Iterator[torch.nn.Module]:
    """The engine's module with full (gathered) parameters under ZeRO-3; a no-op otherwise."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield module
    else:
        yield module
