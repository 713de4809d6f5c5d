"""Runtime registry, policy and provenance: strict rejection messages, the diagnostic fallback,
provenance fields and their stability, context-manager nesting, pure eligibility, priority order."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from rl_engine import contracts
from rl_engine.ops import gemm
from rl_engine.platforms import Platform, platform_of
from rl_engine.reference.gemm import linear_f64
from rl_engine.runtime import (
    NoEligibleImplementation,
    Request,
    current_policy,
    dispatch,
    implementations,
    make_request,
    provenance,
    reference_for,
    register,
    register_reference,
    select,
    use_policy,
)
from rl_engine.runtime import registry
from rl_engine.utils.bits import same_bits
from tests.runtime.fake_operator import TEST_OP, fake_op, make_impl  # noqa: F401  (fixture)

CUDA_PLATFORM = Platform("cuda", "sm90", "simulated H200", torch.__version__, None, "12.8", None)


def _request(dtype=torch.bfloat16, platform=None, features=None) -> Request:
    return Request(
        op=TEST_OP,
        platform=platform or platform_of("cpu"),
        dtype=dtype,
        requires=frozenset({"row", "run_to_run"}),
        features=features or {},
    )


# ---- strict policy: the rejection lists every candidate and every reason -----------------------


def test_strict_rejection_lists_every_candidate_and_reason(fake_op):
    register(make_impl("a.gpu_only", families=("cuda", "rocm"), dtypes=(torch.float32,)))
    register(make_impl("b.fp32_only", dtypes=(torch.float32,)))
    register(make_impl("c.weak", guarantees=frozenset({"row"})))
    register(make_impl("d.unavailable", static_check=lambda: ["compiler 'zz' is not installed"]))
    register(make_impl("e.shape", call_check=lambda req: [f"K={req.features['K']} is not a multiple of 16"]))
    req = _request(torch.bfloat16, features={"K": 7})
    with pytest.raises(NoEligibleImplementation) as info:
        dispatch(req, torch.ones(2, dtype=torch.bfloat16))
    exc = info.value
    msg = str(exc)
    assert msg.startswith(f"no implementation of '{TEST_OP}' is eligible for dtype=torch.bfloat16, platform=cpu:")
    assert "requires=['row', 'run_to_run'] (policy=strict)" in msg
    expected = {
        "a.gpu_only": ["platform family 'cpu' not in ['cuda', 'rocm']", "dtype torch.bfloat16 not in ['torch.float32']"],
        "b.fp32_only": ["dtype torch.bfloat16 not in ['torch.float32']"],
        "c.weak": ["does not guarantee invariances ['run_to_run']"],
        "d.unavailable": ["compiler 'zz' is not installed"],
        "e.shape": ["K=7 is not a multiple of 16"],
    }
    assert dict(exc.rejections) == expected
    for impl_id, reasons in expected.items():
        assert f"  {impl_id}: " + "; ".join(reasons) in msg
    assert "use_policy('diagnostic')" in msg


def test_strict_rejection_when_nothing_is_registered(fake_op):
    with pytest.raises(NoEligibleImplementation, match=r"\(no implementation is registered for this operator\)"):
        dispatch(_request(), torch.ones(2))


def test_register_requires_a_contract():
    with pytest.raises(contracts.ContractError, match="no contract for 'rlktest.uncontracted'"):
        register(make_impl("x", op="rlktest.uncontracted"))


def test_reference_for_unknown_op():
    with pytest.raises(KeyError, match="no reference registered"):
        reference_for("rlktest.no_reference")


# ---- diagnostic policy: fallback to the reference, recorded --------------------------------------


def test_diagnostic_fallback_is_recorded_and_float64_accurate(monkeypatch):
    implementations("gemm.linear")  # load the family before emptying its registry entry
    monkeypatch.setitem(registry._REGISTRY, "gemm.linear", [])
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 64, generator=g).to(dtype)
        w = torch.randn(7, 64, generator=g).to(dtype)
        with pytest.raises(NoEligibleImplementation, match="policy=strict"):
            gemm.linear(x, w)
        with use_policy("diagnostic"), provenance.record() as calls:
            y = gemm.linear(x, w)
        assert len(calls) == 1
        rec = calls[0]
        assert (rec.op, rec.impl_id, rec.policy, rec.fallback) == ("gemm.linear", "reference.float64", "diagnostic", True)
        assert rec.source_fingerprint == provenance.source_fingerprint("rl_engine.reference.gemm")
        y64 = linear_f64(x, w)
        # the float64 result rounded once to the output dtype: within half an ulp of float64
        assert same_bits(y, y64.to(dtype))
        ulp = torch.finfo(dtype).eps * y64.abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((y.double() - y64).abs() <= ulp / 2 + 1e-300).all())


def test_diagnostic_policy_prefers_an_eligible_implementation():
    x = torch.randn(4, 16)
    w = torch.randn(3, 16)
    with use_policy("diagnostic"), provenance.record() as calls:
        gemm.linear(x, w)
    assert (calls[0].impl_id, calls[0].fallback, calls[0].policy) == ("cpu.exact_sum", False, "diagnostic")


def test_diagnostic_fallback_of_a_test_op(fake_op):
    register(make_impl("only.fp32", dtypes=(torch.float32,)))
    calls_seen = []

    @register_reference(TEST_OP)
    def scale_reference(x):
        calls_seen.append(x.dtype)
        return (x.double() * 2).to(x.dtype)

    x = torch.tensor([1.5, -3.0], dtype=torch.bfloat16)
    with use_policy("diagnostic"), provenance.record() as calls:
        y = dispatch(make_request(TEST_OP, x), x)
    assert calls_seen == [torch.bfloat16]
    assert same_bits(y, torch.tensor([3.0, -6.0], dtype=torch.bfloat16))
    assert (calls[0].impl_id, calls[0].fallback, calls[0].contract_version) == ("reference.float64", True, 3)


# ---- provenance ---------------------------------------------------------------------------------

FIELDS = {"op", "impl_id", "impl_version", "platform", "source_fingerprint", "policy", "fallback", "contract_version", "requested"}


def _linear_record() -> provenance.ProvenanceRecord:
    x = torch.randn(3, 8)
    w = torch.randn(2, 8)
    with provenance.record() as calls:
        gemm.linear(x, w)
    assert len(calls) == 1
    return calls[0]


def test_provenance_fields_present():
    rec = _linear_record()
    d = rec.as_dict()
    assert set(d) == FIELDS
    assert d["op"] == "gemm.linear" and d["impl_id"] == "cpu.exact_sum" and d["impl_version"] == "3"
    assert d["platform"] == platform_of("cpu").key
    assert d["policy"] == "strict" and d["fallback"] is False
    assert d["contract_version"] == contracts.load_contract("gemm.linear").version
    assert d["requested"] == ["chunk", "isa", "row", "run_to_run", "threads"]  # CPU: plus the platform invariances
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", d["source_fingerprint"])
    import rl_engine.backends.cpu.gemm as backend

    want = hashlib.sha256(inspect.getsource(backend).encode("utf-8")).hexdigest()
    assert d["source_fingerprint"] == f"sha256:{want}"


def test_provenance_is_stable_across_calls_and_processes():
    first, second = _linear_record(), _linear_record()
    assert first == second
    code = (
        "import json, torch\n"
        "from rl_engine.ops import gemm\n"
        "from rl_engine.runtime import provenance\n"
        "with provenance.record() as calls:\n"
        "    gemm.linear(torch.randn(3, 8), torch.randn(2, 8))\n"
        "print(json.dumps(calls[0].as_dict()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == first.as_dict()


def test_provenance_summarize_counts_calls():
    x, w = torch.randn(3, 8), torch.randn(2, 8)
    with provenance.record() as calls:
        for _ in range(3):
            gemm.linear(x, w)
    summary = provenance.summarize(calls)
    assert len(summary) == 1 and summary[0]["calls"] == 3 and summary[0]["impl_id"] == "cpu.exact_sum"


def test_provenance_blocks_nest_and_restore_on_exceptions():
    x, w = torch.randn(3, 8), torch.randn(2, 8)
    assert not provenance.active()
    with provenance.record() as outer:
        gemm.linear(x, w)
        with provenance.record() as inner:
            gemm.linear(x, w)
        gemm.linear(x, w)
        with pytest.raises(RuntimeError, match="boom"):
            with provenance.record() as failed:
                gemm.linear(x, w)
                raise RuntimeError("boom")
        gemm.linear(x, w)
        assert provenance.active()
    assert not provenance.active()
    assert len(inner) == 1  # only the call inside it
    assert len(failed) == 1  # the sink stops receiving once its block exited (also by an exception)
    assert len(outer) == 5  # inner blocks' records also reach the outer one
    gemm.linear(x, w)
    assert len(outer) == 5


# ---- policy -------------------------------------------------------------------------------------


def test_policy_nests_and_restores_on_exceptions():
    assert current_policy() == "strict"
    with use_policy("diagnostic") as p:
        assert p == current_policy() == "diagnostic"
        with use_policy("strict"):
            assert current_policy() == "strict"
        assert current_policy() == "diagnostic"
        with pytest.raises(ValueError, match="inner"):
            with use_policy("strict"):
                raise ValueError("inner")
        assert current_policy() == "diagnostic"
    assert current_policy() == "strict"


def test_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"^policy: expected one of \('strict', 'diagnostic'\), got 'lenient'"):
        with use_policy("lenient"):  # type: ignore[arg-type]
            pass
    assert current_policy() == "strict"


# ---- eligibility is pure --------------------------------------------------------------------------


def test_eligibility_checks_are_pure(fake_op):
    seen: list[Request] = []

    def never_called(*args, **kwargs):
        raise AssertionError("select() must not run an implementation")

    def call_check(req: Request) -> list[str]:
        seen.append(req)
        return [] if req.features.get("K", 0) % 16 == 0 else ["K not a multiple of 16"]

    register(make_impl("pure.checked", fn=never_called, call_check=call_check))
    before = list(registry._REGISTRY[TEST_OP])
    req = _request(torch.float32, features={"K": 32})
    snapshot = (req.op, req.platform, req.dtype, req.requires, dict(req.features))
    first = select(req)
    second = select(req)
    assert first[0].impl_id == second[0].impl_id == "pure.checked" and first[1] == second[1] == []
    assert seen == [req]  # the second answer comes from select's cache
    assert (req.op, req.platform, req.dtype, req.requires, dict(req.features)) == snapshot
    assert registry._REGISTRY[TEST_OP] == before
    impl, rejections = select(replace(req, features={"K": 33}))
    assert impl is None and rejections == [("pure.checked", ["K not a multiple of 16"])]


def test_select_caches_answers_until_the_registry_changes(fake_op, monkeypatch):
    """``select`` answers a repeated request from its cache; registering an implementation, or
    replacing the operator's list, recomputes; an unhashable feature is never cached; callers get
    copies of the rejections."""
    seen: list[Request] = []

    def call_check(req: Request) -> list[str]:
        seen.append(req)
        return ["K odd"] if req.features.get("K", 0) % 2 else []

    register(make_impl("cache.z", priority=50))
    register(make_impl("cache.a", priority=10, call_check=call_check))
    req = _request(torch.float32, features={"K": 3})
    impl, rejections = select(req)
    assert impl.impl_id == "cache.z" and rejections == [("cache.a", ["K odd"])]
    rejections[0][1].clear()  # a caller's copy: the cached answer keeps its rejections
    impl2, rejections2 = select(req)
    assert impl2 is impl and rejections2 == [("cache.a", ["K odd"])] and len(seen) == 1
    # a new registration makes a new list: the next select recomputes and sees it
    register(make_impl("cache.b", priority=20))
    assert select(req)[0].impl_id == "cache.b" and len(seen) == 2
    # so does a replaced list (a test's monkeypatch of the registry)
    saved = registry._REGISTRY[TEST_OP]
    registry._REGISTRY[TEST_OP] = []
    try:
        assert select(req) == (None, [])
    finally:
        registry._REGISTRY[TEST_OP] = saved
    # unhashable feature values: computed every time
    register(make_impl("cache.c", priority=0, call_check=call_check))
    odd = _request(torch.float32, features={"K": 3, "shape": [3, 4]})
    n = len(seen)
    assert select(odd)[0].impl_id == "cache.b" and select(odd)[0].impl_id == "cache.b"
    assert len(seen) == n + 4  # cache.c and cache.a checked on each of the two calls
    # bounded: past _SELECTED_MAX answers the cache starts again, and answers stay right
    monkeypatch.setattr(registry, "_SELECTED_MAX", 3)
    for k in range(8):
        assert select(_request(torch.float32, features={"K": 2 * k}))[0].impl_id == "cache.c"
        assert len(registry._SELECTED) <= 3


def test_make_request_hands_out_one_request_per_kind_of_call(fake_op):
    """Equal calls get the same request object (read-only features) and its selection by identity;
    different features, dtypes or variants get their own; an explicit ``requires`` or an unhashable
    feature builds afresh; a registry change still recomputes the cached request's answer."""
    x = torch.zeros(2, 3)
    register(make_impl("kind.a", priority=10))
    r1 = make_request(TEST_OP, x, features={"K": 3, "N": 8})
    assert make_request(TEST_OP, x, features={"K": 3, "N": 8}) is r1
    with pytest.raises(TypeError):
        r1.features["K"] = 4  # shared: callers cannot change it under the others
    assert make_request(TEST_OP, x, features={"K": 4, "N": 8}) is not r1
    assert make_request(TEST_OP, x.bfloat16(), features={"K": 3, "N": 8}) is not r1
    assert make_request(TEST_OP, x, features={"K": 3, "N": 8}, variants=frozenset({"v"})) is not r1
    assert make_request(TEST_OP, x, features={"K": 3, "N": 8}, requires=frozenset({"row"})) is not r1
    odd = make_request(TEST_OP, x, features={"shape": [3, 4]})
    assert make_request(TEST_OP, x, features={"shape": [3, 4]}) is not odd and odd.features == {"shape": [3, 4]}
    assert select(r1)[0].impl_id == "kind.a"
    register(make_impl("kind.b", priority=5))
    assert select(r1)[0].impl_id == "kind.b"


def test_shipped_eligibility_runs_no_tensor_operation():
    """Selecting the shipped linear implementation executes no aten op (no allocation, no compute)."""
    from torch.profiler import ProfilerActivity, profile

    implementations("gemm.linear")
    req = make_request("gemm.linear", torch.empty(0, dtype=torch.bfloat16), features={"K": 64, "N": 8, "bias": False})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        impl, _ = select(req)
        impl.reject_reasons(req)
        impl.unavailable_reasons()
    assert impl.impl_id == "cpu.exact_sum"
    ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert ops == []


# ---- priority order -------------------------------------------------------------------------------


def test_priority_number_orders_eligible_implementations(fake_op):
    register(make_impl("p30", priority=30))
    register(make_impl("p10", priority=10, call_check=lambda req: ["too large"] if req.features.get("big") else []))
    register(make_impl("p20b", priority=20))
    register(make_impl("p20a", priority=20))
    assert [i.impl_id for i in implementations(TEST_OP)] == ["p10", "p20a", "p20b", "p30"]
    assert select(_request())[0].impl_id == "p10"
    impl, rejections = select(_request(features={"big": True}))
    assert impl.impl_id == "p20a"  # equal priority: impl_id order
    assert rejections == [("p10", ["too large"])]


def test_backend_package_order_comes_before_priority_numbers(fake_op):
    both = ("cpu", "cuda")
    register(make_impl("cpu.fast", priority=1, families=both, module="rl_engine.backends.cpu.rlktest"))
    register(make_impl("triton.gemm", priority=50, families=both, module="rl_engine.backends.triton.rlktest"))
    register(make_impl("cuda.special", priority=5, families=both, module="rl_engine.backends.cuda.rlktest"))
    register(make_impl("elsewhere", priority=0, families=both))  # not in a backend package: last
    impl, rejections = select(_request(platform=CUDA_PLATFORM))
    assert impl.impl_id == "triton.gemm" and rejections == []
    # on CUDA the order is shared/triton, cuda, cpu, then anything else
    order = [i.impl_id for i in sorted(
        implementations(TEST_OP),
        key=lambda i: (registry.BACKEND_PACKAGES["cuda"].index(next(p for p in registry.BACKEND_PACKAGES["cuda"] if i.module.startswith(p)))
                       if any(i.module.startswith(p) for p in registry.BACKEND_PACKAGES["cuda"]) else 99, i.priority),
    )]
    assert order == ["triton.gemm", "cuda.special", "cpu.fast", "elsewhere"]
    # on the CPU only the cpu package is in the order; the rest follow by priority number
    assert select(_request())[0].impl_id == "cpu.fast"


def test_reregistering_replaces(fake_op):
    register(make_impl("same", version="1"))
    register(make_impl("same", version="2"))
    impls = implementations(TEST_OP)
    assert [(i.impl_id, i.version) for i in impls] == [("same", "2")]


def test_every_shipped_implementation_lives_in_a_backend_package():
    """``Implementation.module`` names the module that defines the code (also for a
    ``torch.library.custom_op``, whose own ``__module__`` is torch's): provenance fingerprints it
    and dispatch orders backend packages by it."""
    packages = set(registry._ALL_PACKAGES)
    seen = 0
    for op in contracts.all_contracts():
        for impl in implementations(op):
            seen += 1
            assert any(impl.module == p or impl.module.startswith(p + ".") for p in packages), (op, impl.impl_id, impl.module)
            assert impl.module in sys.modules
    assert seen >= 1
