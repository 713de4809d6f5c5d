"""``tools/benchmarking/host_overhead_gpu.py``'s command line on the CPU: a ``--profile`` case that
does not exist is refused by name before any device work (a typo would otherwise cost a whole
device call), and a machine without CUDA gets a clear exit, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "benchmarking" / "host_overhead_gpu.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "", "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--out", "x.json", "--profile", "public", "rms_norm publik"], "--profile: no case 'rms_norm publik'; cases: cublas"),
        (["--out", "x.json", "--profile-calls", "0"], "--profile-calls: expected a positive count, got 0"),
        (["--profile", "public"], "the following arguments are required: --out"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_valid_arguments_without_cuda_exit_cleanly(tmp_path):
    out = tmp_path / "host.json"
    r = run("--out", str(out), "--profile", "decode attn paged_attention_step (per layer)", "kernels")
    assert r.returncode == 1, r.stderr
    assert "host_overhead_gpu: needs a CUDA device" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
