"""``import rl_engine`` (and touching ``rl_engine.ops`` and its families) is free of side effects.

Checked in a fresh interpreter: no backend module and no triton is imported, nothing is compiled
(no dynamo/inductor import, empty compiler cache directories), no ``torch.library`` op is
registered, and global state is unchanged: torch default dtype, thread counts, the
deterministic-algorithms flags, grad/inference/anomaly modes, matmul precision, every random
state, environment variables, ``sys.path``, warning filters and root logging handlers.

A positive control at the end imports a backend in the same interpreter and requires the
op-registration probe to see its ``rlk::`` ops, so an always-empty probe cannot pass the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    r"""
    import hashlib, importlib, importlib.util, json, logging, os, random, sys, warnings
    import torch

    def rlk_ops():
        return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("rlk::"))

    def state():
        s = {
            "default_dtype": str(torch.get_default_dtype()),
            "num_threads": torch.get_num_threads(),
            "num_interop_threads": torch.get_num_interop_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "grad": torch.is_grad_enabled(),
            "inference_mode": torch.is_inference_mode_enabled(),
            "anomaly": torch.is_anomaly_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark],
            "torch_rng": hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest(),
            "python_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
            "environ": dict(os.environ),
            "sys_path": list(sys.path),
            "warning_filters": [repr(f) for f in warnings.filters],
            "root_log_handlers": len(logging.getLogger().handlers),
            "rlk_ops": rlk_ops(),
        }
        if "numpy" in sys.modules:
            import numpy
            s["numpy_rng"] = hashlib.sha256(repr(numpy.random.get_state()).encode()).hexdigest()
        return s

    before_modules = set(sys.modules)
    before = state()

    import rl_engine
    rl_engine.ops  # lazy attribute: imports rl_engine.ops
    families = []
    for fam in rl_engine.ops.FAMILIES:
        if importlib.util.find_spec(f"rl_engine.ops.{fam}") is not None:
            importlib.import_module(f"rl_engine.ops.{fam}")
            families.append(fam)
    exec(os.environ.get("RLK_PROBE_INJECT", ""))  # negative control only: a deliberate side effect

    after = state()
    new_modules = sorted(set(sys.modules) - before_modules)
    forbidden_prefixes = ("rl_engine.backends", "triton", "torch._dynamo", "torch._inductor", "torch.utils.cpp_extension")
    report = {
        "families": families,
        "state_changes": {k: [before.get(k), after.get(k)] for k in set(before) | set(after) if before.get(k) != after.get(k)},
        "forbidden_modules": [m for m in new_modules if m.startswith(forbidden_prefixes)],
        "rl_engine_modules": [m for m in new_modules if m.startswith("rl_engine")],
        "cache_files": [
            os.path.join(root, f)
            for d in (os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"])
            for root, _, files in os.walk(d)
            for f in files
        ],
    }
    # positive control: the probe does see ops once a backend is imported
    importlib.import_module("rl_engine.backends.cpu.gemm")
    report["ops_after_backend_import"] = rlk_ops()
    print("REPORT " + json.dumps(report))
    """
)


def _run_probe(tmp_path, inject: str = "") -> dict:
    env = dict(os.environ)
    env["RLK_PROBE_INJECT"] = inject
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def test_import_has_no_side_effects(tmp_path):
    report = _run_probe(tmp_path)
    assert "gemm" in report["families"]
    assert report["forbidden_modules"] == [], "importing rl_engine / rl_engine.ops imported backends or compilers"
    assert report["state_changes"] == {}, "importing rl_engine changed global state"
    assert report["cache_files"] == [], "importing rl_engine compiled something"
    assert "rl_engine.ops" in report["rl_engine_modules"]
    # positive control: the same probe sees the ops a backend registers
    assert "rlk::linear_cpu" in report["ops_after_backend_import"]


def test_negative_control_side_effects_are_caught(tmp_path):
    """The same probe, with deliberate side effects injected after the import, must flag each."""
    inject = (
        "torch.set_default_dtype(torch.float64)\n"
        "torch.manual_seed(123)\n"
        "torch.use_deterministic_algorithms(True)\n"
        "os.environ['RLK_LEAKED'] = '1'\n"
        "importlib.import_module('rl_engine.backends.cpu.gemm')\n"
    )
    report = _run_probe(tmp_path, inject)
    changed = report["state_changes"]
    assert {"default_dtype", "torch_rng", "deterministic", "environ", "rlk_ops"} <= set(changed)
    assert "rl_engine.backends.cpu.gemm" in report["forbidden_modules"]
