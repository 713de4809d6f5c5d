"""DeepSpeed (``deepspeed.initialize``, gloo, CPU accelerator) training a transformers Qwen3 with
rl_engine installed: ZeRO stages 0-3, fp32 and bf16, 1 and 2 processes. At every step the
training forward's log-probs equal the rollout's (``generate`` on the gathered weights) raw-bit,
and ZeRO-3 with 2 processes gives identical losses in two separate launches. The same run
without the install (negative control) mismatches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("ds_worker.py")
ALL = [f"{s}:{d}" for s in range(4) for d in ("float32", "bfloat16")]


def _launch(nproc: int, specs: list[str], out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torch extensions a rank JIT-builds go under this run's temp dir: a lock file left by an
    # interrupted build elsewhere cannot stall the ranks
    extensions = out.parent / "torch_extensions"
    procs = []
    for r in range(nproc):
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OUT=str(out), RLK_REPO=str(REPO), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *specs], env=env, cwd=out,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    specs = ALL + ["3:float32:native", "3:float32:repeat", "3:bfloat16:repeat"]
    first = _launch(2, specs, tmp_path_factory.mktemp("ds2a"))
    second = _launch(2, ["3:float32", "3:bfloat16"], tmp_path_factory.mktemp("ds2b"))
    return first, second


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory):
    return _launch(1, ALL, tmp_path_factory.mktemp("ds1"))


def _assert_bitwise(ranks: list[dict], specs: list[str]) -> None:
    for r, res in enumerate(ranks):
        for spec in specs:
            row = res[spec]
            assert len(row["compared"]) == 3 and all(c > 0 for c in row["compared"]), (r, spec, row)
            assert row["mismatched"] == [0, 0, 0], (r, spec, row)
            assert row["losses"][0] != row["losses"][-1], (r, spec, "the loss should move")


def test_zero_stages_two_processes_raw_bit_equal(two_procs):
    _assert_bitwise(two_procs[0], ALL)


def test_zero_stages_one_process_raw_bit_equal(one_proc):
    _assert_bitwise(one_proc, ALL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero3_two_processes_losses_identical_run_to_run(two_procs, dtype):
    first, second = two_procs
    for r in range(2):
        spec = f"3:{dtype}"
        assert first[r][spec]["losses"] == second[r][spec]["losses"], (r, dtype)  # separate launches
        assert first[r][spec]["losses"] == first[r][f"{spec}:repeat"]["losses"], (r, dtype)  # same process, again


def test_negative_control_without_install_mismatches(two_procs):
    assert sum(sum(res["3:float32:native"]["mismatched"]) for res in two_procs[0]) > 0
