"""The ``rlk`` CLI: ``env``/``ops`` output, exit codes, and the frozen command-line surface."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer.main
from typer.testing import CliRunner

from rl_engine.entrypoints import cli
from rl_engine.entrypoints import ops as ops_cmd
from rl_engine.entrypoints.cli import app, main
from rl_engine.platforms import platform_of
from rl_engine.runtime import register
from tests.runtime.fake_operator import TEST_OP, fake_op, make_impl  # noqa: F401  (fixture)

runner = CliRunner()

# ---- the frozen CLI surface ---------------------------------------------------------------------
# Every command and its options. A flag that appears or vanishes must change this table in the
# same commit (style.md, torchtitan). Adding a command: add its entry here.
CLI_SURFACE = {
    "env": ["--help", "--json"],
    "ops": ["--device", "--help", "--json"],
    "check": [
        "--device", "--dtype", "--engine", "--extra-prompt-tokens", "--help", "--json", "--kv-cache", "--max-new-tokens",
        "--logprobs", "--max-seqs", "--max-step-tokens", "--model", "--num-prompts", "--plan", "--prefill-chunk", "--preset",
        "--rollout-threads", "--seed",
        "--temperature", "--threads", "--top-k", "--top-p", "--tp", "--train-engine", "--train-threads", "--train-tp",
    ],
    "validate": ["--device", "--dp", "--help", "--inject", "--json", "--out", "--plan", "--rollout-threads", "--tp",
                 "--train-threads", "--workload", "<suite>"],
    "debug": ["--device", "--help", "--inject", "--json", "--out", "--plan-a", "--plan-b", "--sample", "--workload"],
    "report": ["--help", "--json", "<run_dir>"],
}
ROOT_OPTIONS = ["--help"]


def _surface() -> tuple[list[str], dict[str, list[str]]]:
    group = typer.main.get_command(app)
    ctx = group.make_context("rlk", [], resilient_parsing=True)

    def opts(cmd, ctx_) -> list[str]:
        names = []
        for p in cmd.get_params(ctx_):
            names += [*p.opts, *p.secondary_opts] if p.param_type_name == "option" else [f"<{p.name}>"]
        return sorted(names)

    return opts(group, ctx), {name: opts(c, ctx) for name, c in group.commands.items()}


def test_cli_surface_is_frozen():
    root, commands = _surface()
    assert root == ROOT_OPTIONS
    assert commands == {k: sorted(v) for k, v in CLI_SURFACE.items()}


def test_console_script_points_at_main():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert 'rlk = "rl_engine.entrypoints.cli:main"' in text


# ---- rlk env --------------------------------------------------------------------------------------


def test_env_json():
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["default_platform"]["family"] in ("cpu", "cuda", "rocm")
    assert report["devices"][0] == platform_of("cpu").as_dict()
    assert report["default_platform"]["torch_version"] == torch.__version__
    for key in ("triton_version", "cuda_version", "hip_version"):
        assert key in report["default_platform"]


def test_env_table():
    result = runner.invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    assert "rl-kernel environment" in result.stdout and platform_of("cpu").key in result.stdout


# ---- rlk ops --------------------------------------------------------------------------------------


def _ops_json(*args: str) -> dict:
    result = runner.invoke(app, ["ops", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ops_json_lists_gemm_linear_with_the_cpu_implementation():
    report = _ops_json("--device", "cpu")
    assert report["schema_version"] == 1
    assert report["platform"] == platform_of("cpu").as_dict()
    by_op = {o["op"]: o for o in report["operators"]}
    linear = by_op["gemm.linear"]
    c = linear["contract"]
    assert set(c) == {"version", "summary", "dtypes", "invariances", "precision_profile", "tolerance_overrides", "variants"}
    assert set(c["variants"]) == {"fp32_out"} and set(c["variants"]["fp32_out"]) == {"summary", "dtypes", "equality"}
    assert {"float32", "bfloat16"} <= set(c["dtypes"])
    assert {"row", "chunk", "run_to_run"} <= set(c["invariances"]["forward"])
    impl = next(i for i in linear["implementations"] if i["impl_id"] == "cpu.exact_sum")
    assert set(impl) == {
        "impl_id", "version", "priority", "families", "dtypes", "guarantees", "untested_families", "variants",
        "available", "unavailable_reasons", "eligible", "rejections",
    }
    assert impl["variants"] == ["fp32_out"]
    assert impl["families"] == ["cpu"] and impl["available"] is True
    assert impl["eligible"]["float32"] is True and impl["eligible"]["bfloat16"] is True
    assert impl["rejections"]["float32"] == [] and impl["rejections"]["bfloat16"] == []
    assert set(impl["eligible"]) == set(c["dtypes"]) == set(linear["selected"])
    assert linear["selected"]["float32"] == linear["selected"]["bfloat16"] == "cpu.exact_sum"


def test_ops_lists_every_shipped_contract():
    from rl_engine import contracts

    report = _ops_json("--device", "cpu")
    shipped = sorted(contracts.all_contracts())
    assert [o["op"] for o in report["operators"]] == [c for c in shipped if not c.startswith("models.")]
    assert [m["id"] for m in report["model_contracts"]] == [c for c in shipped if c.startswith("models.")]
    # the foundation's bar: every operator has an eligible CPU implementation for fp32 and bf16
    for entry in report["operators"]:
        for dtype in ("float32", "bfloat16"):
            assert entry["selected"][dtype], (entry["op"], dtype)
    for entry in report["operators"]:
        for impl in entry["implementations"]:
            assert set(impl["eligible"]) == set(entry["contract"]["dtypes"])
            for dtype, ok in impl["eligible"].items():
                assert ok == (impl["rejections"][dtype] == [])


def test_ops_default_device_is_this_machine():
    report = _ops_json()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert report["platform"]["family"] in ((expected,) if expected == "cpu" else ("cuda", "rocm"))


def test_ops_reports_rejections_of_a_test_operator(fake_op):
    register(make_impl("gpu.only", families=("cuda",)))
    register(make_impl("needs.features", dtypes=(torch.float32,), call_check=lambda req: [] if req.features["K"] else ["K=0"]))
    register(make_impl("fp32.only", dtypes=(torch.float32,), priority=200))
    register(make_impl("fp32.unavailable", dtypes=(torch.float32,), priority=300, static_check=lambda: ["no compiler"]))
    report = _ops_json("--device", "cpu")
    entry = next(o for o in report["operators"] if o["op"] == TEST_OP)
    impls = {i["impl_id"]: i for i in entry["implementations"]}
    assert impls["gpu.only"]["eligible"] == {"float32": False, "bfloat16": False}
    assert impls["gpu.only"]["rejections"]["float32"] == ["platform family 'cpu' not in ['cuda']"]
    # a per-call check that needs features is reported, not a crash
    assert impls["needs.features"]["eligible"]["float32"] is False
    assert "KeyError" in impls["needs.features"]["rejections"]["float32"][0]
    assert impls["fp32.only"]["eligible"] == {"float32": True, "bfloat16": False}
    assert impls["fp32.unavailable"]["available"] is False
    assert impls["fp32.unavailable"]["unavailable_reasons"] == ["no compiler"]
    assert impls["fp32.unavailable"]["rejections"]["float32"] == ["no compiler"]
    # needs.features comes first and cannot decide without call features: nothing is claimed
    assert entry["selected"] == {"float32": None, "bfloat16": None}
    table = runner.invoke(app, ["ops", "--device", "cpu"], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    assert "gpu.only rejected for float32: platform family 'cpu' not in ['cuda']" in table.stdout
    assert "float32 -> undetermined without per-call features" in table.stdout
    assert "bfloat16 -> none (strict policy raises)" in table.stdout


def test_ops_table_output():
    result = runner.invoke(app, ["ops", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "gemm.linear" in result.stdout and "cpu.exact_sum" in result.stdout


def test_ops_load_error_exits_2(monkeypatch):
    from rl_engine import contracts

    def broken():
        raise contracts.ContractError("contract file operators/x.json is not valid JSON")

    monkeypatch.setattr(contracts, "all_contracts", broken)
    result = runner.invoke(app, ["ops", "--json"])
    assert result.exit_code == 2
    assert "not valid JSON" in result.stderr


# ---- exit codes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["ops", "--device", "tpu"],
        ["ops", "--bogus"],
        ["env", "--bogus"],
        ["env", "extra-argument"],
        ["no-such-command"],
        [],
    ],
)
def test_usage_errors_exit_2(argv):
    assert runner.invoke(app, argv).exit_code == 2
    assert main(argv) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message; this machine has a GPU")
def test_ops_cuda_without_gpu_exits_2():
    result = runner.invoke(app, ["ops", "--device", "cuda"])
    assert result.exit_code == 2
    assert "no CUDA/ROCm device is visible" in result.output


def test_main_returns_0_on_success(capsys):
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rl_engine"]
    assert main(["--help"]) == 0


def test_exit_code_constant():
    assert cli.EXIT_USAGE == 2
    assert ops_cmd.SCHEMA_VERSION == 1


def test_installed_console_script():
    """The ``rlk`` users get from ``pip install`` (next to this interpreter) runs and lists gemm."""
    exe = Path(sys.executable).with_name("rlk")
    if not exe.exists():
        exe = Path(shutil.which("rlk") or "")
    assert exe.is_file(), "the rlk console script is not installed next to this interpreter"
    out = subprocess.run([str(exe), "ops", "--json", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    assert "gemm.linear" in [o["op"] for o in json.loads(out.stdout)["operators"]]
    bad = subprocess.run([str(exe), "ops", "--device", "tpu"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2


def test_validate_thread_options_apply_to_chain_only():
    from typer.testing import CliRunner

    from rl_engine.entrypoints.cli import app

    r = CliRunner().invoke(app, ["validate", "ws1", "--rollout-threads", "2"])
    assert r.exit_code == 2 and "chain suite" in r.output
