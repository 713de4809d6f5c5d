"""``rlk validate ws2``: every TP × DP layout of the model against one process, with its negative controls.

One run (module fixture, 4 gloo ranks) of ``--tp 1,2 --dp 1,2`` on a four-sample copy of the
ws2-tiny workload, with ``--json --out``: every layout raw-bit equal in log-probs (against the
reference and the rollout), in every stage of every layer and in every gradient; the native
row-parallel K-shard all-reduce and the native DP all-reduce are detected (the first divergence
of the row-parallel control is layer 0's ``attn_proj``); the run directory verifies. TP = 4 is
covered at the block level by test_tp_dp_gloo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_engine.entrypoints.cli import app
from rl_engine.validation.reports import verify_run
from rl_engine.validation.ws2 import layouts_for, parse_sizes
from rl_engine.workloads import shipped_workloads
from tests.helpers.threads import threads

runner = CliRunner()


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    d = tmp_path_factory.mktemp("ws2")
    w = json.loads(shipped_workloads()["ws2-tiny.v1.json"])
    w["name"], w["samples"] = "ws2-small", w["samples"][:4]
    wl = d / "ws2-small.v1.json"
    wl.write_text(json.dumps(w))
    with threads(1):
        res = runner.invoke(app, ["validate", "ws2", "--tp", "1,2", "--dp", "1,2", "--workload", str(wl), "--json",
                                  "--out", str(d / "runs")])
    assert res.exit_code == 0, res.output[-4000:]
    return json.loads(res.stdout)


def test_every_layout_is_bitwise_equal_to_one_process(ws2):
    r = ws2["result"]
    assert ws2["suite"] == "ws2" and ws2["passed"] and r["world"] == 4
    assert [x["layout"] for x in r["layouts"]] == ["tp1-dp1", "tp1-dp2", "tp2-dp1", "tp2-dp2", "tp2-dp1 (auto)"]
    assert r["reference_vs_rollout"]["compared"] > 0 and r["reference_vs_rollout"]["mismatched"] == 0
    for x in r["layouts"]:
        assert x["passed"] and x["first_divergence"] is None, x["layout"]
        assert x["logprobs"]["compared"] == r["reference_vs_rollout"]["compared"] and x["logprobs"]["mismatched"] == 0
        assert x["logprobs_vs_rollout"]["mismatched"] == 0
        stages = {(s["layer"], s["stage"]) for s in x["stages"]}
        assert (-1, "embedding") in stages and (1, "attention") in stages and (-1, "final_norm") in stages
        assert all(s["equal"] for s in x["stages"])
        assert x["gradients"]["parameters"] == 18 and x["gradients"]["mismatched"] == []


def test_negative_controls_are_detected(ws2):
    c = {x["name"]: x for x in ws2["result"]["negative_controls"]}
    tp = c["native row-parallel K-shard all-reduce (TP=2)"]
    assert tp["detected"] and tp["first_divergence"]["layer"] == 0 and tp["first_divergence"]["stage"] == "attn_proj"
    assert c["native DP gradient all-reduce (DP=2)"]["detected"]


def test_run_directory_is_sealed(ws2):
    rep = verify_run(Path(ws2["run_dir"]))
    assert rep["options"]["tp"] == [1, 2] and rep["options"]["dp"] == [1, 2]
    summary = (Path(ws2["run_dir"]) / "summary.md").read_text()
    assert "tp2-dp2" in summary and "native row-parallel" in summary


def test_auto_row_scheme_per_shape():
    import torch

    from rl_engine.distributed.tensor_parallel import choose_row_scheme

    assert choose_row_scheme(3072, 1024, torch.bfloat16, "cpu") == "exact_k"
    assert choose_row_scheme(2048, 1024, torch.bfloat16, "cpu") == "full_k"
    assert choose_row_scheme(2048, 1024, torch.float32, "cpu") == "exact_k"
    assert choose_row_scheme(12288, 4096, torch.bfloat16, "cuda") == "full_k"


def test_sizes_and_layouts():
    assert parse_sizes("4,1,2,2", "--tp") == (1, 2, 4)
    for bad in ("3", "0", "16", "a"):
        with pytest.raises(ValueError, match="--tp"):
            parse_sizes(bad, "--tp")
    assert [(x["tp"], x["dp"], x["row_scheme"]) for x in layouts_for((1, 4), (1,))] == [
        (1, 1, "full_k"), (4, 1, "full_k"), (4, 1, "auto")]


@pytest.mark.parametrize("args, hint", [
    (["validate", "ws1", "--tp", "2"], "--tp"),
    (["validate", "ws2", "--tp", "3"], "--tp"),
    (["validate", "ws2", "--inject", "gemm"], "--inject"),
    (["validate", "ws2", "--dp", ""], "--dp"),
    (["validate", "ws2", "--tp", "8", "--dp", "2"], "16 ranks"),
])
def test_usage_errors(args, hint):
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and hint in res.output

