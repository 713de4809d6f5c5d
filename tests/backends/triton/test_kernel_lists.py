"""Every Triton kernel module's ``KERNEL_NAMES`` (launched on its own) and ``DEVICE_FUNCTIONS``
(``@triton.jit`` helpers in its namespace, never launched) are tuples of names that together cover
exactly the JIT functions the module holds — the static half of the GPU profiler-name tests
(:func:`check_kernel_lists`, shared with them), checked on the CPU (a one-name list written
without its trailing comma is a string)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

triton = pytest.importorskip("triton")

import rl_engine.backends.triton as triton_backends  # noqa: E402
from tests.backends.triton._rowwise_common import check_kernel_lists, defined_kernel_names  # noqa: E402


def _kernel_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(triton_backends.__path__, triton_backends.__name__ + ".")]
    return [n for n in names if hasattr(importlib.import_module(n), "KERNEL_NAMES")]


def test_interpreter_kernel_lists_are_tuples_covering_the_module():
    modules = _kernel_modules()
    assert len(modules) >= 10, modules
    for name in modules:
        mod = importlib.import_module(name)
        check_kernel_lists(name, mod.KERNEL_NAMES, getattr(mod, "DEVICE_FUNCTIONS", ()), defined_kernel_names(name))


def test_interpreter_a_one_name_list_without_its_comma_is_caught():
    """Negative control: ``("rlk_attn_gdc_launch")`` is a string, and the check says so."""
    jit = {"rlk_attn_tiles", "rlk_attn_gdc_launch"}
    check_kernel_lists("ok", ("rlk_attn_tiles",), ("rlk_attn_gdc_launch",), jit)
    with pytest.raises(AssertionError, match="DEVICE_FUNCTIONS"):
        check_kernel_lists("bad", ("rlk_attn_tiles",), ("rlk_attn_gdc_launch"), jit)  # noqa: UP034
    with pytest.raises(AssertionError, match="rlk_attn_gdc_launch"):
        check_kernel_lists("unlisted", ("rlk_attn_tiles",), (), jit)
