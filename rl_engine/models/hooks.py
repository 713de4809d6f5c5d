"""The stage hook: the one place a model hands its intermediate tensors to an observer.

A model calls :func:`stage_hook` once per forward; when it returns a callable ``hook``, the model
calls ``hook(layer, stage, tensor)`` at every stage of that forward (``layer = -1`` for the
model-level stages) and continues with the tensor the hook returns. When none is set the lookup is
one context-variable read per forward and no tensor is touched.

The hook is scoped with :func:`use_stage_hook` (a context manager over a
:class:`contextvars.ContextVar`, restored on exit, so threads and nested blocks see their own).
Observers such as :func:`rl_engine.validation.capture.capture` set it; models never import them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["StageHook", "stage_hook", "use_stage_hook"]

#: ``hook(layer, stage, tensor) -> tensor``.
StageHook = Callable[[int, str, torch.Tensor], torch.Tensor]

_HOOK: ContextVar[StageHook | None] = ContextVar("rl_engine_stage_hook", default=None)


def stage_hook() -> StageHook | None:
    """The stage hook in effect here, or ``None``."""
    return _HOOK.get()


@contextmanager
def use_stage_hook(hook: StageHook | None) -> Iterator[None]:
    """Call ``hook`` at every stage of the model forwards run inside the block (``None`` turns an
    outer hook off)."""
    if hook is not None and not callable(hook):
        raise TypeError(f"hook: expected a callable (layer, stage, tensor) -> tensor or None, got {type(hook).__name__}")
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)
