"""``rlk check --logprobs processed|full``: the rollout reports each sampled token's processed
log-prob (renormalised over its top-k / top-p kept set) with the kept-set record; the train side
replays it bit for bit under greedy, temperature, top-k, top-p and both (``processed``), and the
full-vocabulary comparison shows the filter's bias wherever it dropped mass (``full``: the
negative control, asserted to mismatch)."""

from __future__ import annotations

import json

import pytest

from rl_engine.entrypoints.cli import main

SMALL = ["--json", "--num-prompts", "5", "--max-new-tokens", "10"]


def _run(capsys, *args):
    code = main(["check", *SMALL, *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "sampling, filtered",
    [
        (["--temperature", "0"], False),                                          # greedy
        (["--temperature", "0.7", "--top-k", "0", "--top-p", "1"], False),        # temperature only
        (["--temperature", "1", "--top-k", "7", "--top-p", "1"], True),           # top-k
        (["--temperature", "0.9", "--top-k", "0", "--top-p", "0.8"], True),       # top-p
        (["--temperature", "0.8", "--top-k", "40", "--top-p", "0.9"], True),      # both
    ],
    ids=["greedy", "temperature", "top-k", "top-p", "top-k+top-p"],
)
def test_processed_logprobs_replay_bitwise(capsys, sampling, filtered):
    code, res = _run(capsys, *sampling)
    assert code == 0 and res["passed"] and res["mismatched_tokens"] == 0, res["first_mismatch"]
    assert res["compared_tokens"] > 0 and res["sampling"]["logprobs"] == "processed"
    assert (res["sampling"]["filtered_tokens"] > 0) == filtered, res["sampling"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_vocabulary_under_top_p_is_the_negative_control(capsys, dtype):
    """The same run scored over the whole vocabulary: every filtered token mismatches (exit 1),
    and the processed replay of that run passes."""
    args = ["--dtype", dtype, "--temperature", "0.9", "--top-k", "0", "--top-p", "0.8"]
    code, full = _run(capsys, *args, "--logprobs", "full")
    assert code == 1 and not full["passed"]
    assert full["sampling"]["logprobs"] == "full" and full["sampling"]["filtered_tokens"] > 0
    assert full["mismatched_tokens"] == full["sampling"]["filtered_tokens"] * len(full["layouts"]) > 0
    fm = full["first_mismatch"]
    assert fm["train"] < fm["rollout"], "the full-vocabulary log-prob is below the renormalised one"
    code, proc = _run(capsys, *args)
    assert code == 0 and proc["mismatched_tokens"] == 0 and proc["bits_digest"] != full["bits_digest"]


def test_full_without_filters_equals_processed(capsys):
    """Nothing filtered: the kept sets are the whole vocabulary, so the two modes give one digest."""
    args = ["--temperature", "0.8", "--top-k", "0", "--top-p", "1"]
    code_f, full = _run(capsys, *args, "--logprobs", "full")
    code_p, proc = _run(capsys, *args)
    assert code_f == code_p == 0 and full["sampling"]["filtered_tokens"] == 0
    assert full["bits_digest"] == proc["bits_digest"]


def test_human_summary_names_the_mode(capsys):
    code = main(["check", "--num-prompts", "3", "--max-new-tokens", "6", "--logprobs", "full", "--top-p", "0.5"])
    out = capsys.readouterr().out
    assert code == 1 and "log-probs: full" in out and "drawn from a filtered distribution" in out


def test_bad_logprobs_value_exits_2(capsys):
    assert main(["check", "--logprobs", "sideways"]) == 2
    assert "--logprobs" in capsys.readouterr().err
