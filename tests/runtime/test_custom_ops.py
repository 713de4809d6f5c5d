"""When an eager call skips the ``torch.library`` custom-op layer (:mod:`rl_engine.runtime.custom_ops`).

The decision in every case that must keep the op (gradient, fake / functional tensors, dispatch
and function modes, ``torch.compile``), observed through the profiler (the op's own event appears
exactly when the op layer ran), on a test custom op; and the registry's wrapping of a custom op
registered as is. The public operators' two paths are compared in
``tests/ops/test_direct_eager_path.py``.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from rl_engine.runtime.custom_ops import call_op, direct_call_ok, eager_entry, is_custom_op, op_range
from rl_engine.runtime.registry import implementations, register
from tests.helpers.op_layer import KeepOpLayer, ops_run
from tests.runtime.fake_operator import TEST_OP, fake_op, make_impl, scale_native  # noqa: F401 (fixture)


@torch.library.custom_op("rlk_test::host_path_scale", mutates_args=(), device_types="cpu")
def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


_scale.register_fake(lambda x, w: torch.empty_like(x))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    x, w = ctx.saved_tensors
    return g * w, g * x


_scale.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("rlk_test::host_path_sum", mutates_args=(), device_types="cpu")
def _sum(xs: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    return torch.stack(xs).sum(0) * scale


_sum.register_fake(lambda xs, scale=1.0: torch.empty_like(xs[0]))


def _op_layer_ran(fn, name: str = "rlk_test::host_path_scale") -> bool:
    """Whether the op itself ran (its dispatcher event, not the direct path's range)."""
    return name in ops_run(fn, name)


def test_plain_no_grad_call_skips_the_op_layer():
    x, w = torch.randn(4), torch.randn(4)
    assert direct_call_ok((x, w, 3, None))
    assert not _op_layer_ran(lambda: call_op(_scale, x, w))
    assert torch.equal(call_op(_scale, x, w), _scale(x, w))
    p = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():  # a Parameter is a plain tensor; no grad mode: nothing to record
        assert direct_call_ok((x, p))
        assert not _op_layer_ran(lambda: call_op(_scale, x, p))
    with torch.inference_mode():
        assert not _op_layer_ran(lambda: call_op(_scale, x, p))


def test_the_direct_call_keeps_the_ops_name_in_a_profile():
    x, w = torch.randn(4), torch.randn(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call_op(_scale, x, w)
    ranges = [e for e in prof.events() if e.name == "rlk_test::host_path_scale"]
    assert [e.is_user_annotation for e in ranges] == [True]
    assert any(e.name == "aten::mul" and e.cpu_parent is ranges[0] for e in prof.events())  # the body runs inside it


def test_op_range_names_work_done_in_an_ops_place_only_under_a_profiler():
    assert type(op_range(_scale)).__name__ == "nullcontext"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with op_range(_scale):
            torch.ones(2).mul(3)
    ranges = [e for e in prof.events() if e.name == "rlk_test::host_path_scale"]
    assert [e.is_user_annotation for e in ranges] == [True]


def test_every_case_that_needs_the_op_keeps_it():
    x, w = torch.randn(4), torch.randn(4)
    xg = x.clone().requires_grad_()
    assert not direct_call_ok((xg, w))  # negative control: autograd must see the op
    assert _op_layer_ran(lambda: call_op(_scale, xg, w))
    y = call_op(_scale, xg, w)
    y.sum().backward()
    assert torch.equal(xg.grad, w)
    with KeepOpLayer():
        assert not direct_call_ok((x, w))
        assert _op_layer_ran(lambda: call_op(_scale, x, w))
    with torch.device("cpu"):  # a TorchFunctionMode
        assert not direct_call_ok((x, w))
    seen_in_vmap = []
    torch.vmap(lambda row: seen_in_vmap.append(direct_call_ok((row, w))) or row)(torch.randn(2, 4))
    assert seen_in_vmap == [False]  # a torch.func transform: its wrapped tensors look plain
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
    assert not direct_call_ok((fx, w))

    seen = []

    @torch.compile(backend=lambda gm, example_inputs: (seen.append(gm), gm)[1], fullgraph=True)
    def f(a, b):
        return call_op(_scale, a, b)

    assert torch.equal(f(x, w), x * w)
    ops = [n.target for gm in seen for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.rlk_test.host_path_scale.default in ops, ops  # traced as the op, not its body


def test_keyword_and_list_arguments_are_inspected():
    x, y = torch.randn(3), torch.randn(3)
    assert direct_call_ok((), {"x": x, "w": y})
    assert not direct_call_ok((), {"x": x.clone().requires_grad_(), "w": y})
    assert direct_call_ok(([x, y],))
    assert not direct_call_ok(([x, y.clone().requires_grad_()],))  # control: a tensor inside a list counts
    assert not _op_layer_ran(lambda: call_op(_sum, [x, y], scale=2.0), "rlk_test::host_path_sum")
    assert torch.equal(call_op(_sum, [x, y], scale=2.0), (x + y) * 2.0)
    yg = y.clone().requires_grad_()
    assert _op_layer_ran(lambda: call_op(_sum, [x, yg], scale=2.0), "rlk_test::host_path_sum")


def test_eager_entry_keeps_the_implementing_module_and_the_op():
    entry = eager_entry(_scale)
    assert entry._init_fn.__module__ == __name__
    assert entry.__name__ == "_scale"
    assert entry.custom_op is _scale
    assert is_custom_op(_scale) and not is_custom_op(entry) and not is_custom_op(torch.add)
    x, w = torch.randn(3), torch.randn(3)
    assert torch.equal(entry(x, w), x * w)
    assert not _op_layer_ran(lambda: entry(x, w))
    assert _op_layer_ran(lambda: entry(x.clone().requires_grad_(), w))


def test_the_registry_stores_a_custom_op_as_its_eager_entry(fake_op):
    stored = register(make_impl("scale", fn=_scale))
    assert stored.fn is not _scale and stored.fn.custom_op is _scale
    assert [i.impl_id for i in implementations(TEST_OP)] == ["scale"]
    assert stored.module == __name__  # provenance still fingerprints the implementing module
    assert register(make_impl("plain", fn=scale_native)).fn is scale_native  # a plain function is kept as is
    x, w = torch.randn(3), torch.randn(3)
    assert not _op_layer_ran(lambda: stored.fn(x, w))


def test_every_registered_custom_op_is_an_eager_entry():
    """No shipped implementation keeps the bare op (the CPU and Triton backends alike)."""
    from rl_engine import contracts

    seen = 0
    for op in contracts.all_contracts():
        for impl in implementations(op):
            assert not is_custom_op(impl.fn), (op, impl.impl_id)
            seen += hasattr(impl.fn, "custom_op")
    assert seen >= 10
