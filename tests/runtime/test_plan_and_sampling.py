"""Plans / ops providers, and the batch-independent sampler of the rollout executor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_engine.runtime import provenance
from rl_engine.engine.executor import RolloutRequest, SamplingParams, TrainSequence, sample_token, uniform
from rl_engine.runtime.plan import MODULES, SIDES, Plan, PlanError
from rl_engine.engine import OpsProvider
from rl_engine.utils.bits import same_bits
from rl_engine.engine import ops_for


def test_plan_parse_and_labels():
    for text in ("R/R", "P/P", "P/R", "r/p"):
        plan = Plan.parse(text)
        assert plan.label == text.upper()
        t, r = text.upper().split("/")
        assert set(plan.side("train").values()) == {t} and set(plan.side("rollout").values()) == {r}
    mixed = Plan.parse("R/R").with_module("attention", train="P")
    assert mixed.choices[("attention", "train")] == "P" and mixed.choices[("attention", "rollout")] == "R"
    assert "attention=P/R" in mixed.label
    assert set(mixed.as_dict()["train"]) == set(MODULES) and len(SIDES) == 2


@pytest.mark.parametrize("text", ["R", "R/R/R", "X/R", "", "RR"])
def test_plan_parse_rejects(text):
    with pytest.raises(PlanError, match="plan"):
        Plan.parse(text)


def test_plan_rejects_bad_modules_and_letters():
    with pytest.raises(PlanError, match="module"):
        Plan.parse("R/R").with_module("ssm", train="P")
    with pytest.raises(PlanError, match="must be 'P' or 'R'"):
        Plan.parse("R/R").with_module("gemm", train="Q")
    with pytest.raises(PlanError, match="side"):
        Plan.parse("R/R").side("eval")
    with pytest.raises(PlanError, match="missing modules"):
        OpsProvider({"gemm": "R"})
    with pytest.raises(PlanError, match="kv_cache"):
        ops_for(Plan.parse("R/R"), "rollout", kv_cache="ring")


def test_provider_routes_each_module():
    x = torch.randn(5, 8)
    w = torch.randn(3, 8)
    native = ops_for(Plan.parse("P/P"), "train")
    with provenance.record() as recs:
        assert same_bits(native.linear(x, w), F.linear(x, w))
    assert recs == [], "the native path must not dispatch rl-kernel operators"
    ours = ops_for(Plan.parse("P/P").with_module("gemm", train="R"), "train")
    with provenance.record() as recs:
        ours.linear(x, w)
        ours.rms_norm(x, torch.ones(8), 1e-6)
    assert [r.op for r in recs] == ["gemm.linear"]


def test_uniform_depends_only_on_the_triple():
    a = uniform(3, 17, 40)
    assert a == uniform(3, 17, 40) and 0.0 <= a < 1.0
    assert len({uniform(3, s, p) for s in range(20) for p in range(20)}) == 400
    assert uniform(3, 17, 40) != uniform(4, 17, 40)


def test_sampler_follows_the_distribution_and_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 2
    p = torch.softmax(logits.double(), -1)
    params = SamplingParams(temperature=1.0, seed=1)
    n = 6000
    counts = torch.bincount(torch.tensor([sample_token(logits, params, 0, pos) for pos in range(n)]), minlength=50)
    assert (counts.double() / n - p).abs().max() < 0.03
    top5 = set(torch.topk(logits, 5).indices.tolist())
    k5 = SamplingParams(temperature=1.0, top_k=5, seed=1)
    assert {sample_token(logits, k5, 1, pos) for pos in range(500)} <= top5
    order = torch.argsort(p, descending=True)
    nucleus = int((torch.cumsum(p[order], 0) < 0.5).sum()) + 1
    p5 = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    assert {sample_token(logits, p5, 2, pos) for pos in range(500)} <= set(order[:nucleus].tolist())
    greedy = SamplingParams(temperature=0.0)
    assert sample_token(logits, greedy, 9, 9) == int(torch.argmax(logits)) and greedy.logprob_temperature == 1.0


def test_sampler_is_batch_independent():
    """The token drawn for (sample, position) depends on its logits row only, not on neighbours."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 300, generator=g)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5)
    alone = [sample_token(rows[i].clone(), params, i, 11) for i in range(6)]
    batch = rows[[5, 3, 0, 1, 4, 2]]
    in_batch = {sid: sample_token(batch[k], params, sid, 11) for k, sid in enumerate([5, 3, 0, 1, 4, 2])}
    assert [in_batch[i] for i in range(6)] == alone


def test_input_validation():
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSequence(0, (1, 2, 3), (0, 1))
    with pytest.raises(ValueError, match="tokens"):
        TrainSequence(0, (1,), (0,))
    with pytest.raises(ValueError, match="prompt"):
        RolloutRequest(0, (), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        RolloutRequest(0, (1,), 0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


@pytest.mark.gpu
def test_sampler_is_device_independent():
    """The same logits row on the GPU and on the CPU draw the same token (the float64 sampling
    arithmetic runs on the CPU whatever the row's device)."""
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    for pos in range(50):
        row = torch.randn(997, generator=g)
        assert sample_token(row.cuda(), params, 5, pos) == sample_token(row, params, 5, pos)
