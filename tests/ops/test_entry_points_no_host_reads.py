"""The public operators' entry points read nothing back to the host on the default GPU path:
each op, forward and backward, runs on the CPU with host tensors taking the GPU's branches of the
NaN policy (no scan, no read-back), under :class:`tests.helpers.host_reads.HostReads`, which
records every operation that would make a GPU wait. The CPU backends' own code is not the GPU's
(the Triton kernels are; ``tests/engine/test_no_host_sync.py`` runs those on the device under
``torch.cuda.set_sync_debug_mode("error")``), so reads inside ``rl_engine.backends.cpu`` are left
out; the entry points, the registry and the shared utilities are checked. Negative control: the
``raise`` policy's scan is seen."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rl_engine import ops
from rl_engine.utils.checks import nan_policy
from tests.helpers.host_reads import CPU_ONLY, HostReads

H, V, T = 32, 100, 6


def _r(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape) + shape[0])).requires_grad_(grad)


def _bwd(y) -> None:
    y = y[0] if isinstance(y, tuple) else y
    y.float().sum().backward()


def _ids(n: int) -> torch.Tensor:
    return torch.arange(n) % V


CASES: dict[str, Callable[[], None]] = {
    "linear": lambda: _bwd(ops.gemm.linear(_r(T, H), _r(H, H))),
    "rms_norm": lambda: _bwd(ops.norm.rms_norm(_r(T, H), _r(H), 1e-6)),
    "fused_add_rms_norm": lambda: ops.norm.fused_add_rms_norm(_r(T, H), _r(T, H), _r(H), 1e-6),
    "silu_and_mul": lambda: _bwd(ops.activation.silu_and_mul(_r(T, 2 * H))),
    "apply_rope": lambda: _bwd(ops.rope.apply_rope(_r(T, 4, 16), torch.arange(T), theta=1e6)),
    "embedding": lambda: _bwd(ops.embedding.embedding(_ids(T), _r(V, H))),
    "token_logprobs": lambda: _bwd(ops.logprob.token_logprobs(_r(T, V), _ids(T))),
    "log_softmax": lambda: _bwd(ops.logprob.log_softmax(_r(T, V))),
    "entropy": lambda: _bwd(ops.logprob.entropy(_r(T, V))),
    "linear_token_logprobs": lambda: _bwd(ops.logprob.linear_token_logprobs(_r(T, H), _r(V, H), _ids(T))),
    "moe_route_experts": lambda: _bwd(ops.moe.experts(_r(T, H), _r(8, 32, H), _r(8, H, 16), *ops.moe.route(_r(T, 8), 2, True))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_entry_point_reads_nothing_back(name, gpu_branches):
    CASES[name]()  # warm-up: cached tables and selections, as on the GPU
    with HostReads(CPU_ONLY) as rec:
        CASES[name]()
    assert rec.found == [], f"{name}: {list(zip(rec.found, rec.where))}"


def test_the_raise_policys_scan_is_seen(gpu_branches):
    CASES["rms_norm"]()
    with nan_policy("raise"), HostReads(CPU_ONLY) as rec:
        CASES["rms_norm"]()
    assert "rl_engine.utils.checks:_has_nan" in rec.where
