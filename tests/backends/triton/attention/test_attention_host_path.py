"""The host path of the Triton attention target (impl ``triton.blocked_online_softmax``):
registration with the runtime registry (``rl_engine/backends/triton/attention/__init__.py``),
routing, the per-call eligibility check, the custom ops and the kernels' profiler names.

CPU tests: registration, routing of CPU tensors to the CPU backend, pure eligibility checks. GPU
tests (``@pytest.mark.gpu``; the device run must show zero skips): dispatch picks the Triton
implementation and provenance says so; head dims the kernels do not support are rejected with a
reason (strict error) and the custom op raises; ``torch.library.opcheck``; profiler names
(forward + backward + cached decode, and the Hopper warpgroup kernels).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine import contracts
from rl_engine.backends.triton.attention.tuning import attention_tuning
from rl_engine.ops.attention import ContiguousKVCache, PagedKVCache, cached_attention, varlen_attention
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import NoEligibleImplementation, Request, implementations, make_request, select
from tests.backends.triton._rowwise_common import (
    check_cpu_routing,
    check_profiler_names,
    check_registration,
    check_static_and_fake_gpu,
)
from tests.backends.triton.attention._attention_common import IMPL, MODULE, OPS, gpu, make_qkv

#: The modules of the portable Triton kernels (``check_profiler_names``: every launchable kernel
#: listed in its module's ``KERNEL_NAMES`` and prefixed ``rlk_``).
PORTABLE_KERNEL_MODULES = tuple(f"{MODULE}.{m}" for m in ("portable_forward", "portable_backward", "split_kv_combine",
                                                           "tile_tables"))
HOPPER_KERNEL_MODULES = (f"{MODULE}.hopper_warpgroup", f"{MODULE}.hopper_transposed_decode")


# --------------------------------------------------------------------------- CPU: registration and routing


@pytest.mark.parametrize("op", OPS)
def test_registration_declares_cuda_and_untested_rocm(op):
    check_registration(op, IMPL, MODULE, "attention")


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_route_to_cpu_and_checks_are_pure(op):
    check_cpu_routing(op, IMPL, torch.randn(2, 8))
    check_static_and_fake_gpu(op, IMPL)


@pytest.mark.parametrize("op", OPS)
def test_unsupported_head_dim_is_rejected_with_a_reason(op):
    """The per-call check (pure) names the head dim; the registry runs it once the static checks
    pass (on the device: ``test_unsupported_head_dim_errors_reach_the_user``)."""
    from rl_engine.backends.triton.attention import call_reasons

    impl = next(i for i in implementations(op) if i.impl_id == IMPL)
    assert impl.call_check is call_reasons
    cpu = make_request(op, torch.randn(1, 1)).platform
    sm90 = type(cpu)(family="cuda", arch="sm90", device_name="x", torch_version="t", triton_version=None,
                     cuda_version=None, hip_version=None)
    req = Request(op, sm90, torch.bfloat16, contracts.load_contract(op).guarantees, {"head_dim": 96})
    assert call_reasons(req) == ["head_dim 96 not supported by the Triton attention kernels (supported: [32, 64, 128, 256])"]
    for d in (32, 64, 128, 256):
        assert call_reasons(Request(op, sm90, torch.bfloat16, frozenset(), {"head_dim": d})) == []
    # fp32 at D = 256: the rollout path only (the train path's backward does not fit shared memory)
    fp32 = call_reasons(Request(op, sm90, torch.float32, frozenset(), {"head_dim": 256}))
    assert fp32 == ([] if op != "attention.varlen_attention"
                    else [f"head_dim 256 in float32 not supported on the train path by the Triton attention kernels: "
                          f"its backward needs more shared memory than an SM has (fp32 up to head_dim 128; bfloat16 "
                          f"up to 256)"])
    assert call_reasons(Request(op, sm90, torch.float32, frozenset(), {"head_dim": 128})) == []
    sm75 = type(cpu)(family="cuda", arch="sm75", device_name="x", torch_version="t", triton_version=None,
                     cuda_version=None, hip_version=None)
    assert any("sm80" in r for r in call_reasons(Request(op, sm75, torch.bfloat16, frozenset(), {"head_dim": 64})))


# --------------------------------------------------------------------------- GPU: dispatch, errors, names


@gpu
@pytest.mark.parametrize("op", OPS)
def test_dispatch_picks_triton_on_cuda_and_records_provenance(op):
    q, k, v, cu = (t.cuda() for t in make_qkv([10], 1, 2, 64, "bfloat16"))
    with provenance.record() as recs:
        if op == OPS[0]:
            varlen_attention(q, k, v, cu)
        else:
            cached_attention(q, k, v, ContiguousKVCache(1, 16, 1, 64, dtype=torch.bfloat16, device="cuda"), [0], cu)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback and rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(op, q, features={"head_dim": 64}))
    assert rejections == []


@gpu
def test_unsupported_head_dim_errors_reach_the_user():
    q, k, v, cu = (t.cuda() for t in make_qkv([10], 1, 2, 96, "bfloat16"))
    with pytest.raises(NoEligibleImplementation, match="head_dim 96 not supported"):
        varlen_attention(q, k, v, cu)
    with pytest.raises(NoEligibleImplementation, match="head_dim 96 not supported"):
        cached_attention(q, k, v, ContiguousKVCache(1, 16, 1, 96, dtype=torch.bfloat16, device="cuda"), [0], cu)
    from rl_engine.backends.triton.attention import varlen_attention_fwd_triton

    with pytest.raises(ValueError, match="^q: head_dim 96 is not supported"):
        varlen_attention_fwd_triton(q, k, v, cu, 0.1, None)


@gpu
def test_custom_op_registration_opcheck():
    from rl_engine.backends.triton.attention import varlen_attention_fwd_triton

    q, k, v, cu = (t.cuda() for t in make_qkv([5, 70], 1, 2, 32, "float32", seed=1))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(varlen_attention_fwd_triton, (q, k, v, cu, 0.2, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@gpu
def test_profiler_kernel_names_carry_the_prefix():
    q, k, v, cu = (t.cuda() for t in make_qkv([300, 1200], 2, 4, 128, "bfloat16", seed=2))

    def call():
        qq = q.clone().requires_grad_()
        varlen_attention(qq, k, v, cu).float().sum().backward()
        cache = PagedKVCache(64, 64, 2, 128, dtype=torch.bfloat16, device="cuda", max_seqs=2)
        cached_attention(q, k, v, cache, [0, 1], cu)  # prefill
        one = torch.tensor([0, 1, 2], device="cuda")
        cached_attention(q[:2], k[:2], v[:2], cache, [0, 1], one)  # decode (split-parallel)

    check_profiler_names(
        PORTABLE_KERNEL_MODULES, call,
        {"rlk_attn_fwd", "rlk_attn_fwd_split", "rlk_attn_combine", "rlk_attn_bwd_delta", "rlk_attn_bwd_dq",
         "rlk_attn_bwd_dkdv", "rlk_attn_tiles"},
        "attention",
    )


@gpu
def test_warpgroup_profiler_kernel_names_carry_the_prefix():
    """The Hopper warpgroup kernels are listed, prefixed, and seen by the profiler: the forward
    (``hopper_warpgroup.rlk_attn_fwd_wg``, the train path's forward for 16-bit ``D = 128`` on sm90),
    the paged decode split kernel (``hopper_warpgroup.rlk_attn_split_wg``, a decode step over 16-key
    pages past one KV split; ``wg_decode_band`` widened so that this small step takes it) and the
    transposed decode split kernel (``hopper_transposed_decode.rlk_attn_split_wgt``, the next step
    with ``wg_decode`` off)."""
    q, k, v, cu = (t.cuda() for t in make_qkv([300, 1200], 2, 4, 128, "bfloat16", seed=2))

    def call():
        varlen_attention(q, k, v, cu)
        cache = PagedKVCache(200, 16, 2, 128, dtype=torch.bfloat16, device="cuda", max_seqs=2)
        cached_attention(q, k, v, cache, [0, 1], cu)  # prefill
        one = torch.tensor([0, 1, 2], device="cuda")
        with attention_tuning(wg_decode_band=(0, float("inf")), wgt_decode=False):
            cached_attention(q[:2], k[:2], v[:2], cache, [0, 1], one)  # decode: 2 KV splits at 1200 keys
        with attention_tuning(wg_decode=False, wgt_decode_bands=((0, float("inf")),) * 2):
            cached_attention(q[:2], k[:2], v[:2], cache, [0, 1], one)  # the next token, on the transposed kernel

    check_profiler_names(HOPPER_KERNEL_MODULES, call, {"rlk_attn_fwd_wg", "rlk_attn_split_wg", "rlk_attn_split_wgt"},
                         "attention_wg")
