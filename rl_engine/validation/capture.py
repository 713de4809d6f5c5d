"""Stage capture: records what a model hands to its stage hook at each stage of its forward.

Models call the stage hook of :mod:`rl_engine.models.hooks` at every stage (embedding, each
layer's norms, attention and MLP outputs, the final norm); with no hook set that costs one
context-variable read per forward. ``with capture() as cap:`` sets the hook to ``cap``, so every
call inside the block is recorded, in execution order, as a :class:`Record` (a detached copy of
the tensor plus the caller's row keys).

Row keys say which logical token each row of a captured tensor is: the driver of a forward
(the debugger, an engine integration) calls :meth:`Capture.set_rows` with one
``(sample_id, position)`` per row before it runs the model; rows whose key is ``None`` (pads)
are dropped when a sample is assembled. ``retain_grad=True`` keeps the *live* embedding-output
tensor (with ``retain_grad()``) so per-token input gradients can be read after ``backward()``.

Blocks nest; the innermost one records.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from rl_engine.models.hooks import stage_hook, use_stage_hook

__all__ = ["STAGES", "LAYER_STAGES", "ROUTING_STAGES", "Record", "Capture", "capture", "tap", "active"]

#: Stage names in execution order within one layer (``layer = -1`` for the model-level ones).
LAYER_STAGES: tuple[str, ...] = ("input_norm", "attention", "attn_proj", "post_attention_norm", "mlp", "residual")
#: Stages of a sparse mixture-of-experts layer, between ``post_attention_norm`` and ``mlp``: the
#: router logits, the expert ids each token chose (``[T, K]`` int64) and their mixing weights.
ROUTING_STAGES: tuple[str, ...] = ("router_logits", "routing", "routing_weights")
STAGES: tuple[str, ...] = ("embedding", *LAYER_STAGES, *ROUTING_STAGES, "final_norm", "logits", "logprob")

_ACTIVE: ContextVar["Capture | None"] = ContextVar("rl_engine_capture", default=None)


@dataclass
class Record:
    """One captured stage of one forward call."""

    layer: int
    stage: str
    value: torch.Tensor  # detached copy, rows first
    rows: tuple | None  # row keys of the call (None: unknown)
    call: int  # index of the forward call (set_rows increments it)


@dataclass
class Capture:
    """Everything recorded inside one :func:`capture` block."""

    retain_grad: bool = False
    records: list[Record] = field(default_factory=list)
    live: list[tuple[tuple | None, torch.Tensor]] = field(default_factory=list)
    _rows: tuple | None = None
    _call: int = -1

    def set_rows(self, keys: Sequence | None) -> None:
        """Row keys (``(sample_id, position)`` or ``None`` for a pad) of the next forward call."""
        self._rows = tuple(keys) if keys is not None else None
        self._call += 1

    def __call__(self, layer: int, stage: str, t: torch.Tensor) -> torch.Tensor:
        if self.retain_grad and stage == "embedding" and t.requires_grad:
            t.retain_grad()
            self.live.append((self._rows, t))
        self.records.append(Record(layer, stage, t.detach().clone(), self._rows, self._call))
        return t

    def sample_stages(self, sample_id: int) -> dict[tuple[int, str], dict[int, torch.Tensor]]:
        """``{(layer, stage): {position: row}}`` of one sample over every recorded call.

        A position recorded twice (e.g. a token recomputed) keeps its first value.
        """
        out: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for r in self.records:
            if r.rows is None:
                continue
            slot = out.setdefault((r.layer, r.stage), {})
            for i, key in enumerate(r.rows):
                if key is not None and key[0] == sample_id and key[1] not in slot:
                    slot[key[1]] = r.value[i]
        return {k: v for k, v in out.items() if v}


def active() -> Capture | None:
    """The innermost active capture, or ``None``."""
    return _ACTIVE.get()


def tap(layer: int, stage: str, t: torch.Tensor) -> torch.Tensor:
    """Record ``t`` as ``(layer, stage)`` when a capture is active; returns ``t`` (or the live
    tensor the capture keeps)."""
    hook = stage_hook()
    return t if hook is None else hook(layer, stage, t)


@contextmanager
def capture(*, retain_grad: bool = False) -> Iterator[Capture]:
    """Record every stage the model taps inside the block (see module docstring)."""
    cap = Capture(retain_grad=retain_grad)
    token = _ACTIVE.set(cap)
    try:
        with use_stage_hook(cap):
            yield cap
    finally:
        _ACTIVE.reset(token)
