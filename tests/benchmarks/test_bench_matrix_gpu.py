"""The public-API benchmark matrix (``benchmarks/operators/bench_matrix_gpu.py``) on the CPU: the
``--device cpu --tiny`` dry run writes rows of every family with the harness's keys, a target and
a verdict on each point of ours and a bits digest on every row; the axes of the GPU matrix are the
issue's; targets and bits digests judge what they should; bad arguments are refused by name.
Timings are never asserted."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks.common.harness import ROW_KEYS
from benchmarks.operators import bench_matrix_gpu as bench

#: what benchmarks/common/gpu_docs.py needs of a report of record (tests/benchmarks/test_gpu_docs.py)
RECORD_KEYS = ("schema_version", "family", "platform", "title", "command", "commit", "device", "versions",
               "timestamp", "summary", "rows")
HEX16 = re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix") / "m.json"
    code = bench.main(["--device", "cpu", "--tiny", "--repeats", "1", "--warmup", "0", "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def test_tiny_dry_run_writes_every_family_with_keys_targets_and_digests(tiny_report):
    rep = tiny_report
    assert all(k in rep for k in RECORD_KEYS) and rep["family"] == "matrix" and rep["platform"] == "cpu"
    assert rep["meta"]["partial"] is False and rep["meta"]["stopped"] is None
    rows = rep["rows"]
    assert {r["family"] for r in rows} == set(bench.FAMILIES)
    for r in rows:
        missing = (ROW_KEYS | set(bench.MATRIX_KEYS)) - set(r)
        assert not missing, (r["case"], missing)
        assert r["mode"] == "eager" and r["device"]["type"] == "cpu"
        assert r["error"] is None, (r["case"], r["error"])
        assert HEX16.match(r["bits"]), r
        assert r["median"] > 0 and r["samples"] == 1
    ours = [r for r in rows if r["role"] == "ours"]
    points = {(r["family"], r["case"]) for r in rows}
    assert len(ours) == len(points)  # one row of ours per point and mode
    for r in ours:
        assert r["implementation"].startswith("rlk.ops.")
        assert r["served_by"] and all(not s.endswith("(fallback)") for s in r["served_by"])
        if r["target"].startswith("(no target"):
            # forward + backward of the LM head is judged against Liger-Kernel, absent here
            assert r["family"] == "lmhead" and r["config"]["pass"] == "forward_backward" and r["met"] is None
            assert "liger.flce" in r["unavailable"] and r["ratio_vs_baseline"] > 0
            continue
        key = ("gemm_ragged" if r["preset"] == "ragged" else "gemm") if r["family"] == "gemm" else (
            f"lmhead_{r['config']['pass']}" if r["family"] == "lmhead" else r["family"])
        t = bench.TARGETS[key]
        assert (r["target"], r["target_goal"], r["target_limit"], r["metric"]) == (t.text, t.goal, t.limit, t.metric)
        assert isinstance(r["met"], bool) and r["met"] == t.met(r["achieved"])
        assert r["within_limit"] == t.within_limit(r["achieved"])
        want = r["ratio_vs_baseline"] if t.metric == "time_ratio" else r["throughput_ratio"]
        assert r["achieved"] == pytest.approx(want)
    for r in rows:
        if r["role"] == "baseline":
            assert r["target"] == "(baseline)" and r["met"] is None
    # the LM head rows carry peak memory
    assert all(r["peak_memory_bytes"] for r in rows if r["family"] == "lmhead")
    # the summary: one entry per row of ours, in the form the docs page reads
    assert len(rep["summary"]) == len(ours)
    for s in rep["summary"]:
        assert {"case", "metric", "achieved", "target", "met"} <= set(s)
        assert (s["met"] is None) == s["target"].startswith("("), s


def test_a_point_run_again_gives_the_same_bits(tiny_report, tmp_path):
    """The digest is a function of the point (inputs seeded by its case label), not of what ran
    before it: one point alone gives the bits it gave in the full run."""
    out = tmp_path / "one.json"
    case = "tiny Hq=4 Hkv=2 D=32 B=2 ctx=40 paged16"
    assert bench.main(["--device", "cpu", "--tiny", "--repeats", "1", "--warmup", "0", "--families", "decode",
                       "--cases", case, "--out", str(out)]) == 0
    again = {r["implementation"]: r["bits"] for r in json.loads(out.read_text())["rows"]}
    first = {r["implementation"]: r["bits"] for r in tiny_report["rows"] if r["case"] == case}
    assert again == first and len(first) == 2


def test_bits_digest_sees_every_bit():
    x = torch.tensor([1.0, -0.0, 3.5], dtype=torch.bfloat16)
    same = x.clone()
    assert bench.bits_digest(x) == bench.bits_digest(same) == bench.bits_digest((x[:0], [same]))
    flipped = x.view(torch.int16).clone()
    flipped[2] ^= 1  # one ulp
    assert bench.bits_digest(flipped.view(torch.bfloat16)) != bench.bits_digest(x)
    zero = x.clone()
    zero[1] = 0.0  # -0.0 == 0.0 as values, not as bits
    assert bench.bits_digest(zero) != bench.bits_digest(x)
    assert bench.bits_digest((x, x)) != bench.bits_digest(x)


@pytest.mark.parametrize(
    "target,value,met,within",
    [("gemm", 1.04, True, True), ("gemm", 1.06, False, True), ("gemm", 1.11, False, False),
     ("gemm_ragged", 1.24, True, True), ("gemm_ragged", 1.26, False, False),
     ("attention", 0.91, True, True), ("attention", 0.86, False, True), ("attention", 0.84, False, False),
     ("decode", 0.89, False, False), ("lmhead_forward", 0.79, True, True), ("lmhead_forward", 0.81, False, False)],
)
def test_targets_judge_time_and_throughput(target, value, met, within):
    t = bench.TARGETS[target]
    assert t.met(value) is met and t.within_limit(value) is within


def test_a_faster_lm_head_with_more_memory_than_liger_misses():
    t = bench.TARGETS["lmhead_forward_backward"]
    liger = {"median": 10.0, "peak_memory_bytes": 1000}
    row = {"median": 8.0, "peak_memory_bytes": 1001, "target": t.text}
    bench._judge(row, t, liger, None)
    assert row["achieved"] == pytest.approx(0.8) and row["met"] is False and row["memory_ratio"] == pytest.approx(1.001)
    row = {"median": 8.0, "peak_memory_bytes": 1000, "target": t.text}
    bench._judge(row, t, liger, None)
    assert row["met"] is True
    row = {"median": 8.0, "peak_memory_bytes": 1000, "target": t.text}
    bench._judge(row, t, None, "liger_kernel not importable")
    assert row["met"] is None and row["target"] == "(no target: liger_kernel not importable)"


def _listed(capsys, *args: str) -> list[tuple[str, str]]:
    assert bench.main(["--list", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{len(lines) - 1} points"
    return [tuple(line.split(None, 1)) for line in lines[:-1]]


def test_the_gpu_matrix_has_the_issue_axes(capsys):
    pts = _listed(capsys)
    cases = {f: [c for fam, c in pts if fam == f] for f in bench.FAMILIES}
    gemm = cases["gemm"]
    for preset in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"):
        projs = {c.split(" ")[0][len(preset) + 1:] for c in gemm if c.startswith(preset + ".")}
        # a projection of the same (K, N) as an earlier preset's is timed once, under the first name
        assert projs and projs <= {"qkv", "o_proj", "gate_up", "down"}, preset
    assert {f"M={m}" for m in bench.MS} == {c.rsplit(" ", 1)[1] for c in gemm}
    assert any("K=3000 N=5003" in c for c in gemm) and any("llama-3-8b.lm_head K=4096 N=128256" in c for c in gemm)
    att = cases["attention"]
    ratios = {int(re.search(r"Hq=(\d+)", c)[1]) // int(re.search(r"Hkv=(\d+)", c)[1]) for c in att}
    assert ratios == {1, 2, 4, 5, 8}
    assert {int(re.search(r"D=(\d+)", c)[1]) for c in att} == {64, 128, 256}
    assert any(c.startswith("qwen3-30b-a3b Hq=32 Hkv=4 D=128") for c in att)
    assert {c.split()[-2] for c in att} == set(bench.PREFILL_MIXES) and {c.split()[-1] for c in att} == {
        "forward", "forward_backward"}
    assert any(n % 16 for n in bench.PREFILL_MIXES["ragged6"]) and all(n % 16 for n in bench.PREFILL_MIXES["ragged6"])
    dec = [c for c in cases["decode"] if c.startswith("qwen3-8b ")]
    assert {(re.search(r"B=(\d+)", c)[1], re.search(r"ctx=(\d+)", c)[1], c.split()[-1]) for c in dec} == {
        (str(b), str(x), lay) for b in (1, 8, 32, 128) for x in (1024, 8192, 32768) for lay in ("contiguous", "paged16")}
    lm = cases["lmhead"]
    assert any("V=128256" in c for c in lm) and any("V=151936" in c for c in lm)


def test_quick_and_filters_narrow_the_points(capsys):
    quick = _listed(capsys, "--quick")
    assert {f for f, _ in quick} == set(bench.FAMILIES) and len(quick) < len(_listed(capsys)) / 3
    ragged = _listed(capsys, "--families", "gemm", "--presets", "ragged", "--ms", "5,3000")
    assert ragged and all(c.startswith("ragged.") and c.endswith(("M=5", "M=3000")) for _, c in ragged)
    only = _listed(capsys, "--families", "decode", "--quick", "--cases", "*B=32*paged16")
    assert [c for _, c in only] == ["qwen3-8b Hq=32 Hkv=8 D=128 B=32 ctx=1024 paged16",
                                    "qwen3-8b Hq=32 Hkv=8 D=128 B=32 ctx=32768 paged16"]


def test_max_seconds_stops_cleanly_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert bench.main(["--device", "cpu", "--tiny", "--max-seconds", "0", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["rows"] == [] and rep["meta"]["partial"] is False
    assert rep["meta"]["stopped"]["reason"] == "--max-seconds 0 spent" and rep["meta"]["stopped"]["points_left"] > 0
    assert "stopped: --max-seconds 0 spent" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--families", "gemm,bogus"], "--families: expected a subset of gemm,attention,decode,lmhead"),
        (["--ms", "0"], "--ms: expected positive integers"),
        (["--ms", "1,x"], "--ms: expected comma-separated int values"),
        (["--modes", "graph"], "--modes: graph needs --device cuda"),
        (["--modes", "lazy"], "--modes: expected a subset of graph,eager"),
        (["--repeats", "0"], "--repeats: expected a positive count"),
        (["--max-seconds", "-1"], "--max-seconds: expected seconds >= 0"),
        (["--impl-root", "/nonexistent"], "--impl-root: expected a source tree holding rl_engine/"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "m.json"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_full_shapes_need_a_gpu_and_an_out_file(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--out", str(tmp_path / "m.json")])
    assert "--device cpu: only with --tiny" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--quick"])
    assert "--out: required" in capsys.readouterr().err
    assert bench.main(["--list", "--presets", "qwen3-9b"]) == 2
    assert "--presets: unknown ['qwen3-9b']" in capsys.readouterr().err
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "m.json"
    assert bench.main(["--quick", "--out", str(out)]) == 2 and not out.exists()
    assert "no CUDA device visible" in capsys.readouterr().err


def test_profile_calls_each_candidate_without_timing(tmp_path, capsys, monkeypatch):
    """``--profile`` (for ncu) calls ours and every baseline of the selected points, writes no
    report and needs no ``--out``."""
    calls = []
    real = bench.profile_points

    def spy(env, points, log):
        calls.extend(p.case for p in points)
        real(env, points, log)

    monkeypatch.setattr(bench, "profile_points", spy)
    assert bench.main(["--profile", "--device", "cpu", "--tiny", "--cases", "tiny.qkv*M=1"]) == 0
    assert calls == ["tiny.qkv K=128 N=256 M=1"]
    assert "gemm: tiny.qkv K=128 N=256 M=1" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
