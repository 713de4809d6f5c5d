"""Contract-aware registry and dispatch.

An :class:`Implementation` declares, as data, where it can run (platform families, dtypes) and
which invariances it guarantees; it may add a static availability probe (is the compiler
installed?) and a per-call eligibility check (shapes, layout). Both are *pure*: they never
compile, allocate, switch devices or mutate.

Dispatch of one call::

    request = Request(op, platform_of(x), x.dtype, requires=contract.guarantees_on(family), features={...})
    impl = first eligible implementation in priority order (lower number first)
    strict policy, none eligible  -> NoEligibleImplementation listing every rejection reason
    diagnostic policy, none       -> the float64 reference, recorded as a fallback
    provenance records the choice when a provenance.record() block is active
    impl.fn(*args)                -> a custom op's body directly in a plain no-grad eager call,
                                     the op otherwise (rl_engine.runtime.custom_ops)

Backends are imported lazily, the first time an operator family is dispatched or listed, so
``import rl_engine`` imports none of them.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from rl_engine import contracts
from rl_engine.platforms import Platform
from rl_engine.runtime import policy as _policy
from rl_engine.runtime import provenance as _prov
from rl_engine.runtime.custom_ops import eager_entry, is_custom_op

__all__ = [
    "Request",
    "Implementation",
    "NoEligibleImplementation",
    "register",
    "register_reference",
    "implementations",
    "reference_for",
    "select",
    "dispatch",
    "checks_indices",
    "BACKEND_PACKAGES",
]

# Explicit priority of backend packages per platform family. The first listed package's
# implementations get the lowest priority numbers unless they set their own.
BACKEND_PACKAGES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "cuda": ("rl_engine.backends.triton", "rl_engine.backends.cuda", "rl_engine.backends.cpu"),
        "rocm": ("rl_engine.backends.triton", "rl_engine.backends.rocm", "rl_engine.backends.cpu"),
        "cpu": ("rl_engine.backends.cpu",),
    }
)
_ALL_PACKAGES = ("rl_engine.backends.cpu", "rl_engine.backends.triton", "rl_engine.backends.cuda", "rl_engine.backends.rocm")


@dataclass(frozen=True)
class Request:
    """What one call needs: operator, device platform, dtype, required invariances, features."""

    op: str
    platform: Platform
    dtype: torch.dtype
    requires: frozenset[str]
    features: Mapping[str, Any] = field(default_factory=dict)
    #: contract variants the call uses (``OperatorContract.variants``)
    variants: frozenset[str] = frozenset()


@dataclass(frozen=True, eq=False)
class Implementation:
    """One registered implementation of one operator.

    Attributes:
        op: operator id (``"gemm.linear"``).
        impl_id: unique id within the operator (``"cpu.exact_sum"``).
        version: bumped whenever the arithmetic changes (recorded in provenance).
        fn: the callable; same signature as the operator's reference.
        families: platform families it runs on (``("cpu",)``).
        dtypes: dtypes it accepts.
        guarantees: invariances it guarantees (names from the invariance vocabulary).
        priority: lower runs first among eligible implementations.
        static_check: ``() -> list[str]``, reasons it is unavailable in this process.
        call_check: ``(Request) -> list[str]``, reasons it cannot take this call.
        untested_families: families declared eligible from the same source but not validated.
        variants: contract variants it implements (names from the contract's ``variants``).
        device_index_checks: its kernels bound-check the operator's index arguments (token ids,
            targets) where they read them, stopping at a device-side assertion on an
            out-of-range index, so an entry point that cannot read the indices back (a GPU under
            the default NaN policy) need not launch a separate check (:func:`checks_indices`).
    """

    op: str
    impl_id: str
    version: str
    fn: Callable[..., Any]
    families: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    guarantees: frozenset[str]
    priority: int = 100
    static_check: Callable[[], list[str]] | None = None
    call_check: Callable[[Request], list[str]] | None = None
    untested_families: tuple[str, ...] = ()
    variants: frozenset[str] = frozenset()
    device_index_checks: bool = False

    @property
    def module(self) -> str:
        """Module that defines ``fn`` (provenance fingerprints it; dispatch orders by it).

        A ``torch.library.custom_op`` object reports torch's own module as ``__module__``; the
        module of the Python function it wraps is the one that holds the implementation.
        """
        return getattr(self.fn, "_init_fn", self.fn).__module__

    def unavailable_reasons(self) -> list[str]:
        return list(self.static_check()) if self.static_check is not None else []

    def reject_reasons(self, request: Request) -> list[str]:
        """Every reason this implementation cannot take ``request`` (empty: eligible)."""
        reasons = self.unavailable_reasons()
        if request.platform.family not in self.families:
            reasons.append(f"platform family {request.platform.family!r} not in {list(self.families)}")
        if request.dtype not in self.dtypes:
            reasons.append(f"dtype {request.dtype} not in {[str(d) for d in self.dtypes]}")
        missing = request.requires - self.guarantees
        if missing:
            reasons.append(f"does not guarantee invariances {sorted(missing)}")
        absent = request.variants - self.variants
        if absent:
            reasons.append(f"does not implement contract variants {sorted(absent)}")
        if not reasons and self.call_check is not None:
            reasons.extend(self.call_check(request))
        return reasons


class NoEligibleImplementation(RuntimeError):
    """Strict policy: no registered implementation covers the request."""

    def __init__(self, request: Request, rejections: list[tuple[str, list[str]]]):
        self.request = request
        self.rejections = rejections
        lines = [
            f"no implementation of {request.op!r} is eligible for dtype={request.dtype}, "
            f"platform={request.platform.key}, requires={sorted(request.requires)} (policy=strict)"
        ]
        if not rejections:
            lines.append("  (no implementation is registered for this operator)")
        for impl_id, reasons in rejections:
            lines.append(f"  {impl_id}: " + "; ".join(reasons))
        lines.append("Use rl_engine.runtime.use_policy('diagnostic') to fall back to the float64 reference.")
        super().__init__("\n".join(lines))


_REGISTRY: dict[str, list[Implementation]] = {}
_REFERENCES: dict[str, Callable[..., Any]] = {}
_LOADED_FAMILIES: set[str] = set()


def register(impl: Implementation) -> Implementation:
    """Add ``impl`` to the registry. Re-registering the same ``(op, impl_id)`` replaces it.

    An ``fn`` that is a ``torch.library`` custom op is stored as its eager entry
    (:func:`rl_engine.runtime.custom_ops.eager_entry`): a plain no-grad eager call runs the op's
    body directly, every other call (autograd, ``torch.compile``, fake tensors, dispatch modes)
    the op. Returns the stored implementation."""
    contract = contracts.load_contract(impl.op)  # an implementation of an operator without a contract is a bug
    unknown = set(impl.variants) - set(contract.variants)
    if unknown:
        raise ValueError(f"variants: {impl.impl_id} declares {sorted(unknown)}, which the {impl.op} contract does not "
                         f"define (known: {sorted(contract.variants)})")
    if is_custom_op(impl.fn):
        impl = replace(impl, fn=eager_entry(impl.fn))
    impls = [i for i in _REGISTRY.get(impl.op, []) if i.impl_id != impl.impl_id]
    impls.append(impl)
    impls.sort(key=lambda i: (i.priority, i.impl_id))
    _REGISTRY[impl.op] = impls
    return impl


def register_reference(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` is the float64 reference of ``op`` (the diagnostic fallback)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REFERENCES[op] = fn
        return fn

    return deco


def _family_of(op: str) -> str:
    return op.split(".", 1)[0]


def _load(op: str) -> None:
    family = _family_of(op)
    if family in _LOADED_FAMILIES:
        return
    for pkg in (*_ALL_PACKAGES, "rl_engine.reference"):
        name = f"{pkg}.{family}"
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            importlib.import_module(name)
    _LOADED_FAMILIES.add(family)


def implementations(op: str) -> list[Implementation]:
    """Registered implementations of ``op`` in priority order (loads its backends)."""
    _load(op)
    return list(_REGISTRY.get(op, []))


def reference_for(op: str) -> Callable[..., Any]:
    _load(op)
    if op not in _REFERENCES:
        raise KeyError(f"op: no reference registered for {op!r}")
    return _REFERENCES[op]


#: ``select``'s answers: (op, platform, dtype, requires, features) -> (the op's implementation list
#: they were computed from, implementation, rejections). Eligibility is pure in the request (static
#: probes are per process, call checks read only the request), so an answer holds while the op's
#: list is the same object: ``register`` and any replacement of ``_REGISTRY[op]`` make a new one.
_SELECTED: dict[tuple, tuple[list[Implementation], Implementation | None, list[tuple[str, list[str]]]]] = {}
_SELECTED_MAX = 4096
#: The same answers keyed by the request object (``id(request) -> (request, op's implementation
#: list, implementation, rejections)``): :func:`make_request` hands out one request object per
#: kind of call, so the hot path skips building and hashing the key above.
_BY_REQUEST: dict[int, tuple[Request, list[Implementation], Implementation | None, list[tuple[str, list[str]]]]] = {}


def _select_key(request: Request) -> tuple | None:
    """``request`` as a cache key, or ``None`` where a feature value is unhashable."""
    try:
        key = (request.op, request.platform, request.dtype, request.requires, request.variants,
               tuple(sorted(request.features.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _selected(request: Request) -> tuple[Implementation | None, list[tuple[str, list[str]]]]:
    """:func:`select` without copying the cached rejections (callers must not mutate them)."""
    hit = _BY_REQUEST.get(id(request))
    if hit is not None and hit[0] is request and hit[1] is _REGISTRY.get(request.op):
        return hit[2], hit[3]
    _load(request.op)
    key = _select_key(request)
    if key is not None:
        hit = _SELECTED.get(key)
        if hit is not None and hit[0] is _REGISTRY.get(request.op):
            return hit[1], hit[2]
    impl, rejections = _select(request)
    if key is not None and request.op in _REGISTRY:
        if len(_SELECTED) >= _SELECTED_MAX:  # features such as a step's token count vary: stay bounded
            _SELECTED.clear()
        _SELECTED[key] = (_REGISTRY[request.op], impl, [(i, list(r)) for i, r in rejections])
        if len(_BY_REQUEST) >= _SELECTED_MAX:
            _BY_REQUEST.clear()
        # the entry holds the request, so its id is not reused while the entry lives
        _BY_REQUEST[id(request)] = (request, _REGISTRY[request.op], impl, _SELECTED[key][2])
    return impl, rejections


def select(request: Request) -> tuple[Implementation | None, list[tuple[str, list[str]]]]:
    """The first eligible implementation for ``request`` and the rejections before it.

    Answers are cached per request (a dispatch costs a dictionary lookup after the first call of
    each kind; eager decode steps call an operator per layer and token), and recomputed after
    any change to the operator's registered implementations."""
    impl, rejections = _selected(request)
    return impl, [(i, list(r)) for i, r in rejections]


def _select(request: Request) -> tuple[Implementation | None, list[tuple[str, list[str]]]]:
    rejections: list[tuple[str, list[str]]] = []
    order = BACKEND_PACKAGES.get(request.platform.family, ())
    candidates = sorted(
        implementations(request.op),
        key=lambda i: (
            next((k for k, p in enumerate(order) if i.module.startswith(p)), len(order)),
            i.priority,
            i.impl_id,
        ),
    )
    for impl in candidates:
        reasons = impl.reject_reasons(request)
        if not reasons:
            return impl, rejections
        rejections.append((impl.impl_id, reasons))
    return None, rejections


#: ``(op, platform family) -> required invariances`` of the op's contract on that family.
_REQUIRES: dict[tuple[str, str], frozenset[str]] = {}
#: :func:`make_request`'s requests: ``(op, device, dtype, variants, features items) -> Request``.
_REQUESTS: dict[tuple, Request] = {}
#: ``device -> Platform`` for the devices seen (a device's platform never changes in a process).
_PLATFORMS: dict[torch.device, Any] = {}


def make_request(op: str, device_tensor: torch.Tensor, *, features: Mapping[str, Any] | None = None,
                 requires: frozenset[str] | None = None, variants: frozenset[str] = frozenset()) -> Request:
    """Build the :class:`Request` for a call whose device and dtype are those of ``device_tensor``
    (``variants``: the contract variants the call uses).

    The platform of a device and the invariances an op's contract requires on a platform family
    are looked up once per process (both are fixed for its lifetime), so building a request costs
    two dictionary lookups on the hot path. Without an explicit ``requires``, the request itself
    is cached per ``(op, device, dtype, variants, features)`` (in the order given) and handed out
    again with read-only features, so :func:`dispatch` finds its answer by the object's identity."""
    device = device_tensor.device
    key = None
    if requires is None:
        key = (op, device, device_tensor.dtype, variants, tuple(features.items()) if features else ())
        try:
            hit = _REQUESTS.get(key)
        except TypeError:  # an unhashable feature value: built afresh every call
            key = hit = None
        if hit is not None:
            return hit
    platform = _PLATFORMS.get(device)
    if platform is None:
        from rl_engine.platforms import platform_of

        platform = _PLATFORMS.setdefault(device, platform_of(device))
    if requires is None:
        requires = _REQUIRES.get((op, platform.family))
        if requires is None:
            requires = _REQUIRES.setdefault((op, platform.family), contracts.load_contract(op).guarantees_on(platform.family))
    if key is None:
        return Request(op=op, platform=platform, dtype=device_tensor.dtype, requires=requires,
                       features=dict(features) if features else {}, variants=variants)
    request = Request(op=op, platform=platform, dtype=device_tensor.dtype, requires=requires,
                      features=MappingProxyType(dict(features) if features else {}), variants=variants)
    if len(_REQUESTS) >= _SELECTED_MAX:
        _REQUESTS.clear()
    _REQUESTS[key] = request
    return request


def checks_indices(request: Request) -> bool:
    """Whether the implementation ``request`` selects bound-checks its index arguments in its own
    kernels (``Implementation.device_index_checks``). False when none is selected (the
    diagnostic fallback, or an error :func:`dispatch` raises)."""
    impl, _ = _selected(request)
    return impl is not None and impl.device_index_checks


def dispatch(request: Request, *args: Any, **kwargs: Any) -> Any:
    """Run ``request.op`` on the first eligible implementation (see module docstring)."""
    impl, rejections = _selected(request)
    pol = _policy.current_policy()
    if impl is not None:
        fn, impl_id, version, module, fallback = impl.fn, impl.impl_id, impl.version, impl.module, False
    elif pol == "diagnostic":
        fn = reference_for(request.op)
        impl_id, version, module, fallback = "reference.float64", "1", fn.__module__, True
    else:
        raise NoEligibleImplementation(request, [(i, list(r)) for i, r in rejections])
    if _prov.active():
        _prov.emit(
            _prov.ProvenanceRecord(
                op=request.op,
                impl_id=impl_id,
                impl_version=version,
                platform=request.platform.key,
                source_fingerprint=_prov.source_fingerprint(module),
                policy=pol,
                fallback=fallback,
                contract_version=contracts.load_contract(request.op).version,
                requested=tuple(sorted(request.requires)),
            )
        )
    return fn(*args, **kwargs)
