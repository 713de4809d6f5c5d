"""A test-only operator (``rlktest.scale``: ``y = 2 x``) with its own contract, for registry and
CLI tests. The contract is served by monkeypatching the contract loader; nothing test-only is
shipped in the package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from rl_engine import contracts
from rl_engine.runtime import registry

TEST_OP = "rlktest.scale"
TEST_FAMILY = "rlktest"

CONTRACT = contracts.OperatorContract.model_validate(
    {
        "schema_version": 1,
        "op": TEST_OP,
        "version": 3,
        "summary": "y = 2 x (test-only operator, never shipped).",
        "dtypes": ["float32", "bfloat16"],
        "invariances": {"forward": ["row", "run_to_run"], "backward": ["row"]},
        "precision_profile": "v1",
    }
)


def scale_native(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def make_impl(impl_id: str, *, fn: Callable[..., Any] = scale_native, module: str | None = None, **kw: Any) -> registry.Implementation:
    """An :class:`Implementation` of the test op; ``module`` overrides where it claims to live
    (the registry orders backend packages by module name)."""
    if module is not None:
        def fn_in_module(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
            return _fn(*args, **kwargs)

        fn_in_module.__module__ = module
        fn = fn_in_module
    defaults: dict[str, Any] = dict(
        op=TEST_OP, impl_id=impl_id, version="1", fn=fn, families=("cpu",),
        dtypes=(torch.float32, torch.bfloat16), guarantees=frozenset({"row", "run_to_run"}),
    )
    defaults.update(kw)
    return registry.Implementation(**defaults)


@pytest.fixture
def fake_op(monkeypatch) -> Iterator[str]:
    """Serve the test contract (loader and listing) and remove the test op's registrations after."""
    real_load = contracts.load_contract
    real_all = contracts.all_contracts
    monkeypatch.setattr(contracts, "load_contract", lambda op: CONTRACT if op == TEST_OP else real_load(op))
    monkeypatch.setattr(contracts, "all_contracts", lambda: {**real_all(), TEST_OP: CONTRACT})
    try:
        yield TEST_OP
    finally:
        registry._REGISTRY.pop(TEST_OP, None)
        registry._REFERENCES.pop(TEST_OP, None)
        registry._LOADED_FAMILIES.discard(TEST_FAMILY)
