"""The loss family reads nothing back to the host on the default GPU path when the caller passes
``denominator=`` (the micro-batch form): every loss, forward and backward, the micro-batch
combine and the rollout-correction metrics run without an operation that would synchronise a
GPU (:class:`tests.helpers.host_reads.HostReads`, on the CPU with host tensors treated as device
tensors; ``tests/engine/test_no_host_sync.py`` runs the same calls on the GPU under
``torch.cuda.set_sync_debug_mode("error")``). Negative controls: a denominator computed from the
mask reads its count back, and the recorder sees ``torch.tensor`` and ``float`` of a tensor."""

from __future__ import annotations

import pytest
import torch

from rl_engine.ops import loss
from tests.helpers.host_reads import PORTABLE_HOST_PATHS, HostReads
from tests.ops.loss.helpers import loss_call_cases, loss_call_inputs


@pytest.mark.parametrize("name", list(loss_call_cases()))
def test_no_host_read_with_a_given_denominator(name, gpu_branches):
    run = loss_call_cases()[name]
    run()  # warm-up, as on the GPU: tables made once per device (portable.exp's) are made here
    with HostReads(PORTABLE_HOST_PATHS) as rec:
        run()
    assert rec.found == [], f"{name}: {list(zip(rec.found, rec.where))}"


def test_a_computed_denominator_reads_the_mask_back(gpu_branches):
    """The negative control of the cases above: without ``denominator=`` the loss reads the
    active-token count back (its ``denominator`` is a Python float)."""
    lp, old, adv, mask = loss_call_inputs()
    with HostReads(PORTABLE_HOST_PATHS) as rec:
        out = loss.ppo_clip_loss(lp, old, adv, mask)
    assert "rl_engine.ops.loss._common:loss_denominator" in rec.where and isinstance(out.denominator, float)


def test_the_recorder_sees_host_reads_inside_custom_ops_and_skips_only_host_branches():
    """Negative controls of the recorder: reads in the test's own code, and inside a custom op's
    implementation (the CPU fast path of ``portable.exp`` within the policy loss's kernel) are
    seen; naming that branch as host-only removes exactly its reads."""
    x = torch.randn(4)
    with HostReads() as rec:
        x.sum()
        assert rec.found == []
        float(x.sum())
        torch.tensor(1.0)
        torch.unique(x)
    assert rec.found[0] in ("item", "_local_scalar_dense") and "lift_fresh" in rec.found and rec.found[-1] == "_unique2"
    lp, old, adv, mask = loss_call_inputs()
    with HostReads() as inside:
        loss.ppo_clip_loss(lp, old, adv, mask, denominator=5.0)
    assert "rl_engine.utils.portable:exp" in inside.where
    with HostReads(PORTABLE_HOST_PATHS) as skipped:
        loss.ppo_clip_loss(lp, old, adv, mask, denominator=5.0)
    assert "rl_engine.utils.portable:exp" not in skipped.where
