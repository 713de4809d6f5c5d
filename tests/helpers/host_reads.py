"""Catch, on any device, the operations that would make a GPU call wait for the device.

:class:`HostReads` is a ``TorchDispatchMode`` that records every aten operation that reads a
tensor's values back to the host (``item``, ``bool``, ``int``, ``float`` of a tensor), sizes an
output by the data (``nonzero``, ``unique``, ``masked_select``), compares whole tensors on the
host (``equal``), or makes a tensor from host data (``torch.tensor(...)``: on a GPU, a copy
from pageable memory that waits for the device). On a CUDA device each of them is a
synchronisation that ``torch.cuda.set_sync_debug_mode("error")`` refuses; recording them lets a
CPU run check the GPU path's code for them (with the ``gpu_branches`` fixture of
``tests/conftest.py``, the CPU call takes the GPU call's branches of the NaN policy).
"""

from __future__ import annotations

import traceback
from collections.abc import Collection

from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

#: Code only host tensors reach: ``portable.exp``'s CPU fast path (it tests on the host which
#: elements lie near a rounding boundary; off the CPU every element takes the float64 definition)
#: and ``portable.sqrt``'s host path for a few CPU elements (``math.sqrt``).
PORTABLE_HOST_PATHS = ("rl_engine.utils.portable:exp", "rl_engine.utils.portable:_sqrt_scalars")
#: ... and the CPU backends, whose code is not the GPU's (the Triton kernels are); the loss family's
#: portable implementations, which serve the GPU too, live there and are checked without this.
CPU_ONLY = ("rl_engine.backends.cpu.", *PORTABLE_HOST_PATHS)

#: aten overload packets that wait for the device on a GPU (see the module docstring)
HOST_READS = frozenset({
    "item", "_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select", "equal",
    "is_nonzero", "lift_fresh",
})


def _caller() -> str:
    """``module:function`` of the innermost ``rl_engine`` frame on the stack (``?`` if none)."""
    for frame in reversed(traceback.extract_stack()):
        if "/rl_engine/" in frame.filename:
            module = frame.filename.rsplit("/rl_engine/", 1)[1].removesuffix(".py").replace("/", ".")
            return f"rl_engine.{module}:{frame.name}"
    return "?"


class HostReads(TorchDispatchMode):
    """Records ``found``: the :data:`HOST_READS` operations run inside it, in order, except those
    called from ``host_branches``: code that only host tensors reach, each a ``module:function``
    name (such as the CPU fast path ``rl_engine.utils.portable:exp``) or a package prefix ending
    in ``.`` (``rl_engine.backends.cpu.``: the CPU backends). ``where`` holds the
    ``module:function`` each recorded one was called from.

    A custom operator (``torch.library.custom_op``: rl_engine's ``rlk::`` kernels, forward and
    backward) is run by calling its Python implementation inside the mode, so that the
    operations it runs are recorded too (the dispatcher would run it with the mode off)."""

    def __init__(self, host_branches: Collection[str] = ()) -> None:
        super().__init__()
        self.host_branches = frozenset(host_branches)
        self.found: list[str] = []
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            where = _caller()
            if not any(where == b or (b.endswith(".") and where.startswith(b)) for b in self.host_branches):
                self.found.append(name)
                self.where.append(where)
        opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
        if opdef is not None:
            with self:
                return opdef._init_fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

