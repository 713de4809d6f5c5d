"""The ``threads`` and ``isa`` invariances of the CPU backend, on raw bits, with negative controls.

Every public op, forward and backward, fp32 and bf16 (:mod:`tests.helpers.cpu_bits_cases`) runs
in a subprocess at 1, 2, 3 and 4 intra-op threads and under each instruction-set switch that the
libraries this torch build calls honour:

* ``ATEN_CPU_CAPABILITY`` — ATen's own vectorised kernels (``default`` = scalar, ``avx2``);
* ``ONEDNN_MAX_CPU_ISA`` — oneDNN, which runs bf16 matmuls (AVX2 instead of AMX / AVX-512 BF16);
* ``MKL_ENABLE_INSTRUCTIONS`` and ``MKL_CBWR`` — MKL's fp32 GEMM and its vector math
  (``exp``/``log``), as on a CPU without AVX-512 (AMD machines take such paths too).

rl-kernel's digests must be equal across all of them; under each switch at least one of its
native torch controls computed on the same inputs (``F.linear``, ``bmm``, ``log_softmax``
backward, ``exp``, a parallel ``sum``...) must differ — the proof that the switch really changes
the path the libraries take on this machine. MKL picks its code paths by CPU vendor: on an AMD
host it already runs the paths ``MKL_ENABLE_INSTRUCTIONS=AVX2`` selects, so there that case
asserts that the switch moves no native case at all (the same paths, so nothing to prove beyond
the unchanged rl-kernel digests); on an Intel host it must move its controls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: name -> environment additions; "base" is the machine's own choice (the widest ISA).
SETTINGS = {
    "base": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
}
#: the native controls of each switch, at least one of which must move (measured on an Intel Xeon, where
#: each moves all of its own but the parallel sum; on an AMD EPYC the thread count moves only the sum,
#: MKL_CBWR only the GEMMs, and MKL_ENABLE_INSTRUCTIONS nothing)
CONTROLS = {
    "threads": ("native/F.linear/fp32", "native/F.linear/bf16", "native/sum/fp32"),
    "aten-default": ("native/log_softmax/fp32",),
    "aten-avx2": ("native/log_softmax/fp32",),
    "onednn-avx2": ("native/F.linear/bf16", "native/bmm/bf16"),
    "mkl-avx2": ("native/F.linear/fp32", "native/exp/fp32", "native/log/fp32"),
    "mkl-cbwr-compatible": ("native/F.linear/fp32", "native/bmm/fp32", "native/exp/fp32"),
}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                           "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")}
    env.update(extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@lru_cache(maxsize=None)
def digests(setting: str, threads: str = "1") -> dict[str, dict[str, str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.cpu_bits_cases", "--threads", threads],
        cwd=ROOT, env=_env(SETTINGS[setting]), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _split(table: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    ours = {k: v for k, v in table.items() if not k.startswith("native/")}
    native = {k: v for k, v in table.items() if k.startswith("native/")}
    return ours, native


def test_bits_do_not_depend_on_the_thread_count():
    runs = digests("base", "1,2,3,4")
    base_ours, base_native = _split(runs["1"])
    assert len(base_ours) >= 25, sorted(base_ours)
    for n in ("2", "3", "4"):
        ours, _ = _split(runs[n])
        differ = sorted(k for k in base_ours if ours[k] != base_ours[k])
        assert differ == [], f"{n} threads vs 1: {differ}"
    moved = {k for n in ("2", "3", "4") for k in base_native if runs[n][k] != base_native[k]}
    assert set(CONTROLS["threads"]) & moved, f"negative control: native cases that moved with threads: {sorted(moved)}"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "base"])
def test_bits_do_not_depend_on_the_instruction_set(setting):
    base_ours, base_native = _split(digests("base")["1"])
    ours, native = _split(digests(setting)["1"])
    differ = sorted(k for k in base_ours if ours[k] != base_ours[k])
    assert differ == [], f"{setting}: rl-kernel ops whose bits changed: {differ}"
    moved = {k for k in base_native if native[k] != base_native[k]}
    if setting == "mkl-avx2" and _cpu_vendor() != "GenuineIntel":
        # MKL dispatches by vendor: off Intel it already runs the AVX2 paths, so the switch must change
        # nothing at all, native torch included; the invariance above then holds with the same paths
        assert moved == set(), (
            f"{setting} on a {_cpu_vendor()} CPU: expected MKL to ignore it, native cases moved {sorted(moved)}")
        return
    assert set(CONTROLS[setting]) & moved, (
        f"negative control: {setting} should change one of {CONTROLS[setting]} (native torch), changed {sorted(moved)}"
    )


def _cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), or ``unknown``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _check(extra: dict[str, str], *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "rl_engine.entrypoints.cli", "check", "--json", "--num-prompts", "4",
         "--max-new-tokens", "8", *args],
        cwd=ROOT, env=_env(extra), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


_AVX2_MACHINE = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_digest_is_the_same_across_threads_and_instruction_sets(dtype):
    """``rlk check`` with the rollout at 1 thread and training at 2 (and the reverse) passes, and its
    ``bits_digest`` is one value under the machine's ISA, an emulated AVX2 machine and scalar ATen."""
    runs = [
        _check({}, "--dtype", dtype, "--rollout-threads", "1", "--train-threads", "2"),
        _check(_AVX2_MACHINE, "--dtype", dtype, "--rollout-threads", "2", "--train-threads", "1"),
        _check({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}, "--dtype", dtype),
    ]
    for r in runs:
        assert r["passed"] and r["mismatched_tokens"] == 0 and r["compared_tokens"] > 0, r["first_mismatch"]
    assert runs[0]["threads"] == {"rollout": 1, "train": 2}
    assert len({r["bits_digest"] for r in runs}) == 1, [r["bits_digest"] for r in runs]


def test_check_digest_negative_control():
    """Native torch (``--plan P/P``) gives a digest that changes with the instruction set."""
    a = _check({}, "--plan", "P/P", "--dtype", "bfloat16")
    b = _check(_AVX2_MACHINE, "--plan", "P/P", "--dtype", "bfloat16")
    assert not a["passed"] and a["mismatched_tokens"] > 0
    assert a["bits_digest"] != b["bits_digest"]
