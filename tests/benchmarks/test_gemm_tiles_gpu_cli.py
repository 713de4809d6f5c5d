"""``tools/benchmarking/gemm_tiles_gpu.py`` on the CPU: the band cut it chooses from measurements
(a configuration serves a band only where it loses to no shape's incumbent; bands hold at least
two shapes; a small gain keeps the table), the rows it writes select as chosen and leave other
M's rows alone, a report rebuilds the table without a GPU, and bad arguments are refused by name
before any device work; a machine without CUDA gets a clear exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "benchmarking" / "gemm_tiles_gpu.py"

SMALL, BIG, INC = "64x64x128_w4_s4_g8_tma", "128x128x64_w4_s4_g8_tma_persistent", "64x128x128_w4_s3_g8_tma"


def _tool():
    return load_script("tools/benchmarking/gemm_tiles_gpu.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                          env={"CUDA_VISIBLE_DEVICES": "", "PATH": "", "PYTHONPATH": str(ROOT)})


def shape(case, n, inc_us, small, big, cublas=10.0):
    return {"case": case, "N": n, "incumbent": INC, "cublas_us": cublas, "us": {INC: inc_us, SMALL: small, BIG: big}}


def measurements():
    """Small N: the small tile wins by far; large N: the incumbent is best, the big tile close."""
    return [shape("a", 1024, 20.0, 11.0, 30.0), shape("b", 1024, 22.0, 12.0, 30.0), shape("c", 2048, 18.0, 12.0, 25.0),
            shape("d", 8192, 11.0, 19.0, 11.5), shape("e", 24576, 11.0, 25.0, 11.1)]


def test_bands_pick_the_winner_per_n_and_keep_the_incumbent_where_nothing_beats_it():
    res = _tool().choose_bands(measurements())
    assert res["changed"] and [(b["max_n"], b["config"]) for b in res["bands"]] == [(2048, SMALL), (None, INC)]
    assert res["bands"][0]["cases"] == ["a", "b", "c"]
    assert res["ratio_sum"] == pytest.approx((11 + 12 + 12 + 11 + 11) / 10)
    assert res["incumbent_ratio_sum"] == pytest.approx((20 + 22 + 18 + 11 + 11) / 10)


def test_a_configuration_that_loses_at_one_shape_of_a_band_does_not_serve_it():
    tool = _tool()
    meas = measurements()[:3]
    meas[2]["us"][SMALL] = 18.5  # c: 2.8 % slower than its incumbent, while a and b gain 45 %
    res = tool.choose_bands(meas, max_bands=1)
    assert not res["changed"] and res["bands"] == [] and "gain" in res["reason"]
    # negative control: a looser tolerance lets the small tile serve the band, c included
    loose = tool.choose_bands(meas, max_bands=1, tolerance=0.05)
    assert [(b["max_n"], b["config"], b["cases"]) for b in loose["bands"]] == [(None, SMALL, ["a", "b", "c"])]


def test_no_band_is_a_rule_of_one_shape_and_rejected_candidates_never_serve():
    tool = _tool()
    meas = measurements()[:1] + measurements()[2:]  # a, c, d, e: N 1024 and 2048 hold one shape each
    meas[1]["us"][SMALL] = 19.0  # c: the small tile loses, so only a gains from it
    res = tool.choose_bands(meas)
    assert not res["changed"] and res["bands"] == []
    # the control: without the two-shape floor, a alone becomes a band of the small tile
    one = tool.choose_bands(meas, min_shapes=1)
    assert [(b["cases"], b["config"]) for b in one["bands"]] == [(["a"], SMALL), (["c", "d", "e"], INC)]
    rej = measurements()
    for r in rej[:3]:
        r["us"][SMALL] = None  # bits differed: rejected
    res = tool.choose_bands(rej)
    assert SMALL not in [b["config"] for b in res["bands"]]


def test_a_small_gain_keeps_the_rows():
    tool = _tool()
    meas = [shape("a", 1024, 10.0, 9.95, 12.0), shape("b", 2048, 10.0, 9.95, 12.0)]
    res = tool.choose_bands(meas)
    assert not res["changed"] and res["bands"] == [] and "gain" in res["reason"]
    assert tool.choose_bands(meas, min_gain=0.0)["changed"]  # the control: any gain ships without the floor
    with pytest.raises(ValueError, match="at least one shape"):
        tool.choose_bands([])


def test_written_rows_select_as_chosen_and_leave_other_m_alone(tmp_path):
    from rl_engine.backends.triton.gemm import configs

    tool = _tool()
    base = json.loads(configs.table_path("sm90").read_text())
    res = tool.choose_bands(measurements())
    for m in (256, 512):  # 256 replaces a bucket's rows; 512 adds a bucket under the next one's
        tab = tool.apply_bands(base, m, res["bands"], "test")
        path = tmp_path / f"t{m}.json"
        path.write_text(json.dumps(tab))
        fwd, _ = configs.load_table(path)
        old, _ = configs.load_table(configs.table_path("sm90"))
        for dt in (torch.bfloat16, torch.float16):

            def sel(rows, mm, n):
                return next(c for mx, nx, c in rows if (mx is None or mm <= mx) and (nx is None or n <= nx))

            assert sel(fwd[dt], m, 1024).key == SMALL and sel(fwd[dt], m, 2048).key == SMALL
            assert sel(fwd[dt], m, 4096).key == INC and sel(fwd[dt], m, 151936).key == INC
            for mm in (1, 16, 64, 4096, 16384):  # other buckets: unchanged
                for n in (1024, 4096, 151936):
                    assert sel(fwd[dt], mm, n) == sel(old[dt], mm, n)
            if m == 512:
                assert sel(fwd[dt], 1024, 1024) == sel(old[dt], 1024, 1024)
                assert sel(fwd[dt], 256, 1024) == sel(old[dt], 256, 1024)
        assert fwd[torch.float32] == old[torch.float32]
    with pytest.raises(ValueError, match="unbounded"):
        tool.apply_bands(base, 256, res["bands"][:1], "test")


def test_rebuild_writes_the_table_of_an_earlier_report_without_a_gpu(tmp_path):
    from rl_engine.backends.triton.gemm import configs

    base = json.loads(configs.table_path("sm90").read_text())
    report = tmp_path / "gemm_tiles.json"
    report.write_text(json.dumps({"arch": "sm90", "device": {"name": "GPU X"}, "base_table": base,
                                  "source": {"command": "c", "commit": "old"}, "measurements": {"256": measurements()}}))
    table = tmp_path / "sm90.json"
    r = run("--rebuild", str(report), "--table", str(table), "--commit", "abc1234", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    tab = json.loads(table.read_text())
    rows = [row for row in tab["forward"] if row["dtype"] == "bfloat16" and row["max_m"] == 256]
    assert [(row["max_n"], configs.TileConfig(**row["config"]).key) for row in rows] == [(2048, SMALL), (None, INC)]
    assert "abc1234" in rows[0]["note"] and "GPU X" in tab["source"]["mid_m_tiles"]


def test_tile_config_keys_round_trip_and_candidates_are_distinct():
    from rl_engine.backends.triton.gemm.configs import TileConfig, shipped_configs

    tool = _tool()
    for cfg in [*tool.candidates(256), *tool.candidates(1024), *shipped_configs(torch.bfloat16)]:
        assert TileConfig.from_key(cfg.key) == cfg
    for m in (256, 1024):
        assert len(set(tool.candidates(m))) == len(tool.candidates(m))
    with pytest.raises(ValueError, match="key: expected"):
        TileConfig.from_key("64x64x64_w4")


@pytest.mark.parametrize("args, message", [
    (["--out", "o.json", "--commit", "x", "--ms", "0"], "--ms"),
    (["--out", "o.json", "--commit", "x", "--ms", "a"], "--ms"),
    (["--out", "o.json", "--ms", "256"], "--commit"),
    (["--commit", "x", "--ms", "256"], "--out"),
    (["--out", "o.json", "--commit", "x", "--max-bands", "0"], "--max-bands"),
    (["--out", "o.json", "--commit", "x", "--tolerance", "-1"], "--tolerance"),
    (["--out", "o.json", "--commit", "x", "--compile-workers", "-1"], "--compile-workers"),
    (["--out", "o.json", "--commit", "x", "--ms", "256", "--presets", "nope"], "no matrix GEMM shape"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    r = run(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_without_cuda_the_tool_says_so():
    r = run("--out", "o.json", "--commit", "x", "--ms", "256", "--presets", "qwen3-0.6b")
    assert r.returncode == 1 and "needs a CUDA device" in r.stderr


def test_precompile_rows_keep_the_specialisation_of_m():
    """Precompile launches use 256 rows for a multiple of 16 above 256 (Triton specialises an int on
    == 1 and % 16 only, so the same kernel compiles); 1, 16, 64, 256 and a row count that is not a
    multiple of 16 stay as they are (the control: those specialise differently)."""
    tool = _tool()
    assert [tool.compile_rows(m) for m in (1, 16, 64, 256, 1024, 4096, 16384)] == [1, 16, 64, 256, 256, 256, 256]
    assert tool.compile_rows(1000) == 1000 and tool.compile_rows(300) == 300
    assert all(tool.compile_rows(m) % 16 == 0 for m in (1024, 4096, 16384))
