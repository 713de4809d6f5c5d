"""The vLLM plugin's processed log-probs and kept-set records: the sampler wrapper runs
rl_engine's canonical top-k / top-p filter, returns ``log_softmax(z, kept=records)`` and samples
inside the kept sets; ``GPUModelRunner._sample`` publishes each row's request and position, the
records are stored per token (discarded samples left out) and ``kept_sets`` lines them up with
the outputs' tokens. Runs in the vLLM environment (``.venv-vllm``)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="needs the vLLM environment (.venv-vllm, created by make test)")


def test_install_wraps_the_sampler_and_the_runner_and_uninstall_restores():
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from rl_engine.integrations.vllm import install, uninstall

    before = (GPUModelRunner.__dict__["_sample"], TopKTopPSampler.__dict__["forward_cpu"])
    install(strict=False)
    try:
        assert "rlk_sample_rows" in GPUModelRunner._sample.__qualname__
        assert "rlk_processed_logprobs" in TopKTopPSampler.forward_cpu.__qualname__
        assert hasattr(WorkerWrapperBase, "rlk_take_kept_sets")
    finally:
        uninstall()
    assert (GPUModelRunner.__dict__["_sample"], TopKTopPSampler.__dict__["forward_cpu"]) == before
    assert not hasattr(WorkerWrapperBase, "rlk_take_kept_sets")


def test_processed_sampler_filters_records_and_returns_renormalised_logprobs():
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from rl_engine.integrations.vllm import install, kept as store, uninstall
    from rl_engine.ops.logprob import canonical_prefix, log_softmax

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 300, generator=g) * 3 / 0.8  # what vLLM hands the sampler: fp32 logits / T
    k = torch.tensor([300, 5, 40, 300], dtype=torch.int32)  # vLLM's "off" is k = V
    p = torch.tensor([1.0, 1.0, 0.9, 0.7])
    install(strict=True)
    try:
        sampler = TopKTopPSampler("processed_logprobs")
        store.take()
        with store.sampling_rows(["a-1", "b-2", "c-3", "d-4"], [7, 3, 9, 12], [False, False, True, False]):
            sampled, lp = TopKTopPSampler.forward_cpu(sampler, z.clone(), {}, k, p)
        recs = store.take()
    finally:
        uninstall()
    want = canonical_prefix(z, k, p).kept
    assert torch.equal(lp, log_softmax(z, kept=want))
    keep = want.mask(z)
    assert bool(keep.gather(1, sampled.long().view(-1, 1)).all())
    assert bool(keep[0].all()) and int(keep[1].sum()) == 5  # row 0: nothing filtered; row 1: exactly k
    assert set(recs) == {"a-1", "b-2", "d-4"}  # row 2's sample is discarded by vLLM: no record
    assert recs["b-2"] == {3: (float(want.threshold[1]), int(want.boundary[1]))}


def test_records_outside_a_sample_call_are_not_stored():
    from rl_engine.integrations.vllm import kept as store
    from rl_engine.ops.logprob import KeptSet

    store.take()
    assert store.record(KeptSet.everything((2,)), 2) is False and store.take() == {}
    with store.sampling_rows(["x"], [1], [False]):
        assert store.record(KeptSet.everything((2,)), 2) is False  # not one row per request
    assert store.current_rows() is None


def test_kept_sets_line_up_with_each_outputs_tokens():
    from rl_engine.integrations.vllm import kept_sets
    from rl_engine.ops.logprob import KEEP_ALL_BOUNDARY

    stored = {"7-ab12cd34": {4: (1.5, 9), 5: (-0.25, 3)}, "8-ffee0011": {2: (2.0, 1)}}
    llm = types.SimpleNamespace(collective_rpc=lambda method: [stored] if method == "rlk_take_kept_sets" else None)

    def out(rid, prompt, toks):
        return types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt, outputs=[types.SimpleNamespace(token_ids=toks)])

    outs = [out("7", [1, 2, 3, 4], [10, 11]), out("8", [5, 6], [12, 13])]
    with pytest.raises(ValueError, match=r"^kept: no kept-set record for token 1 \(position 3\) of request '8'"):
        kept_sets(llm, outs)
    a, b = kept_sets(llm, outs, require=False)
    assert a.threshold.tolist() == [1.5, -0.25] and a.boundary.tolist() == [9, 3]
    assert b.threshold[0] == 2.0 and torch.isneginf(b.threshold[1]) and int(b.boundary[1]) == KEEP_ALL_BOUNDARY
