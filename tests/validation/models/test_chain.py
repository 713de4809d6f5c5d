"""WS1 model chain: zero raw-bit mismatches on every cell under R/R; P/P and injected faults caught."""

from __future__ import annotations

import pytest

from rl_engine.workloads import load_workload
from rl_engine.validation.chain import CELLS, run_chain
from rl_engine.validation.faults import faulty_factory


@pytest.fixture(scope="module")
def rr():
    return run_chain(load_workload())


def test_every_cell_bitwise_equal(rr):
    assert [c["cell"] for c in rr["cells"]] == list(CELLS)
    assert len(CELLS) == 11
    for c in rr["cells"]:
        assert c["compared_tokens"] > 0 and c["mismatched_tokens"] == 0, c
    assert rr["passed"] and rr["mismatched_tokens"] == 0


def test_cells_exercise_batching(rr):
    by = {c["cell"]: c for c in rr["cells"]}
    assert by["B1/singleton"]["max_sequences_per_step"] == 1
    assert by["decode/B1-long"]["compared_tokens"] > by["decode/B1-short"]["compared_tokens"]
    assert by["BN/chunked"]["max_sequences_per_step"] > 1
    assert by["BN/full"]["rollout_steps"] < by["BN/chunked"]["rollout_steps"] or by["BN/full"]["rollout_steps"] > 0


def test_gradient_invariance_across_layouts(rr):
    g = rr["gradient_invariance"]
    assert g["passed"]
    assert {c["layout"] for c in g["comparisons"]} == set(g["layouts"][1:])
    assert all(c["tokens"] > 50 for c in g["comparisons"])


def test_suite_negative_controls_are_detected(rr):
    assert [c["name"] for c in rr["negative_controls"]] == [
        "batch-dependent R norm (forward)", "batch-dependent R norm (backward only)"]
    assert all(c["detected"] for c in rr["negative_controls"])


def test_native_plan_is_caught():
    r = run_chain(load_workload(), plan="P/P", cells=["packed", "decode/B1-short"], grads=False, with_controls=False)
    assert not r["passed"] and r["mismatched_tokens"] > 0


def test_injected_forward_fault_is_caught():
    r = run_chain(load_workload(), cells=["packed", "padded-left"], grads=False, factory=faulty_factory("norm"),
                  with_controls=False)
    assert not r["passed"] and all(c["mismatched_tokens"] > 0 for c in r["cells"])


def test_injected_backward_fault_is_caught_by_gradient_invariance_only():
    r = run_chain(load_workload(), cells=["packed"], factory=faulty_factory("norm", kind="backward"), with_controls=False)
    assert r["cells"][0]["passed"]  # forward bits untouched
    assert not r["gradient_invariance"]["passed"]


def test_unknown_cell_is_rejected():
    with pytest.raises(ValueError, match="cells: unknown"):
        run_chain(load_workload(), cells=["nope"])


def test_rollout_and_train_at_different_thread_counts():
    """The chain with the rollout at 1 thread and training at 2 (and the reverse) stays bitwise;
    the negative control (a batch-dependent norm) is still caught at those thread counts."""
    for threads in ((1, 2), (2, 1)):
        r = run_chain(load_workload(), cells=["BN/chunked", "decode/B1-short"], grads=False, with_controls=False,
                      rollout_threads=threads[0], train_threads=threads[1])
        assert r["threads"] == {"rollout": threads[0], "train": threads[1]}
        assert r["passed"] and r["mismatched_tokens"] == 0 and r["compared_tokens"] > 0
    bad = run_chain(load_workload(), cells=["BN/chunked"], grads=False, with_controls=False,
                    factory=faulty_factory("norm"), rollout_threads=1, train_threads=2)
    assert not bad["passed"] and bad["mismatched_tokens"] > 0
