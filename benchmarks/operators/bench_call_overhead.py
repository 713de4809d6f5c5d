"""Host cost of one small call through the public API, next to the native torch call.

What a user's eager loop pays per call is the host work: argument checks, dispatch, launches. At
tiny shapes that is all there is, so this times each operator at decode-like sizes (one token
row) three ways, interleaved in one process:

* ``native``  the torch call an engine would make (``F.linear``, ``F.rms_norm``, SDPA, ...);
* ``public``  the ``rl_engine.ops`` entry point under the default NaN policy (as users call it);
* ``impl``    the implementation the registry selects for that call, called directly (its
  registered entry and kernels, without the entry point's checks and dispatch: the op's body
  where nothing needs the custom-op layer, as in these no-grad calls);
* ``entry``   the public call while the registry's selection answers with the implementation's
  output for these arguments, computed once (:func:`entry_only`): the entry point's checks,
  request and dispatch alone, without the implementation's work;
* ``composed`` the ``entry`` call, then the ``impl`` call: the public call's work in two pieces;
* ``unscanned`` the public call under ``nan_policy("propagate")``: without the host NaN scan of
  its activations, the one piece of the entry point's work that runs torch operations;
* ``op_layer`` the public call with every implementation called through its ``torch.library``
  custom op (:func:`op_layer_kept`), as a call that records a gradient is: what the direct eager
  path (:mod:`rl_engine.runtime.custom_ops`) saves, in the same run.

Each row's ``extra`` carries ``overhead_us`` (public − impl: what the entry point adds to a
call), ``unscanned_overhead_us`` (unscanned − impl: the same without the NaN scan),
``entry_us`` (the ``entry`` call: the entry point's own work, timed alone), ``op_layer_us`` and
``direct_saving_us`` (op_layer − public: the custom-op layer's cost per public call, which the
direct path does not pay), ``composed_us``
and ``interaction_us`` (composed − entry − impl: what the two pieces cost together beyond their
separate times; where ``composed_us`` ≈ ``public_us``, the public call does no work beyond the
two pieces, and an ``overhead_us`` above ``entry_us`` is that interaction) and ``excess_us``
(public − native). The attention rows are the engine-facing step APIs:
``paged_attention_step`` of a planned step over an engine's paged cache, and
``cached_attention_step``, one layer of a planned step over rl_engine's own caches (its row is
the per-layer cost of an 8-layer step, plan included, after the caches' state is restored).

Times come from :func:`benchmarks.common.harness.host_call_samples` (on CUDA the device is kept
busy so the loop measures the host, and a synchronising call stands out). The issue's targets
(``overhead_us`` ≤ 15 µs for the row-wise ops, linear and token_logprobs; public − SDPA ≤ 40 µs
for the attention steps) are checked and reported per row (``meets_target``), not asserted.

    python benchmarks/operators/bench_call_overhead.py --device cpu --out overhead_cpu.json
    python benchmarks/operators/bench_call_overhead.py --device cuda --out overhead_cuda.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common.harness import (  # noqa: E402
    device_info,
    host_call_samples,
    machine_load,
    make_row,
    summarize,
    versions,
    write_report,
)
from rl_engine import ops  # noqa: E402
from rl_engine.runtime import registry  # noqa: E402
from rl_engine.runtime.registry import make_request, select  # noqa: E402
from rl_engine.utils.checks import nan_policy  # noqa: E402

#: Target (µs) per case: on ``public − impl`` where the case has an implementation row, else on
#: ``public − native``.
TARGET_US = {"attention": 40.0}
DEFAULT_TARGET_US = 15.0


def _impl(op: str, device_tensor: torch.Tensor, features: dict) -> Callable:
    impl, _ = select(make_request(op, device_tensor, features=features))
    if impl is None:
        raise RuntimeError(f"{op}: no eligible implementation on {device_tensor.device}")
    return impl.fn


@contextlib.contextmanager
def entry_only(op: str, answer: Any) -> Iterator[None]:
    """While active, the registry's selection for ``op`` runs a function that returns ``answer``
    (the implementation's output for the timed arguments) in place of the implementation: a public
    call then costs its checks, request building, selection and dispatch only. Other operators are
    untouched; the registry's selection function is restored in ``finally``."""
    real = registry._selected
    stubs: dict[int, Any] = {}

    def selected(request):
        impl, rejections = real(request)
        if impl is None or request.op != op:
            return impl, rejections
        stub = stubs.get(id(impl))
        if stub is None:
            stub = stubs[id(impl)] = dataclasses.replace(impl, fn=lambda *a, **k: answer)
        return stub, rejections

    registry._selected = selected
    try:
        yield
    finally:
        registry._selected = real


def _entry(op: str, public: Callable[[], Any]) -> Callable[[], Any]:
    """The ``entry`` variant of a case: ``public``, timed under :func:`entry_only` (its ``scope``:
    ``main`` enters it around each timed loop, not per call), its answer computed by one real
    call."""

    def run():
        return public()

    run.entry_op, run.answer = op, public()  # type: ignore[attr-defined]
    run.scope = lambda: entry_only(run.entry_op, run.answer)  # type: ignore[attr-defined]
    return run


def _composed(entry: Callable[[], Any], impl: Callable[[], Any]) -> Callable[[], Any]:
    """The ``composed`` variant: ``entry`` (timed under the same :func:`entry_only` scope), then
    ``impl``."""

    def run():
        entry()
        return impl()

    run.entry_op, run.answer = entry.entry_op, entry.answer  # type: ignore[attr-defined]
    run.scope = lambda: entry_only(run.entry_op, run.answer)  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def op_layer_kept() -> Iterator[None]:
    """While active, no call takes the direct eager path: every registered entry and ``call_op``
    calls its custom op (``rl_engine.runtime.custom_ops.direct_call_ok`` answers ``False``; its
    own check, some 0.5 µs, is then not paid). Restored in ``finally``."""
    from rl_engine.runtime import custom_ops

    real = custom_ops.direct_call_ok
    custom_ops.direct_call_ok = lambda args, kwargs=None: False
    try:
        yield
    finally:
        custom_ops.direct_call_ok = real


def _op_layer(public: Callable[[], Any]) -> Callable[[], Any]:
    """The ``op_layer`` variant: ``public`` timed under :func:`op_layer_kept` (its ``scope``)."""

    def run():
        return public()

    run.scope = op_layer_kept  # type: ignore[attr-defined]
    return run


def _unscanned(public: Callable[[], Any]) -> Callable[[], Any]:
    """The ``unscanned`` variant: ``public`` timed under ``nan_policy("propagate")`` (its
    ``scope``, entered around each timed loop)."""

    def run():
        return public()

    run.scope = lambda: nan_policy("propagate")  # type: ignore[attr-defined]
    return run


def cases(device: str, dtype: torch.dtype, H: int = 1024, heads: int = 8, kv_heads: int = 2, D: int = 128,
          ctx: int = 256, vocab: int = 512) -> dict[str, dict[str, Callable]]:
    """``case -> {"native", "public", "entry", "impl"}`` callables at one token row."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = rnd(1, H)
    w = rnd(H, H, scale=H ** -0.5)
    nw = rnd(H).abs() + 0.5
    gu = rnd(1, 2 * H)
    ids = torch.tensor([3], device=device)
    table = rnd(512, H)
    logits = rnd(1, vocab).float()
    tgt = torch.tensor([7], device=device)
    q = rnd(1, heads, D)
    kn, vn = rnd(1, kv_heads, D), rnd(1, kv_heads, D)
    pos = torch.tensor([ctx - 1], device=device)
    from rl_engine.utils.rope_tables import rope_cos_sin

    cos, sin = (t.to(device) for t in rope_cos_sin(pos.cpu(), D, 1e6))

    def rope_native():
        x1, x2 = q[..., : D // 2], q[..., D // 2:]
        c = cos[:, None, :].to(dtype)
        s_ = sin[:, None, :].to(dtype)
        return torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)

    out = {
        "linear": {
            "native": lambda: F.linear(x, w),
            "public": lambda: ops.gemm.linear(x, w),
            "entry": _entry("gemm.linear", lambda: ops.gemm.linear(x, w)),
            "impl": (lambda f: lambda: f(x, w, None))(_impl("gemm.linear", x, {"K": H, "N": H, "bias": False})),
        },
        "rms_norm": {
            "native": lambda: F.rms_norm(x, (H,), nw, 1e-6),
            "public": lambda: ops.norm.rms_norm(x, nw, 1e-6),
            "entry": _entry("norm.rms_norm", lambda: ops.norm.rms_norm(x, nw, 1e-6)),
            "impl": (lambda f: lambda: f(x, nw, 1e-6))(_impl("norm.rms_norm", x, {"H": H})),
        },
        "silu_and_mul": {
            "native": lambda: F.silu(gu[:, :H]) * gu[:, H:],
            "public": lambda: ops.activation.silu_and_mul(gu),
            "entry": _entry("activation.silu_and_mul", lambda: ops.activation.silu_and_mul(gu)),
            "impl": (lambda f: lambda: f(gu))(_impl("activation.silu_and_mul", gu, {})),
        },
        "apply_rope": {
            "native": rope_native,
            "public": lambda: ops.rope.apply_rope(q, pos, theta=1e6),
            "entry": _entry("rope.apply_rope", lambda: ops.rope.apply_rope(q, pos, theta=1e6)),
            "impl": (lambda f: lambda: f(q, pos, 1e6, D))(_impl("rope.apply_rope", q, {"D": D, "rotary_dim": D})),
        },
        "embedding": {
            "native": lambda: F.embedding(ids, table),
            "public": lambda: ops.embedding.embedding(ids, table),
            "entry": _entry("embedding.embedding", lambda: ops.embedding.embedding(ids, table)),
            "impl": (lambda f: lambda: f(ids, table))(_impl("embedding.embedding", table, {"H": H})),
        },
        "token_logprobs": {
            "native": lambda: torch.log_softmax(logits, -1).gather(-1, tgt[:, None]),
            "public": lambda: ops.logprob.token_logprobs(logits, tgt),
            "entry": _entry("logprob.token_logprobs", lambda: ops.logprob.token_logprobs(logits, tgt)),
            "impl": (lambda f: lambda: f(logits, tgt, 1.0))(
                _impl("logprob.token_logprobs", logits, {"V": logits.shape[-1], "kept": False})),
        },
    }
    for fns in out.values():
        fns["composed"] = _composed(fns["entry"], fns["impl"])
        fns["unscanned"] = _unscanned(fns["public"])
        fns["op_layer"] = _op_layer(fns["public"])
    out.update(_attention_cases(device, dtype, q, kn, vn, heads, kv_heads, D, ctx, rnd))
    return out


def neutral_cases(impl: Callable[[], Any], x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Controls for ``interaction_us``: neutral work of three kinds, alone and before each call of
    ``impl`` — pure-Python integer arithmetic, four reductions of ``x`` and four small
    allocations. Where ``kind+impl`` costs more than ``kind`` and ``impl`` apart, the extra comes
    from running other work between two implementation calls, whatever that work is."""

    def python():
        s = 0
        for i in range(180):
            s += i
        return s

    def reductions():
        for _ in range(4):
            x.sum()

    def allocations():
        for _ in range(4):
            torch.empty(256, device=x.device)

    out: dict[str, Callable[[], Any]] = {"impl": impl}
    for name, work in (("python", python), ("reductions", reductions), ("allocations", allocations)):
        out[name] = work
        out[f"{name}+impl"] = (lambda w: lambda: (w(), impl())[1])(work)
    return out


#: the benchmark's own custom operators (:func:`dispatch_cases`), registered on first use
_DISPATCH_OPS: dict[str, Any] = {}


def dispatch_cases(x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Controls for the custom-operator layer every implementation is called through: one
    function (a copy of ``x``) called directly (``function``), as a ``torch.library`` custom
    operator (``custom_op``) and as one with an autograd formula, called on a tensor that needs
    no gradient (``custom_op_autograd``, how rl_engine's operators are wired). ``custom_op`` minus
    ``function`` is what the dispatcher adds to each implementation call, whatever it computes."""
    if not _DISPATCH_OPS:
        def copy_row(t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        plain = torch.library.custom_op("rlk_bench::copy_row", copy_row, mutates_args=())
        plain.register_fake(lambda t: torch.empty_like(t))
        graded = torch.library.custom_op("rlk_bench::copy_row_autograd", copy_row, mutates_args=())
        graded.register_fake(lambda t: torch.empty_like(t))
        graded.register_autograd(lambda ctx, g: g)
        _DISPATCH_OPS.update(function=copy_row, custom_op=plain, custom_op_autograd=graded)
    return {name: (lambda f: lambda: f(x))(f) for name, f in _DISPATCH_OPS.items()}


def _attention_cases(device, dtype, q, kn, vn, heads, kv_heads, D, ctx, rnd) -> dict[str, dict[str, Callable]]:
    attn = ops.attention
    bs = 16
    blocks = -(-ctx // bs)
    kc, vc = rnd(blocks, bs, kv_heads, D), rnd(blocks, bs, kv_heads, D)
    host = dict(slot_mapping=torch.tensor([ctx - 1]), block_table=torch.arange(blocks)[None, :],
                cu_seqlens_q=torch.tensor([0, 1]), seq_lens=torch.tensor([ctx]))
    dev = {k: v.to(device) for k, v in host.items()}
    plan = attn.plan_paged_attention(dev["slot_mapping"], dev["block_table"], bs, dev["cu_seqlens_q"], dev["seq_lens"],
                                     num_blocks=blocks)
    kf = kc.reshape(1, blocks * bs, kv_heads, D).transpose(1, 2)[:, :, :ctx]
    vf = vc.reshape(1, blocks * bs, kv_heads, D).transpose(1, 2)[:, :, :ctx]
    qs = q[None].transpose(1, 2)
    rep = heads // kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(qs, kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1))

    layers = 8
    caches = [attn.ContiguousKVCache(1, ctx + 1, kv_heads, D, dtype=dtype, device=device) for _ in range(layers)]
    fill_k, fill_v = rnd(ctx - 1, kv_heads, D), rnd(ctx - 1, kv_heads, D)
    for c in caches:
        c.extend(0, fill_k, fill_v)
    snaps = [c.snapshot() for c in caches]
    cu = torch.tensor([0, 1], device=device)

    def planned_step(n_layers: int):
        def run():
            for c, s in zip(caches, snaps):
                c.restore(s)
            p = attn.plan_cached_attention(caches[:n_layers], [0], cu)
            for i in range(n_layers):
                attn.cached_attention_step(q, kn, vn, caches[i], p)
        return run

    return {
        "paged_attention_step": {
            "native": sdpa,
            "public": lambda: attn.paged_attention_step(q, kn, vn, kc, vc, plan),
        },
        "cached_attention_step": {
            "native": sdpa,
            "public_step_1": planned_step(1),
            "public_step_8": planned_step(layers),
        },
    }


def _timed_round_robin(fns: dict[str, Callable[[], Any]], a: argparse.Namespace) -> dict[str, Any]:
    """Each callable's host time per call, summarised: ``a.repeats`` rounds of one ``a.calls``-call
    loop per callable, round-robin, so load drift hits every variant alike. A callable carrying a
    ``scope`` (``entry``, ``composed``, ``unscanned``, ``op_layer``) runs its loops inside it."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.repeats):
        for k, f in fns.items():
            scope = f.scope() if hasattr(f, "scope") else contextlib.nullcontext()
            with scope:
                samples[k] += host_call_samples(f, calls=a.calls, repeats=1, warmup=5 if samples[k] else 20,
                                                device=a.device)
    return {k: summarize(v) for k, v in samples.items()}


def _neutral_rows(impl: Callable[[], Any], a: argparse.Namespace, dtype: torch.dtype, dev: dict,
                  ver: dict) -> list[dict]:
    """Rows of :func:`neutral_cases` (op ``rms_norm.neutral``), timed round-robin; the ``impl``
    row's summary holds each kind's time alone and its ``interaction_us``."""
    x = torch.randn(1, 256, device=a.device)
    st = _timed_round_robin(neutral_cases(impl, x), a)
    impl_us = st["impl"].median * 1e3
    summary = {"impl_us": impl_us}
    for kind in ("python", "reductions", "allocations"):
        alone = st[kind].median * 1e3
        summary[f"{kind}_us"] = alone
        summary[f"{kind}_interaction_us"] = st[f"{kind}+impl"].median * 1e3 - alone - impl_us
    return _control_rows("rms_norm.neutral", "impl", st, summary, a, dtype, dev, ver)


def _dispatch_rows(a: argparse.Namespace, dtype: torch.dtype, dev: dict, ver: dict) -> list[dict]:
    """Rows of :func:`dispatch_cases` (op ``dispatch.custom_op``); the ``function`` row's summary
    holds each call's time and ``dispatch_us`` (custom operator minus function)."""
    x = torch.randn(1, 256, device=a.device, dtype=dtype)
    st = _timed_round_robin(dispatch_cases(x), a)
    summary = {f"{k}_us": v.median * 1e3 for k, v in st.items()}
    summary["dispatch_us"] = summary["custom_op_us"] - summary["function_us"]
    summary["dispatch_autograd_us"] = summary["custom_op_autograd_us"] - summary["function_us"]
    return _control_rows("dispatch.custom_op", "function", st, summary, a, dtype, dev, ver)


def _control_rows(op: str, base: str, st: dict[str, Any], summary: dict[str, float], a: argparse.Namespace,
                  dtype: torch.dtype, dev: dict, ver: dict) -> list[dict]:
    """Print a control's summary and make its rows: one per callable, each against ``base``,
    whose row carries the summary."""
    print(f"{op:<24s} " + "  ".join(f"{k} {v:7.1f} µs" for k, v in summary.items()))
    return [make_row(benchmark="bench_call_overhead", op=op, implementation=k, baseline=None if k == base else base,
                     config={"dtype": str(dtype).removeprefix("torch."), "calls": a.calls}, stats=s, warmup=20,
                     device=dev, versions=ver, extra={"summary": summary} if k == base else None)
            for k, s in st.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=15, help="timed loops per callable")
    ap.add_argument("--cases", default=None, help="comma-separated subset of the cases")
    ap.add_argument("--neutral", action="store_true",
                    help="also time the controls: neutral work around the rms_norm implementation (neutral_cases) "
                         "and the custom-operator layer (dispatch_cases)")
    ap.add_argument("--out", required=True, help="JSON report path")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype or ("float32" if a.device == "cpu" else "bfloat16"))
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    # host cost is what is measured: the CPU run uses small widths so the exact-sum arithmetic
    # of the CPU backend does not drown it (the GPU run uses decode-step widths)
    allc = cases(a.device, dtype, **({"H": 256, "D": 64, "ctx": 64} if a.device == "cpu" else {}))
    names = a.cases.split(",") if a.cases else list(allc)
    unknown = set(names) - set(allc)
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}; known: {list(allc)}")
    dev, ver = device_info(a.device), versions()
    rows = []
    for name in names:
        st = _timed_round_robin(allc[name], a)
        fixed_us = None
        if name == "cached_attention_step":
            # per-layer step cost from the 1- and 8-layer steps; the rest (plan, state restore) is fixed per step
            public_ms = (st["public_step_8"].median - st["public_step_1"].median) / 7
            fixed_us = (st["public_step_1"].median - public_ms) * 1e3
            impl_ms = None
        else:
            public_ms = st["public"].median
            impl_ms = st["impl"].median if "impl" in st else None
        native_ms = st["native"].median
        target = TARGET_US["attention"] if "attention" in name else DEFAULT_TARGET_US
        overhead_us = None if impl_ms is None else (public_ms - impl_ms) * 1e3
        unscanned_us = None if impl_ms is None else (st["unscanned"].median - impl_ms) * 1e3
        entry_us = st["entry"].median * 1e3 if "entry" in st else None
        op_layer_us = st["op_layer"].median * 1e3 if "op_layer" in st else None
        saving_us = None if op_layer_us is None else op_layer_us - public_ms * 1e3
        composed_us = st["composed"].median * 1e3 if "composed" in st else None
        interaction_us = (None if composed_us is None or entry_us is None or impl_ms is None
                          else composed_us - entry_us - impl_ms * 1e3)
        excess_us = (public_ms - native_ms) * 1e3
        measured = overhead_us if overhead_us is not None else excess_us
        for k, s in st.items():
            rows.append(make_row(
                benchmark="bench_call_overhead", op=name, implementation=k, baseline=None if k == "native" else "native",
                config={"dtype": str(dtype).removeprefix("torch."), "calls": a.calls}, stats=s, warmup=20,
                device=dev, versions=ver,
                extra={"summary": {"public_us": public_ms * 1e3, "native_us": native_ms * 1e3,
                                   "impl_us": None if impl_ms is None else impl_ms * 1e3,
                                   "overhead_us": overhead_us, "unscanned_overhead_us": unscanned_us,
                                   "entry_us": entry_us, "op_layer_us": op_layer_us, "direct_saving_us": saving_us,
                                   "composed_us": composed_us,
                                   "interaction_us": interaction_us, "excess_us": excess_us,
                                   "target_us": target, "target_on": "overhead_us" if overhead_us is not None else "excess_us",
                                   "meets_target": measured <= target, "step_fixed_us": fixed_us}} if k == "native" else None,
            ))
        print(f"{name:24s} native {native_ms * 1e3:8.1f} µs  public {public_ms * 1e3:8.1f} µs  "
              + (f"impl {impl_ms * 1e3:8.1f} µs  overhead {overhead_us:6.1f} µs  unscanned {unscanned_us:6.1f} µs  "
                 f"entry {entry_us:6.1f} µs  op layer {saving_us:+6.1f} µs  "
                 f"composed {composed_us:8.1f} µs  " if impl_ms is not None else "")
              + f"excess {excess_us:8.1f} µs  target {target:.0f} µs: {'met' if measured <= target else 'MISSED'}")
    if a.neutral:
        rows += _neutral_rows(allc["rms_norm"]["impl"], a, dtype, dev, ver)
        rows += _dispatch_rows(a, dtype, dev, ver)
    # glibc's allocator settings change how large temporaries are returned to the OS between calls
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    write_report(rows, a.out, meta={"machine_load": machine_load(), "malloc_env": malloc_env})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
