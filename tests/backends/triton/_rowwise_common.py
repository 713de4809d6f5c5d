"""Shared pieces of the Triton operator test modules (row-wise ops and gemm; not a test module itself).

CPU-side checks of a registration (imports nothing of triton, routes CPU tensors to the CPU
backend, pure eligibility checks), the GPU profiler-name rule (``rlk_`` prefix), evidence files
(``RLK_EVIDENCE_DIR``), CUDA-graph timing for the bounded-performance smoke tests, and the marker of
the Triton-interpreter subset (``interp``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from rl_engine import contracts
from rl_engine.runtime.registry import Request, implementations, make_request, select

__all__ = [
    "run_py",
    "check_registration",
    "check_cpu_routing",
    "check_static_and_fake_gpu",
    "evidence",
    "gpu_kernel_events",
    "defined_kernel_names",
    "check_profiler_names",
    "graph_us",
    "event_us",
    "accuracy",
    "gpu_randn",
    "interp",
    "interpreter_asserts",
    "offline_sm90",
]

#: The Triton-interpreter subset: kernels run by ``TRITON_INTERPRET=1`` on CPU tensors (``make test``
#: runs it in .venv-vllm, which has triton; .venv has none, so there it is skipped).
interp = pytest.mark.skipif(
    not (os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None),
    reason="Triton-interpreter subset: needs triton and TRITON_INTERPRET=1 (make test runs it in .venv-vllm)",
)


#: Compiled ahead of time for sm_90 (no GPU): needs triton with its NVIDIA backend and bundled
#: ``ptxas``, not the interpreter (``make test`` runs these in .venv-vllm without TRITON_INTERPRET).
offline_sm90 = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="not a GPU test: an offline sm_90 compile on the CPU that needs triton with TRITON_INTERPRET unset; "
           "the CI's main environment (.venv) has no triton, so `make test` runs it in .venv-vllm (SM90_TESTS)",
)


def run_py(code: str) -> None:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def _impl(op: str, impl_id: str):
    found = [i for i in implementations(op) if i.impl_id == impl_id]
    assert found, f"{impl_id} is not registered for {op}: {[i.impl_id for i in implementations(op)]}"
    return found[0]


def check_registration(op: str, impl_id: str, module: str, family: str) -> None:
    """Declared for CUDA and (untested) ROCm, fp32+bf16, guarantees ⊇ the contract's."""
    impl = _impl(op, impl_id)
    assert impl.families == ("cuda", "rocm")
    assert impl.untested_families == ("rocm",)
    assert set(impl.dtypes) == {torch.float32, torch.bfloat16}
    assert impl.guarantees >= contracts.load_contract(op).guarantees
    assert impl.module == module
    # listing the implementations registered the backend without importing its kernels
    run_py(
        "import sys\n"
        "from rl_engine.runtime.registry import implementations\n"
        f"assert {impl_id!r} in [i.impl_id for i in implementations({op!r})]\n"
        f"assert {module!r} in sys.modules\n"
        f"assert '{module}.kernels' not in sys.modules\n"
    )


def check_cpu_routing(op: str, impl_id: str, cpu_tensor: torch.Tensor) -> None:
    req = make_request(op, cpu_tensor)
    chosen, _ = select(req)
    assert chosen is not None and chosen.impl_id.startswith("cpu."), chosen
    impl = _impl(op, impl_id)
    assert "platform family 'cpu' not in ['cuda', 'rocm']" in impl.reject_reasons(req)


def check_static_and_fake_gpu(op: str, impl_id: str) -> None:
    impl = _impl(op, impl_id)
    before = set(sys.modules)
    impl.unavailable_reasons()
    assert not any(m == "triton" or m.startswith("triton.") for m in set(sys.modules) - before)
    cpu = make_request(op, torch.randn(1, 1)).platform
    fake = type(cpu)(family="cuda", arch="sm75", device_name="x", torch_version="t", triton_version=None,
                     cuda_version=None, hip_version=None)
    reasons = impl.reject_reasons(Request(op, fake, torch.float16, frozenset({"row"})))
    assert any("dtype torch.float16 not in" in r for r in reasons), reasons
    fake90 = type(cpu)(family="cuda", arch="sm90", device_name="x", torch_version="t", triton_version=None,
                       cuda_version=None, hip_version=None)
    reasons = impl.reject_reasons(Request(op, fake90, torch.bfloat16, frozenset({"row", "tp_size"})))
    assert any("does not guarantee invariances ['tp_size']" in r for r in reasons), reasons


def evidence(name: str, payload: dict) -> None:
    out = os.environ.get("RLK_EVIDENCE_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True)


def defined_kernel_names(kernels_module: str) -> set[str]:
    """Names of the ``@triton.jit`` functions in the module's namespace (compiled, or run by the
    interpreter under ``TRITON_INTERPRET=1``)."""
    import triton

    kinds: tuple[type, ...] = (triton.runtime.JITFunction,)
    try:
        from triton.runtime.interpreter import InterpretedFunction

        kinds += (InterpretedFunction,)
    except ImportError:
        pass
    mod = importlib.import_module(kernels_module)
    return {obj.fn.__name__ for obj in vars(mod).values() if isinstance(obj, kinds)}


def check_kernel_lists(name: str, kernels, helpers, jit_names: set[str]) -> None:
    """``kernels`` (a module's ``KERNEL_NAMES``) and ``helpers`` (its ``DEVICE_FUNCTIONS``) are
    tuples of names; the kernels carry the ``rlk_`` prefix and are exactly the module's public JIT
    functions that are not helpers (``jit_names``: :func:`defined_kernel_names`)."""
    for what, names in (("KERNEL_NAMES", kernels), ("DEVICE_FUNCTIONS", helpers)):
        assert isinstance(names, tuple) and all(isinstance(n, str) for n in names), (name, what, names)
    assert all(n.startswith("rlk_") for n in kernels), (name, kernels)
    launchable = {n for n in jit_names if not n.startswith("_")} - set(helpers)
    assert launchable == set(kernels), (name, sorted(launchable), kernels)


def gpu_kernel_events(call) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from tests.helpers.op_layer import gpu_kernel_names

    call()  # compile outside the profiled region
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return gpu_kernel_names(prof)


def check_profiler_names(kernels_module: str | tuple[str, ...], call, must_see: set[str], tag: str) -> None:
    """Every JIT kernel the module (or each of the modules) defines and launches is named ``rlk_*``
    and listed in its ``KERNEL_NAMES``; profiling ``call`` (forward + backward of the public op)
    shows ``must_see`` and no kernel of ours without the prefix."""
    defined: set[str] = set()
    for name in (kernels_module,) if isinstance(kernels_module, str) else kernels_module:
        mod = importlib.import_module(name)
        names = defined_kernel_names(name)
        check_kernel_lists(name, mod.KERNEL_NAMES, getattr(mod, "DEVICE_FUNCTIONS", ()), names)
        defined |= names
    names = gpu_kernel_events(call)
    assert names, "profiler recorded no GPU events"
    ours = sorted(n for n in names if n in defined or n.startswith("rlk") or any(n.startswith(d) for d in defined))
    evidence(f"profiler_{tag}", {"all_gpu_events": names, "ours": ours})
    assert all(n.startswith("rlk_") for n in ours), ours
    missing = {m for m in must_see if not any(n.startswith(m) for n in ours)}
    assert not missing, f"expected kernels not seen: {missing}; GPU events: {names}"


def graph_us(fn, calls: int = 10, reps: int = 7) -> float:
    """Per-call device time (µs) of ``fn`` replayed from a CUDA graph (median of ``reps``)."""
    from benchmarks.common.harness import cuda_graph_ms

    return statistics.median(cuda_graph_ms(fn, calls=calls, repeats=reps)) * 1e3


def event_us(fn, calls: int = 5, reps: int = 5) -> float:
    """Per-call time (µs) of ``fn`` launched eagerly (for calls that synchronise with the host)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / calls)
    return sorted(ts)[len(ts) // 2]


def accuracy(op: str, dtype: torch.dtype, quantity: str, got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    tol = contracts.tolerance(op, dtype, quantity)
    got = got.detach().cpu()
    assert tol.check(got, want), f"{op} {name or quantity} {dtype}: max violation {tol.max_violation(got, want):.3e}"


def gpu_randn(shape, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Standard normal data generated on the GPU (large tensors: no host generation or copy)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)


@contextlib.contextmanager
def interpreter_asserts():
    """Run ``tl.device_assert`` in the Triton interpreter, as a kernel compiled with
    ``debug=True`` does on a GPU (the interpreter's options leave asserts off; a failing one
    raises there instead of stopping the device)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    saved = builder.options
    builder.options = dataclasses.replace(saved, debug=True)
    try:
        yield
    finally:
        builder.options = saved

