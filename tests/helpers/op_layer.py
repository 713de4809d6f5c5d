"""Observe whether a call went through the ``torch.library`` custom-op layer.

:func:`ops_run` lists the custom ops whose dispatcher events a profiler saw (the direct eager
path's ``record_function`` ranges carry the same names but are user annotations, left out);
:class:`KeepOpLayer` is a pass-through ``TorchDispatchMode``: being active, it makes every call
go through its op (``rl_engine.runtime.custom_ops.direct_call_ok`` refuses under a dispatch mode).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode


def ops_run(fn: Callable[[], object], prefix: str = "rlk::") -> list[str]:
    """Names, in order, of the custom ops starting with ``prefix`` that ran during ``fn()``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith(prefix) and not e.is_user_annotation]


class KeepOpLayer(TorchDispatchMode):
    """Pass every operation through unchanged; being active, it keeps the custom-op layer."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
