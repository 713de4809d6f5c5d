"""The eager fast path past the ``torch.library`` custom-op layer, shared by every backend.

Each backend operator is a ``torch.library`` custom op: that is what gives it a fake
implementation, an autograd formula and one opaque node under ``torch.compile``. A plain eager
call that needs none of that still pays the layer's host time — the dispatcher boxes the
arguments and calls back into Python: 8.5 µs a call on the 2-core CPU machine
(``bench_call_overhead.py --neutral``, ``dispatch.custom_op`` rows), ≈ 28 µs on the H200 host.
An eager decode step makes some 400 such calls.

:func:`direct_call_ok` names the calls where the layer adds nothing, :func:`call_op` runs the op's
Python body directly for those and the op for every other, and :func:`eager_entry` wraps an op
for the registry (:func:`rl_engine.runtime.registry.register` applies it to every custom op
registered as is). The body is the function the op wraps, so both paths run the same
operations on the same arguments: the same bits. Under ``torch.autocast`` both see the same
casts (the op's ``Autocast`` keys fall through to its body). Under a profiler the direct call
is a range named as the op, so a trace shows ``rlk::<op>`` with the same children either way.

The decision reads torch's dispatcher state through private ``torch._C`` functions (the dispatch
mode stack, the function-mode flag, the functorch interpreter stack, the profiler flag) and the
op's ``_init_fn``; ``tests/runtime/test_custom_ops.py`` exercises each case, so a torch release
that changes one of them fails there, not silently.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

__all__ = ["direct_call_ok", "call_op", "eager_entry", "is_custom_op", "op_range"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_custom_op(fn: Any) -> bool:
    """Whether ``fn`` is a ``torch.library.custom_op`` object (it wraps a Python body and takes a
    fake implementation)."""
    return hasattr(fn, "_init_fn") and hasattr(fn, "register_fake")


def direct_call_ok(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bool:
    """True when calling a custom op's Python body with ``args``/``kwargs`` is indistinguishable
    from calling the op: not under ``torch.compile`` tracing, no ``TorchDispatchMode`` /
    ``TorchFunctionMode`` active (fake-tensor, proxy and functionalisation modes, profilers of
    dispatch, rl_engine's own host-read recorder), no ``torch.func`` transform active (``vmap``,
    ``grad``: their wrapped tensors look plain), every tensor argument a plain ``Tensor`` or
    ``Parameter`` (no fake, functional or subclass tensor such as ``DTensor``), and no gradient
    to record (grad mode off, or no argument requires one). Tensors inside lists count too."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN_TENSORS or (grad and a.requires_grad):
                return False
        elif isinstance(a, (list, tuple)) and not _plain_sequence(a, grad):
            return False
    return True


def _plain_sequence(seq: list | tuple, grad: bool) -> bool:
    for a in seq:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS or (grad and a.requires_grad)):
            return False
    return True


def call_op(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` for a ``torch.library.custom_op`` ``op``, skipping the custom-op
    layer when :func:`direct_call_ok` says it adds nothing (the same operations run either way).
    Under a profiler the direct call is a ``record_function`` range named as the op
    (``rlk::linear_cpu``, :func:`op_range`), so traces keep naming the operator that ran."""
    if not direct_call_ok(args, kwargs):
        return op(*args, **kwargs)
    if torch._C._autograd._profiler_enabled():
        with op_range(op):
            return op._init_fn(*args, **kwargs)
    return op._init_fn(*args, **kwargs)


def eager_entry(op: Any) -> Callable[..., Any]:
    """The registry entry for a custom op registered as is: :func:`call_op` bound to ``op``.
    ``_init_fn`` stays visible, so dispatch order and provenance see the implementing module,
    and ``op`` is kept as ``custom_op`` for callers that need the op itself."""

    def entry(*args: Any, **kwargs: Any) -> Any:
        return call_op(op, *args, **kwargs)

    body = op._init_fn
    entry._init_fn = body  # type: ignore[attr-defined]
    entry.custom_op = op  # type: ignore[attr-defined]
    entry.__name__ = entry.__qualname__ = getattr(body, "__name__", "entry")
    entry.__doc__ = body.__doc__
    return entry


def op_range(op: Any) -> contextlib.AbstractContextManager:
    """Under a profiler, a ``record_function`` range named as custom op ``op`` (``rlk::<name>``)
    for work that runs in its place; otherwise a no-op context (one flag read)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(getattr(op, "_qualname", getattr(op, "__name__", "rlk")))
    return contextlib.nullcontext()
