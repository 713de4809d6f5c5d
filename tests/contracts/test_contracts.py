"""Contracts as data: every shipped file validates, invalid files are rejected with a reason,
tolerance lookups honour overrides."""

from __future__ import annotations

import copy
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rl_engine import contracts
from rl_engine.contracts import ContractError, OperatorContract

VALID = {
    "schema_version": 1,
    "op": "testfam.scale",
    "version": 1,
    "summary": "y = 2 x, a test-only operator.",
    "dtypes": ["float32", "bfloat16"],
    "invariances": {"forward": ["row", "run_to_run"], "backward": ["row"]},
    "precision_profile": "v1",
    "tolerance_overrides": [
        {"dtype": "bfloat16", "quantity": "backward", "atol": 0.5, "rtol": 0.25, "reason": "a test override with a reason."}
    ],
}


def _caches_clear() -> None:
    contracts.load_contract.cache_clear()
    contracts.invariance_vocabulary.cache_clear()
    contracts.precision_profile.cache_clear()


@pytest.fixture
def contract_dir(tmp_path, monkeypatch):
    """A copy of the shipped contract tree that the loader reads instead of the package's."""
    src = Path(str(resources.files("rl_engine.contracts")))
    root = tmp_path / "contracts"
    shutil.copytree(src / "profiles", root / "profiles")
    shutil.copytree(src / "operators", root / "operators")
    real_files = contracts.resources.files

    def files(name):
        return root if name == contracts.__name__ else real_files(name)

    monkeypatch.setattr(contracts.resources, "files", files)
    _caches_clear()
    yield root
    monkeypatch.undo()
    _caches_clear()


def _write(root: Path, op: str, doc) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (root / "operators" / f"{op}.json").write_text(text, encoding="utf-8")


# ---- shipped contracts --------------------------------------------------------------------------


def test_every_shipped_contract_validates():
    shipped = contracts.all_contracts()
    assert "gemm.linear" in shipped
    vocab = {d.name for d in contracts.invariance_vocabulary()}
    assert vocab == {"row", "chunk", "prefill_decode", "layout", "tp_size", "run_to_run", "threads", "isa"}
    for op, c in shipped.items():
        assert c.op == op
        if not op.startswith("models."):
            assert c.platform_invariances == {"cpu": ["threads", "isa"]}, op
            assert c.guarantees_on("cpu") == c.guarantees | {"threads", "isa"}
            assert c.guarantees_on("cuda") == c.guarantees
        assert set(c.invariances.forward) <= vocab and set(c.invariances.backward) <= vocab
        assert c.guarantees == frozenset(c.invariances.forward)
        for name in c.dtypes:
            for quantity in ("forward", "backward"):
                tol = contracts.tolerance(op, getattr(torch, name), quantity)
                assert tol.atol >= 0 and tol.rtol >= 0 and len(tol.reason) >= 8


def test_shipped_profiles_validate():
    v1 = contracts.precision_profile("v1")
    assert v1.name == "v1" and {"float32", "bfloat16"} <= set(v1.tolerances)
    for per_dtype in v1.tolerances.values():
        assert per_dtype.forward.reason and per_dtype.backward.reason


def test_unknown_operator_lists_the_known_ones():
    with pytest.raises(ContractError, match=r"^op: no contract for 'nope\.nope'; known: \[.*'gemm\.linear'"):
        contracts.load_contract("nope.nope")


# ---- invalid contracts are rejected --------------------------------------------------------------


def _mutated(**changes):
    doc = copy.deepcopy(VALID)
    doc.update(changes)
    return doc


def test_valid_test_contract_is_accepted():
    c = OperatorContract.model_validate(VALID)
    assert c.supports(torch.float32) and not c.supports(torch.float16)
    v = OperatorContract.model_validate(_mutated(variants={"wide": {"summary": "fp32 output of bf16 input", "dtypes": ["bfloat16"],
                                                                    "equality": "row and chunk invariant as the default"}}))
    assert list(v.variants) == ["wide"] and v.variants["wide"].dtypes == ["bfloat16"]


@pytest.mark.parametrize(
    "doc, message",
    [
        (_mutated(invariances={"forward": ["row", "bitwise_magic"], "backward": []}), "forward invariances \\['bitwise_magic'\\] are not in the vocabulary"),
        (_mutated(invariances={"forward": ["row"], "backward": ["telepathy"]}), "backward invariances \\['telepathy'\\]"),
        (_mutated(dtypes=["float32", "float8"]), "dtypes must be a non-empty subset"),
        (_mutated(dtypes=[]), "dtypes must be a non-empty subset"),
        (
            _mutated(tolerance_overrides=[{"dtype": "float16", "quantity": "forward", "atol": 1, "rtol": 1, "reason": "unsupported dtype here"}]),
            "override for dtype 'float16' which the contract does not support",
        ),
        (_mutated(tolerance_overrides=[{"dtype": "float32", "quantity": "forward", "atol": 1, "rtol": 1}]), "reason"),
        (_mutated(tolerance_overrides=[{"dtype": "float32", "quantity": "forward", "atol": 1, "rtol": 1, "reason": "short"}]), "reason"),
        (_mutated(tolerance_overrides=[{"dtype": "float32", "quantity": "sideways", "atol": 1, "rtol": 1, "reason": "bad quantity name"}]), "quantity"),
        (_mutated(tolerance_overrides=[{"dtype": "float32", "quantity": "forward", "atol": -1, "rtol": 1, "reason": "negative tolerance"}]), "atol"),
        (_mutated(variants={"fp32_out": {"summary": "fp32 output variant", "dtypes": ["float16"], "equality": "same bits as ..."}}),
         "variant 'fp32_out': dtypes must be a non-empty subset"),
        (_mutated(variants={"fp32_out": {"summary": "fp32 output variant", "dtypes": ["bfloat16"]}}), "equality"),
        (_mutated(schema_version=2), "schema_version"),
        (_mutated(version=0), "version"),
        (_mutated(surprise="field"), "surprise"),
        ({k: v for k, v in VALID.items() if k != "summary"}, "summary"),
    ],
)
def test_invalid_contract_is_rejected(doc, message):
    with pytest.raises(ValidationError, match=message):
        OperatorContract.model_validate(doc)


def test_loader_reads_a_valid_file(contract_dir):
    _write(contract_dir, "testfam.scale", VALID)
    c = contracts.load_contract("testfam.scale")
    assert c.op == "testfam.scale"
    assert "testfam.scale" in contracts.all_contracts()


def test_loader_rejects_bad_json(contract_dir):
    _write(contract_dir, "testfam.scale", '{"schema_version": 1, "op": ')
    with pytest.raises(ContractError, match="testfam.scale.json is not valid JSON"):
        contracts.load_contract("testfam.scale")


def test_loader_rejects_unknown_invariance_in_a_file(contract_dir):
    _write(contract_dir, "testfam.scale", _mutated(invariances={"forward": ["rows"], "backward": []}))
    with pytest.raises(ValidationError, match="not in the vocabulary"):
        contracts.load_contract("testfam.scale")


def test_loader_rejects_a_file_declaring_another_op(contract_dir):
    _write(contract_dir, "testfam.scale", _mutated(op="testfam.other"))
    with pytest.raises(ContractError, match="declares op 'testfam.other'"):
        contracts.load_contract("testfam.scale")


def test_loader_rejects_a_missing_precision_profile(contract_dir):
    _write(contract_dir, "testfam.scale", _mutated(precision_profile="v99"))
    c = contracts.load_contract("testfam.scale")  # the profile is resolved on lookup
    with pytest.raises(ContractError, match="profiles/precision/v99.json not found"):
        c.tolerance(torch.float32)


def test_loader_rejects_a_profile_with_an_unknown_dtype(contract_dir):
    path = contract_dir / "profiles" / "precision" / "v1.json"
    doc = json.loads(path.read_text())
    doc["tolerances"]["float8"] = doc["tolerances"]["float32"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValidationError, match="unknown dtypes \\['float8'\\]"):
        contracts.precision_profile("v1")


def test_profile_entry_without_reason_is_rejected(contract_dir):
    path = contract_dir / "profiles" / "precision" / "v1.json"
    doc = json.loads(path.read_text())
    del doc["tolerances"]["float32"]["forward"]["reason"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValidationError, match="reason"):
        contracts.precision_profile("v1")


# ---- tolerance lookup ---------------------------------------------------------------------------


def test_tolerance_lookup_profile_and_override():
    c = OperatorContract.model_validate(VALID)
    profile = contracts.precision_profile("v1")
    assert c.tolerance(torch.float32, "forward") == profile.tolerances["float32"].forward
    assert c.tolerance(torch.bfloat16, "forward") == profile.tolerances["bfloat16"].forward
    over = c.tolerance(torch.bfloat16, "backward")
    assert (over.atol, over.rtol, over.reason) == (0.5, 0.25, "a test override with a reason.")
    with pytest.raises(ContractError, match="dtype float16 is not covered"):
        c.tolerance(torch.float16)


def test_shipped_overrides_win_over_the_profile():
    """For every shipped contract, dtype and quantity: the override if there is one, else the profile."""
    for op, c in contracts.all_contracts().items():
        profile = contracts.precision_profile(c.precision_profile)
        for name in c.dtypes:
            dt = getattr(torch, name)
            for quantity in ("forward", "backward"):
                tol = contracts.tolerance(op, dt, quantity)
                override = [o for o in c.tolerance_overrides if o.dtype == name and o.quantity == quantity]
                assert len(override) <= 1, f"{op}: two overrides for {name}/{quantity}"
                if override:
                    o = override[0]
                    assert (tol.atol, tol.rtol, tol.reason) == (o.atol, o.rtol, o.reason)
                else:
                    assert tol == getattr(profile.tolerances[name], quantity)
    gemm = contracts.load_contract("gemm.linear")
    assert any(o.dtype == "float32" and o.quantity == "forward" for o in gemm.tolerance_overrides)


def test_tolerance_check_semantics():
    tol = contracts.Tolerance(atol=1e-3, rtol=1e-2, reason="semantics of the check")
    e = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    assert tol.check(e + torch.tensor([0.011, -0.021, 0.001], dtype=torch.float64), e)
    assert not tol.check(e + torch.tensor([0.0, 0.0, 0.0011], dtype=torch.float64), e)
    assert tol.max_violation(torch.tensor([float("nan"), 0.0, 0.0]), e) == float("inf")
    assert tol.max_violation(torch.empty(0), torch.empty(0)) == float("-inf")
    with pytest.raises(ContractError, match="shape"):
        tol.max_violation(torch.zeros(2), torch.zeros(3))


def test_dtype_name():
    assert contracts.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ContractError, match="^dtype: torch.int8 has no contract name"):
        contracts.dtype_name(torch.int8)


def test_platform_invariances_are_required_of_that_family_only(tmp_path):
    """A CPU implementation that does not declare ``threads``/``isa`` is rejected under the strict
    policy; a CUDA request does not ask for them (negative control: the same request without them)."""
    from rl_engine.platforms import platform_of
    from rl_engine.runtime.registry import Implementation, make_request

    req = make_request("gemm.linear", torch.zeros(1))
    assert {"threads", "isa"} <= req.requires
    impl = Implementation(op="gemm.linear", impl_id="test.no_isa", version="1", fn=lambda *a: None,
                          families=("cpu",), dtypes=(torch.float32,), guarantees=frozenset({"row", "chunk", "run_to_run"}),
                          priority=99)
    assert any("threads" in r and "isa" in r for r in impl.reject_reasons(req))
    plain = type(req)(req.op, platform_of(torch.zeros(1)), req.dtype, contracts.load_contract("gemm.linear").guarantees, {})
    assert impl.reject_reasons(plain) == []


def test_platform_invariances_names_are_checked(tmp_path):
    doc = json.loads((Path(contracts.__file__).parent / "operators" / "gemm.linear.json").read_text())
    doc["platform_invariances"] = {"cpu": ["threads", "no_such_thing"]}
    with pytest.raises(ValueError, match="no_such_thing"):
        contracts.OperatorContract.model_validate(doc)
