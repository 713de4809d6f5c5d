"""The GPU attention benchmark's command line, on the CPU: bad shapes and kinds are refused by
name before any GPU work, and a machine without CUDA gets a clear exit, not a traceback."""

from __future__ import annotations

import pytest

from benchmarks.operators import bench_attention_gpu as bench


@pytest.mark.parametrize(
    "args,message",
    [
        (["--decode-batch", "0"], "--decode-batch: expected positive integers"),
        (["--decode-batch", "1,x"], "--decode-batch: expected positive integers"),
        (["--decode-ctx", "100"], "--decode-ctx: expected positive integers (multiples of 16)"),
        (["--decode-ctx", ""], "--decode-ctx: expected positive integers"),
        (["--kinds", "decode,bogus"], "--kinds: expected a subset of prefill,decode,train"),
        (["--unroll", "3"], "--unroll: expected values among 1,2,4"),
        (["--unroll", "0"], "--unroll: expected positive integers"),
        (["--rows", ""], "--rows: expected comma-separated non-empty patterns"),
        (["--rows", "*.paged16,,x"], "--rows: expected comma-separated non-empty patterns"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "a.json"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_valid_arguments_without_cuda_exit_cleanly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "a.json"
    code = bench.main(["--out", str(out), "--kinds", "decode", "--decode-batch", "1,2", "--decode-ctx", "512,4096"])
    assert code == 2 and not out.exists()
    assert "no CUDA device visible" in capsys.readouterr().err


def test_rows_keep_the_baseline_and_the_matching_implementations():
    """``--rows`` patterns (``select_rows``): SDPA always stays (every ratio's baseline), a
    pattern keeps exactly its matches, no pattern keeps everything; a pattern matching nothing
    keeps only the baseline (negative control: the filter does drop rows)."""
    ours = bench.OURS
    names = ["torch.sdpa", ours, f"{ours}.paged16", f"{ours}.two_launch", f"{ours}.paged16.no_quad", f"{ours}@v4"]
    assert bench.select_rows(names, ()) == names
    assert bench.select_rows(names, (ours, "*.paged16")) == ["torch.sdpa", ours, f"{ours}.paged16"]
    assert bench.select_rows(names, ("*@v*", "*.no_quad")) == ["torch.sdpa", f"{ours}.paged16.no_quad", f"{ours}@v4"]
    assert bench.select_rows(names, ("nothing*",)) == ["torch.sdpa"]
