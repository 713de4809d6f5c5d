"""The vLLM plugin's switch and checkers without vLLM itself (runs in every environment):
importing the package imports no vLLM; the entry point is declared and does nothing unless
RLK_VLLM asks; a bad RLK_VLLM is rejected by name; assert_no_fallbacks and parity.compare
fail on the cases they exist for (their negative controls)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_engine.integrations.vllm import (
    QWEN3_KINDS,
    ProvenanceError,
    assert_no_fallbacks,
    is_installed,
    register,
)
from rl_engine.integrations.vllm.parity import RolloutSeq, compare

REPO = Path(__file__).resolve().parents[3]


def _py(code: str, **env) -> subprocess.CompletedProcess:
    import os

    e = {k: v for k, v in os.environ.items() if k != "RLK_VLLM"}
    e.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", code], env=e, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_import_and_disabled_register_import_no_vllm():
    p = _py("import sys; import rl_engine.integrations.vllm as v; v.register(); "
            "assert 'vllm' not in sys.modules, 'vllm imported'; assert not v.is_installed(); print('ok')",
            RLK_VLLM="0")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


def test_entry_point_declared_in_pyproject():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    eps = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"rl_engine": "rl_engine.integrations.vllm.plugin:register"}


@pytest.mark.parametrize("value", ["", "0"])
def test_register_is_a_no_op_when_not_asked(monkeypatch, value):
    monkeypatch.setenv("RLK_VLLM", value)
    register()
    assert not is_installed()


def test_register_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv("RLK_VLLM", "yes-please")
    with pytest.raises(ValueError, match="RLK_VLLM"):
        register()
    assert not is_installed()


def _rank(**over):
    p = {"rank": 0, "pid": 1, "mode": "strict", "installed": "strict", "native_calls": {}, "fallback": False,
         "modules": {k: 1 for k in QWEN3_KINDS},
         "operators": [{"op": "gemm.linear", "impl_id": "cpu.exact_sum", "fallback": False, "calls": 3}]}
    p.update(over)
    return p


def test_assert_no_fallbacks_accepts_a_clean_run():
    assert_no_fallbacks([_rank(), _rank(rank=1, pid=2)])


@pytest.mark.parametrize("bad, match", [
    ([], "no worker"),
    ([_rank(installed=None)], "not installed"),
    ([_rank(), _rank(rank=1, native_calls={"RMSNorm.forward": 2})], "native vLLM operators ran"),
    ([_rank(operators=[{"op": "gemm.linear", "impl_id": "reference.float64", "fallback": True, "calls": 1}])],
     "fell back"),
    ([_rank(modules={k: 1 for k in QWEN3_KINDS if k != "Attention"})], "Attention"),
])
def test_assert_no_fallbacks_rejects(bad, match):
    with pytest.raises(ProvenanceError, match=match):
        assert_no_fallbacks(bad)


def test_compare_counts_raw_bit_mismatches():
    lp = torch.tensor([-1.5, -0.25, 0.0, -3.0])
    seq = RolloutSeq((5, 6), (7, 8, 9, 10), lp)
    assert compare([seq], [lp.clone()]).passed
    one_ulp = lp.clone()
    one_ulp[1] = torch.nextafter(lp[1], torch.tensor(0.0))
    r = compare([seq], [one_ulp])
    assert not r.passed and r.mismatched_tokens == 1 and r.per_sequence[0]["mismatched_tokens"] == 1
    neg_zero = lp.clone()
    neg_zero[2] = -0.0
    assert compare([seq], [neg_zero]).mismatched_tokens == 1  # +0 and -0 differ
    nan = lp.clone()
    nan[3] = float("nan")
    assert compare([seq], [nan]).mismatched_tokens == 1
    with pytest.raises(ValueError, match="train"):
        compare([seq], [lp[:3]])
