"""Fixtures of the attention tests (helpers and markers: ``_attention_common``).

* ``tuned(**changes)``: ``attention_tuning(**changes)`` entered for the rest of the test, exited
  (restoring the switches) at teardown;
* ``planted(edits, tag)``: a planted copy of the kernel modules (``planted_kernels``: the negative
  controls' source edits), its ``launch`` module returned, removed at teardown.
"""

from __future__ import annotations

import contextlib

import pytest

from rl_engine.backends.triton.attention.tuning import attention_tuning
from tests.backends.triton.attention._attention_common import planted_kernels


@pytest.fixture
def tuned():
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(attention_tuning(**changes))


@pytest.fixture
def planted():
    with contextlib.ExitStack() as stack:
        yield lambda edits, tag: stack.enter_context(planted_kernels(edits, tag))
