"""Index arguments that bound memory accesses are checked on the GPU without a host read.

Under the default NaN policy a GPU call never reads a value back, so an out-of-range token id,
target or position cannot raise a Python error; it must stop the process at a device-side
assertion instead of letting a kernel read past its table (``rl_engine.utils.checks.
check_index_range``, ``docs/design/host-path.md``). A device-side assertion poisons the CUDA
context, so each case runs in a child process: the out-of-range call must end it with a
device-side assertion, and the same call with in-range indices (the negative control, which
shows the child harness can pass) must finish and print its marker.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

gpu = pytest.mark.gpu

#: (case, setup, the call whose index argument is ``bad``) — ``bad`` is an in-range or out-of-range index tensor
CASES = {
    "embedding ids": ("w = torch.randn(100, 64, device='cuda', dtype=torch.bfloat16)",
                      "ops.embedding.embedding(bad, w)", "[3, 99]", "[3, 100]"),
    "embedding negative id": ("w = torch.randn(100, 64, device='cuda', dtype=torch.bfloat16)",
                              "ops.embedding.embedding(bad, w)", "[0, 5]", "[0, -1]"),
    "token_logprobs targets": ("x = torch.randn(2, 1000, device='cuda', dtype=torch.bfloat16)",
                               "ops.logprob.token_logprobs(x, bad)", "[0, 999]", "[0, 1000]"),
    "apply_rope positions": ("x = torch.randn(2, 4, 128, device='cuda', dtype=torch.bfloat16)",
                             "ops.rope.apply_rope(x, bad)", "[0, 262143]", "[0, 262144]"),
}

_CHILD = """
import torch
from rl_engine import ops
{setup}
bad = torch.tensor({ids}, device="cuda")
out = {call}
torch.cuda.synchronize()
print("RLK_CHILD_DONE", flush=True)
"""


def _child(setup: str, call: str, ids: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(_CHILD).format(setup=setup, call=call, ids=ids)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_out_of_range_index_stops_at_a_device_side_assertion(case):
    setup, call, good, bad = CASES[case]
    ok = _child(setup, call, good)  # negative control: the harness passes an in-range call
    assert ok.returncode == 0 and "RLK_CHILD_DONE" in ok.stdout, ok.stderr[-3000:]
    res = _child(setup, call, bad)
    assert res.returncode != 0 and "RLK_CHILD_DONE" not in res.stdout, (res.stdout[-2000:], res.stderr[-2000:])
    assert "device-side assert" in res.stderr or "Assertion" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("entry_name", ["embedding", "logprob"])
def test_entry_point_leaves_the_range_to_an_implementation_that_asserts_it(monkeypatch, entry_name):
    """Where indices can be read back, the entry point checks them itself (a clear ValueError);
    where they cannot (a GPU under the default policy, simulated on the CPU), it launches the
    separate device check only when the selected implementation does not assert the range in
    its own kernel (``Implementation.device_index_checks``). The CPU implementations do not
    declare it, so the simulated device path still checks (the control)."""
    import torch

    from rl_engine import ops
    entry = importlib.import_module(f"rl_engine.ops.{entry_name}")
    call = {"embedding": lambda ids: ops.embedding.embedding(ids, torch.randn(10, 4)),
            "logprob": lambda ids: ops.logprob.token_logprobs(torch.randn(2, 10), ids)}[entry_name]
    calls = []
    real = entry.check_index_range
    monkeypatch.setattr(entry, "check_index_range", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    ids = torch.tensor([1, 9])
    with pytest.raises(ValueError, match="expected token ids in"):
        call(torch.tensor([1, 10]))  # host tensors: read back, a clear error
    monkeypatch.setattr(entry, "reads_back", lambda t: False)
    calls.clear()
    call(ids)
    assert len(calls) == 1  # the CPU implementation does not assert in a kernel: the device check runs
    monkeypatch.setattr(entry, "checks_indices", lambda req: True)
    calls.clear()
    call(ids)
    assert calls == []
