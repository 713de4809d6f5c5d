"""Every Triton kernel module's ``KERNEL_NAMES`` (launched on its own) and ``DEVICE_FUNCTIONS``
(``@triton.jit`` helpers in its namespace, never launched) are tuples of names that together cover
exactly the JIT functions the module holds — the static half of the GPU profiler-name tests,
checked on the CPU (a one-name list written without its trailing comma is a string)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

triton = pytest.importorskip("triton")

import rl_engine.backends.triton as triton_backends  # noqa: E402


def _jit_names(mod) -> set[str]:
    kinds = [triton.runtime.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        kinds.append(InterpretedFunction)
    except ImportError:
        pass
    return {obj.fn.__name__ for obj in vars(mod).values() if isinstance(obj, tuple(kinds))}


def _kernel_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(triton_backends.__path__, triton_backends.__name__ + ".")]
    return [n for n in names if hasattr(importlib.import_module(n), "KERNEL_NAMES")]


def _check_lists(name: str, kernels, helpers, jit_names: set[str]) -> None:
    for what, names in (("KERNEL_NAMES", kernels), ("DEVICE_FUNCTIONS", helpers)):
        assert isinstance(names, tuple) and all(isinstance(n, str) for n in names), (name, what, names)
    assert all(n.startswith("rlk_") for n in kernels), (name, kernels)
    launchable = {n for n in jit_names if not n.startswith("_")} - set(helpers)
    assert launchable == set(kernels), (name, sorted(launchable), kernels)


def test_interpreter_kernel_lists_are_tuples_covering_the_module():
    modules = _kernel_modules()
    assert len(modules) >= 10, modules
    for name in modules:
        mod = importlib.import_module(name)
        _check_lists(name, mod.KERNEL_NAMES, getattr(mod, "DEVICE_FUNCTIONS", ()), _jit_names(mod))


def test_interpreter_a_one_name_list_without_its_comma_is_caught():
    """Negative control: ``("rlk_attn_gdc_launch")`` is a string, and the check says so."""
    jit = {"rlk_attn_tiles", "rlk_attn_gdc_launch"}
    _check_lists("ok", ("rlk_attn_tiles",), ("rlk_attn_gdc_launch",), jit)
    with pytest.raises(AssertionError, match="DEVICE_FUNCTIONS"):
        _check_lists("bad", ("rlk_attn_tiles",), ("rlk_attn_gdc_launch"), jit)  # noqa: UP034
    with pytest.raises(AssertionError, match="rlk_attn_gdc_launch"):
        _check_lists("unlisted", ("rlk_attn_tiles",), (), jit)
