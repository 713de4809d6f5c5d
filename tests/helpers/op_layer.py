"""Observe whether a call went through the ``torch.library`` custom-op layer.

:func:`ops_run` lists the custom ops whose dispatcher events a profiler saw (the direct eager
path's ``record_function`` ranges carry the same names but are user annotations, left out);
:class:`KeepOpLayer` is a pass-through ``TorchDispatchMode``: being active, it makes every call
go through its op (``rl_engine.runtime.custom_ops.direct_call_ok`` refuses under a dispatch mode);
:func:`gpu_kernel_names` lists the kernels a CUDA profile saw (the same ranges are mirrored onto the
GPU timeline as user annotations: they name ops, not kernels, and are left out).
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


def gpu_kernel_names(prof: profile) -> list[str]:
    """Sorted names of the GPU events of ``prof`` that are kernels (or copies and memsets): the
    profiler mirrors every ``record_function`` range, the direct path's ``rlk::<op>`` ones too,
    onto the GPU timeline as a user annotation, which this leaves out."""
    from torch.autograd import DeviceType

    return sorted({e.name for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation})


class KeepOpLayer(TorchDispatchMode):
    """Pass every operation through unchanged; being active, it keeps the custom-op layer."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
