"""No host synchronisation on the default GPU path: every public op, forward and backward (the
loss family with ``denominator=`` given), and whole model steps run under
``torch.cuda.set_sync_debug_mode("error")``.

Inputs are built (and each case warmed up: Triton compiles, tables are cached) before the mode is
switched on; step metadata is given on the host, as engines build it. The negative control shows
the mode catches a synchronisation: the explicit ``nan_policy("raise")`` scan is one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rl_engine import ops
from rl_engine.engine import ops_for
from rl_engine.models.qwen3 import Qwen3ForCausalLM, preset
from rl_engine.runtime.plan import Plan
from rl_engine.utils.checks import nan_policy
from tests.helpers.paged_steps import PagedEngine
from tests.ops.loss.helpers import loss_call_cases

pytestmark = pytest.mark.gpu

DT = torch.bfloat16


def _r(*shape, grad=True, dtype=DT, scale=1.0):
    t = (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(grad)


def _bwd(y):
    y = y[0] if isinstance(y, tuple) else y
    y.float().sum().backward()


def _cases() -> dict[str, Callable[[], Callable[[], None]]]:
    H, V, T = 256, 1000, 24

    def linear():
        x, w = _r(T, H), _r(H, H, scale=H ** -0.5)
        return lambda: _bwd(ops.gemm.linear(x, w))

    def rms_norm():
        x, w = _r(T, H), _r(H)
        return lambda: _bwd(ops.norm.rms_norm(x, w, 1e-6))

    def fused_add_rms_norm():
        x, r, w = _r(T, H, grad=False), _r(T, H, grad=False), _r(H, grad=False)
        return lambda: ops.norm.fused_add_rms_norm(x, r, w, 1e-6)

    def silu_and_mul():
        x = _r(T, 2 * H)
        return lambda: _bwd(ops.activation.silu_and_mul(x))

    def apply_rope():
        x, p = _r(T, 4, 64), torch.arange(T, device="cuda")
        return lambda: _bwd(ops.rope.apply_rope(x, p, theta=1e6))

    def embedding():
        ids, w = torch.randint(0, V, (T,), device="cuda"), _r(V, H)
        return lambda: _bwd(ops.embedding.embedding(ids, w))

    def token_logprobs():
        z, t = _r(T, V, dtype=torch.float32), torch.randint(0, V, (T,), device="cuda")
        return lambda: _bwd(ops.logprob.token_logprobs(z, t))

    def log_softmax_entropy():
        z = _r(T, V, dtype=torch.float32)
        return lambda: (_bwd(ops.logprob.log_softmax(z)), _bwd(ops.logprob.entropy(z)))

    def linear_token_logprobs():
        h, w, t = _r(T, H), _r(V, H, scale=H ** -0.5), torch.randint(0, V, (T,), device="cuda")
        return lambda: _bwd(ops.logprob.linear_token_logprobs(h, w, t))

    def varlen_attention():
        q, k, v = _r(T, 4, 64), _r(T, 2, 64), _r(T, 2, 64)
        cu = torch.tensor([0, 7, T])  # host offsets: no read-back of a device tensor
        return lambda: _bwd(ops.attention.varlen_attention(q, k, v, cu))

    def moe_layer():
        x, z = _r(T, H), _r(T, 16)
        wgu, wd = _r(16, 2 * 96, H, scale=H ** -0.5), _r(16, H, 96, scale=96 ** -0.5)

        def run():
            w, ids = ops.moe.route(z, 4, True)
            _bwd(ops.moe.experts(x, wgu, wd, w, ids))
        return run

    def paged_step():
        model = Qwen3ForCausalLM.random(preset("tiny"), seed=0, dtype=DT, device="cuda")
        rollout = ops_for(Plan.parse("R/R"), "rollout")
        eng = PagedEngine(model, num_seqs=2, max_len=64, device="cuda")
        plan, pos = eng.plan([9, 4])
        model.hidden_paged(torch.randint(0, 2048, (13,), device="cuda"), pos, eng.k, eng.v, plan, rollout)
        eng.advance([9, 4])
        tokens = torch.randint(0, 2048, (2,), device="cuda")

        def run():
            plan, pos = eng.plan([1, 1])  # host metadata -> pinned asynchronous copies
            model.logits(model.hidden_paged(tokens, pos, eng.k, eng.v, plan, rollout), rollout)
        return run

    def train_step():
        model = Qwen3ForCausalLM.random(preset("tiny"), seed=0, dtype=DT, device="cuda").requires_grad_()
        train = ops_for(Plan.parse("R/R"), "train")
        ids = torch.randint(0, 2048, (T,), device="cuda")
        pos = torch.cat([torch.arange(7), torch.arange(T - 7)]).cuda()
        cu = torch.tensor([0, 7, T])

        def run():
            h = model.hidden_train(ids, pos, cu, train)
            lp = train.lm_head_logprobs(h[:-1], model.lm_head_weight, ids[1:])
            _bwd(lp)
        return run

    cases = {f.__name__: f for f in (linear, rms_norm, fused_add_rms_norm, silu_and_mul, apply_rope, embedding,
                                      token_logprobs, log_softmax_entropy, linear_token_logprobs, varlen_attention,
                                      moe_layer, paged_step, train_step)}
    # the loss family with denominator= given (the micro-batch form), forward and backward
    for name in loss_call_cases():
        cases[f"loss_{name}"] = lambda name=name: loss_call_cases("cuda")[name]
    return cases


CASES = _cases()


def _no_sync(run: Callable[[], None]) -> None:
    run()  # warm-up: compilation and cached tables may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", list(CASES))
def test_runs_without_host_synchronisation(name):
    _no_sync(CASES[name]())


def test_sync_debug_mode_catches_a_scan():
    run = CASES["linear"]()
    with nan_policy("raise"), pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
        _no_sync(run)
