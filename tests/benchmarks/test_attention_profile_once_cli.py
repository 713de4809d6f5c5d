"""``tools/benchmarking/attention_profile_once.py``'s command line on the CPU: bad shapes and a
``--paged`` or ``--decode-kernel`` without ``--decode`` are refused by name, and a machine without CUDA gets a clear
exit, not a traceback (the tool runs under ``ncu`` on the device)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "benchmarking" / "attention_profile_once.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--paged"], "--paged needs --decode BxCTX"),
        (["--decode-kernel", "wgt"], "--decode-kernel needs --decode BxCTX"),
        (["--decode", "1x4096", "--decode-kernel", "bad"], "invalid choice: 'bad'"),
        (["--decode", "64x"], "--shape BxS (--decode BxCTX) and --heads HQxHKV with positive integers"),
        (["--decode", "0x4096"], "--shape and --heads: positive sizes"),
        (["--shape", "4x4096", "--heads", "32x7"], "query heads a multiple of kv heads"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


@pytest.mark.parametrize("args", [["--decode", "1x4096", "--paged"], ["--shape", "4x4096", "--impl", "sdpa"],
                                  ["--decode", "1x4096", "--paged", "--decode-kernel", "wgt"]])
def test_valid_arguments_without_cuda_exit_cleanly(args):
    r = run(*args)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
