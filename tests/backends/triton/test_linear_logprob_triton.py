"""Triton ``logprob.linear_token_logprobs`` (the fused LM head, impl ``triton.canonical_lse``,
kernels in ``rl_engine/backends/triton/logprob/fused.py``): the one test module of this
operator target.

GPU tests (``@pytest.mark.gpu``; the device run must show zero skips): forward outputs and both
gradients **raw-bit equal** to the unfused GPU path ``token_logprobs`` / ``entropy`` of
``gemm.linear`` (Triton) for several ``(token_chunk, vocab_chunk)``, fp32 and bf16, ragged ``V``
(also ``V % 16 != 0``) and ragged ``N``, temperature 1 and not, either output alone in the loss;
the fused dlogits stage alone against autograd's unfused dlogits (the fp32 fma contraction
that fp fusion introduces); row invariance (hypothesis); run-to-run determinism (incl. ``dweight``); accuracy against float64
(contract tolerances); two negative controls caught by the same bitwise checker (cuBLAS logits;
a merge of whole vocabulary chunks); dispatch and provenance; ``opcheck`` of the custom ops; the
profiler-name rule; the peak memory bound (fused extra ≪ naive); overflow errors naming
``hidden``; bounded performance against the unfused path (forward; forward + backward). CPU tests: registration
(nothing of triton imported), routing, pure eligibility checks, default chunk sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_engine.ops import gemm, logprob
from rl_engine.reference.logprob import linear_token_logprobs_f64
from rl_engine.runtime import provenance
from rl_engine.runtime.registry import make_request, select
from rl_engine.utils.bits import same_bits
from rl_engine.utils.checks import nan_policy
from rl_engine.validation.common import check_row_invariance
from tests.backends.triton._rowwise_common import (
    accuracy,
    check_cpu_routing,
    check_profiler_names,
    check_registration,
    check_static_and_fake_gpu,
    event_us,
    evidence,
    gpu_randn,
    interp,
    run_py,
)
from tests.helpers.strategies import row_trials

OP = "logprob.linear_token_logprobs"
IMPL = "triton.canonical_lse"
MODULE = "rl_engine.backends.triton.logprob"
DTYPES = ("float32", "bfloat16")
gpu = pytest.mark.gpu
# (token_chunk, vocab_chunk): defaults, token chunks below / across the GEMM's row tiles, vocab
# chunks of 1..4 blocks (ragged last chunk for every V used below)
CHUNKINGS = [(None, None), (7, 1024), (64, 2048), (100, 3072), (333, 4096)]
OUTPUT_NAMES = ("logprobs", "entropy", "grad hidden", "grad weight")


def _data(n, h, v, dtype, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    hidden = torch.randn(n, h, generator=g).to(dt)
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dt)
    targets = torch.randint(0, v, (n,), generator=g)
    if n > 1:  # the first and the last vocabulary column are targets too
        targets[0], targets[1] = 0, v - 1
    return hidden.to(device), weight.to(device), targets.to(device)


def unfused(hidden, weight, targets, temperature=1.0, return_entropy=True, **_chunks):
    """The path the fused op is raw-bit equal to: Triton gemm.linear, then the Triton log-prob ops."""
    logits = gemm.linear(hidden, weight)
    lp = logprob.token_logprobs(logits, targets, temperature)
    return (lp, logprob.entropy(logits, temperature)) if return_entropy else lp


def outputs_and_grads(fn, hidden, weight, targets, use=("lp", "ent"), seed=1):
    """Forward outputs and the grads of (hidden, weight) under a fixed upstream gradient."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets)
    g = torch.Generator().manual_seed(seed)
    g_lp = torch.randn(lp.shape, generator=g).to(lp.device)
    g_ent = torch.randn(ent.shape, generator=g).to(ent.device)
    terms = {"lp": (lp * g_lp).sum(), "ent": (ent * g_ent).sum()}
    sum(terms[k] for k in use).backward()
    return [lp.detach(), ent.detach(), h.grad, w.grad]


def chunk_failures(candidate, hidden, weight, targets, temperature, chunkings, use=("lp", "ent")):
    """Raw-bit differences between ``candidate(..., token_chunk=, vocab_chunk=)`` and the unfused
    path for every chunking (empty: equal everywhere). The one checker of this module."""
    want = outputs_and_grads(lambda h, w, t: unfused(h, w, t, temperature), hidden, weight, targets, use)
    failures = []
    for tc, vc in chunkings:
        got = outputs_and_grads(
            lambda h, w, t: candidate(h, w, t, temperature, True, token_chunk=tc, vocab_chunk=vc),
            hidden, weight, targets, use,
        )
        for name, a, b in zip(OUTPUT_NAMES, got, want):
            if a is None and b is None:
                continue
            d = same_bits(a, b)
            if not d.equal:
                failures.append(f"token_chunk={tc}, vocab_chunk={vc}, {name}: {d}")
    return failures


def cublas_logits_fused(hidden, weight, targets, temperature=1.0, return_entropy=True, **_chunks):
    """Negative control 1: cuBLAS logits (``F.linear``) instead of the Triton GEMM, otherwise the
    same canonical log-prob ops."""
    logits = F.linear(hidden, weight)
    return logprob.token_logprobs(logits, targets, temperature), logprob.entropy(logits, temperature)


def chunk_merge_fused(hidden, weight, targets, temperature=1.0, return_entropy=True, *, token_chunk=None, vocab_chunk=None):
    """Negative control 2: the same Triton logits, but the log-sum-exp merges whole vocabulary
    chunks (one ``logsumexp`` per chunk, then combined) instead of 1024-column blocks."""
    vc = vocab_chunk or 4096
    z = gemm.linear(hidden, weight).float() / temperature
    parts = [torch.logsumexp(z[:, c : c + vc], dim=-1) for c in range(0, z.shape[1], vc)]
    lse = torch.logsumexp(torch.stack(parts, dim=-1), dim=-1)
    logp = z - lse.unsqueeze(1)
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------------------------------------
# CPU tests


def test_registration_declares_cuda_and_untested_rocm():
    check_registration(OP, IMPL, MODULE, "logprob")
    run_py(
        "import sys\n"
        "from rl_engine.runtime.registry import implementations\n"
        f"implementations({OP!r})\n"
        f"assert '{MODULE}.fused' not in sys.modules and 'triton' not in sys.modules\n"
    )


def test_cpu_tensors_route_to_cpu_and_checks_are_pure():
    check_cpu_routing(OP, IMPL, torch.randn(2, 8))
    check_static_and_fake_gpu(OP, IMPL)


def _liger_workspace(n: int, h: int, v: int, itemsize: int) -> int:
    """What Liger-Kernel's fused linear cross-entropy holds beside its inputs and gradients: two
    ``[c, V]`` logits blocks, ``c`` the power of two at or above ``n / ⌈V / H⌉`` (its chunk rule).
    The H200 matrix measured 77,846,016 bytes at Qwen3-8B's LM head and 66,442,752 at Llama-3-8B's
    (T = 4096, bf16, peak minus the gradients), this formula's numbers to within 0.8 MiB."""
    c = 1 << max(0, (-(-n // -(-v // h)) - 1).bit_length())
    return 2 * c * v * itemsize


#: the LM heads of the matrix's presets (H, V): Qwen3 0.6B..32B, Llama-3-8B
LM_HEADS = [(1024, 151936), (2048, 151936), (2560, 151936), (4096, 151936), (5120, 151936), (4096, 128256)]


def test_forward_only_chunks_follow_the_forward_budget():
    from rl_engine.backends.triton import logprob as tlp

    # scoring (no gradient wanted): one [rows, chunk] logits chunk within FORWARD_BUDGET_BYTES
    assert tlp._chunks(8192, 4096, 151936, torch.bfloat16, None, None, training=False)[:2] == (8192, 4096)
    assert 8192 * 4096 * 2 <= tlp.FORWARD_BUDGET_BYTES
    assert tlp._chunks(1024, 4096, 151936, torch.bfloat16, None, None, training=False)[:2] == (1024, 32768)
    assert tlp._chunks(50, 64, 3000, torch.float32, None, None, training=False)[:2] == (50, 3072)  # never more than N / V
    # explicit chunks win, in both passes
    assert tlp._chunks(8192, 4096, 151936, torch.bfloat16, 96, 2048, training=True) == (96, 2048, 96, 2048, 2048)
    assert tlp._chunks(8192, 4096, 151936, torch.bfloat16, 96, None, training=True)[0:3:2] == (96, 96)
    # a token chunk covering every token asks for the shared backward pass: one grad-weight chunk size
    shared = tlp._chunks(4096, 4096, 151936, torch.bfloat16, 4096, None, training=True)
    assert shared.dx_rows == 4096 and shared.dw_cols == shared.dx_cols == 8192
    assert tlp.workspace_bytes(shared, 4096, 4096, 151936, torch.bfloat16) == 4096 * (8192 * 2 + 4 * 4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1024, 4096, 16384])
def test_training_chunks_hold_at_most_hidden_and_half_of_liger(dtype, n):
    """A training call's default chunks hold at most the size of ``hidden`` beside its inputs and
    outputs (plus 16 bytes of fold state per forward row) at every LM head of the matrix, which
    is at most about half of what Liger-Kernel's fused linear cross-entropy holds there; the
    fp32-logits variant too wherever ``H >= 3072``. Negative control: the chunks the op chose
    before (one shared backward pass over all tokens with its fp32 ``[N, H]`` accumulator)
    exceed Liger's memory at Llama-3-8B's head — the comparison can fail."""
    from rl_engine.backends.triton import logprob as tlp

    es = torch.finfo(dtype).bits // 8
    for h, v in LM_HEADS:
        for fp32_logits in ((False, True) if dtype == torch.bfloat16 and h >= 3072 else (False,)):
            c = tlp._chunks(n, h, v, dtype, None, None, training=True, fp32_logits=fp32_logits)
            ws = tlp.workspace_bytes(c, n, h, v, dtype, fp32_logits=fp32_logits)
            assert ws <= n * h * es + 16 * c.fwd_rows, (h, v, fp32_logits, c, ws)
            assert ws <= 0.55 * _liger_workspace(n, h, v, es), (h, v, fp32_logits, c, ws)
            assert c.dx_cols % tlp.VOCAB_BLOCK == 0 and c.dw_cols % tlp.VOCAB_BLOCK == 0 and c.fwd_cols % 1024 == 0
    shared_before = tlp.Chunks(4096, 8192, 4096, 10240, 10240)
    assert tlp.workspace_bytes(shared_before, 4096, 4096, 128256, torch.bfloat16) > _liger_workspace(4096, 4096, 128256, 2)


def test_training_chunks_below_the_budget_hold_their_minimums():
    """Where ``n·h`` is too small for one row quantum and one vocabulary block, a training call
    holds exactly those minimums, and a shared backward pass only where it fits the budget."""
    from rl_engine.backends.triton import logprob as tlp

    c = tlp._chunks(64, 4096, 151936, torch.bfloat16, None, None, training=True)
    assert c == (64, 4096, 64, 8192, 4096)  # 64 rows of [8192 columns + the fp32 accumulator]: 2 MiB
    assert tlp.workspace_bytes(c, 64, 4096, 151936, torch.bfloat16) == 64 * (8192 * 2 + 4 * 4096)
    c = tlp._chunks(40, 32, 3000, torch.float32, None, None, training=True)
    assert c == (40, 1024, 40, 1024, 1024)
    # a vocabulary that one chunk covers needs no accumulator, and the shared pass fits (also for
    # a token count that is no multiple of the row quantum)
    c = tlp._chunks(512, 4096, 3000, torch.bfloat16, None, None, training=True)
    assert c.dx_rows == 512 and c.dx_cols == c.dw_cols == 3072
    assert tlp.workspace_bytes(c, 512, 4096, 3000, torch.bfloat16) == 512 * 3000 * 2 + 16 * 512  # the forward's, with its fold state
    c = tlp._chunks(100, 4096, 3000, torch.bfloat16, None, None, training=True)
    assert c.dx_rows == 100 and c.dx_cols == c.dw_cols == 3072


# ---------------------------------------------------------------------------------------------
# GPU tests


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("n,h,v", [(130, 64, 5000), (67, 96, 4101), (40, 64, 3005)])
def test_raw_bit_equal_to_unfused_forward_and_grads_across_chunkings(dtype, temperature, n, h, v):
    """V = 5000 (ragged last block), 4101, 3005 (V % 16 != 0: the unspecialised fold kernel)."""
    hidden, weight, targets = _data(n, h, v, dtype, seed=n + v)
    failures = chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, temperature, CHUNKINGS)
    evidence(f"linear_logprob_bits_{dtype}_{temperature}_{n}x{h}x{v}", {"chunkings": CHUNKINGS, "failures": failures})
    assert failures == [], failures[:5]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use", [("lp",), ("ent",)])
def test_raw_bit_equal_when_only_one_output_enters_the_loss(dtype, use):
    hidden, weight, targets = _data(90, 64, 4100, dtype, seed=2)
    failures = chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, 1.0, [(32, 1024), (None, None)], use)
    assert failures == [], failures[:5]


def fused_mod():
    from rl_engine.backends.triton.logprob import fused

    return fused


#: (dx_rows, dx_cols, dw_cols) of the fused backward at N = 40, V = 3000: one shared pass over
#: three vocabulary chunks; over two; token chunks of 16 rows (the last 8) chained over three
#: chunks beside a grad-weight pass of two; 7-row chunks over one chunk (no accumulator)
BACKWARD_CHUNKS = [(40, 1024, 1024), (64, 2048, 2048), (16, 1024, 2048), (7, 4096, 1024)]


@interp
def test_interpreter_backward_strategies_give_the_same_bits():
    """The fused backward's chunkings in the Triton interpreter (fp32, N = 40, H = 32, V = 3000,
    the last vocabulary chunk ragged): the shared pass and the separate ``grad hidden`` /
    ``grad weight`` passes (``BACKWARD_CHUNKS``), either gradient alone, give the same bits,
    close to the float64 gradient. Negative control: ``grad hidden`` as the sum of per-chunk
    products (each rounded to fp32) instead of one product chained through the accumulator
    differs, so the comparison can fail. (The GPU tests compare with the unfused path.)"""
    from rl_engine.backends.triton.gemm import kernels as gk

    fused = fused_mod()
    N, H, V = 40, 32, 3000
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    _, ent, lse = fused.forward(h, w, t, 1.0, True, 16, 1024)
    args = (g_lp, g_ent, h, w, t, lse, ent, 1.0)
    want = fused.backward(*args, *BACKWARD_CHUNKS[0], True, True)
    for chunks in BACKWARD_CHUNKS[1:]:
        got = fused.backward(*args, *chunks, True, True)
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), chunks
    only_h = fused.backward(*args, 16, 1024, 2048, True, False)
    only_w = fused.backward(*args, 16, 1024, 2048, False, True)
    assert same_bits(only_h[0], want[0]) and only_h[1].numel() == 0
    assert same_bits(only_w[1], want[1]) and only_w[0].numel() == 0
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp64, ent64 = linear_token_logprobs_f64(hd, wd, t, 1.0, True)
    ((lp64 * g_lp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
    accuracy(OP, torch.float32, "backward", want[0], hd.grad, "grad hidden")
    accuracy(OP, torch.float32, "backward", want[1], wd.grad, "grad weight")
    summed = sum(gk.grad_input(fused._dlogits_(gk.forward(h, w[c0 : c0 + 1024], None), c0, t, lse, g_lp, ent, g_ent,
                                               1.0), w[c0 : c0 + 1024])
                 for c0 in range(0, V, 1024))
    assert not same_bits(summed, want[0]).equal, "per-chunk products summed must differ from the chained product"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("need", ["both", "hidden"])
def test_backward_strategies_give_the_same_bits(dtype, need):
    """``grad hidden`` from the shared backward pass (``token_chunk >= N``: each gradient chunk
    feeds both products, 4 in all) and from its own pass over token chunks (5 products; the
    training default) are raw-bit equal to each other and to the unfused path, with ``grad
    weight`` wanted or not (a frozen LM head), over ragged V and several chunkings. The
    module's negative controls use the same checker."""
    hidden, weight, targets = _data(150, 96, 5000, dtype, seed=31)
    want = outputs_and_grads(lambda h, w, t: unfused(h, w, t), hidden, weight, targets)

    def grads(tc, vc):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(need == "both")
        lp, ent = logprob.linear_token_logprobs(h, w, targets, 1.0, True, token_chunk=tc, vocab_chunk=vc)
        g = torch.Generator().manual_seed(1)
        g_lp = torch.randn(lp.shape, generator=g).to(lp.device)
        g_ent = torch.randn(ent.shape, generator=g).to(ent.device)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return h.grad, w.grad

    for tc, vc in ((32, 1024), (None, 2048), (None, None), (150, 1024), (256, 2048)):
        dh, dw = grads(tc, vc)
        assert same_bits(dh, want[2]), (tc, vc, same_bits(dh, want[2]))
        if need == "both":
            assert same_bits(dw, want[3]), (tc, vc, same_bits(dw, want[3]))
        else:
            assert dw is None


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_fused_dlogits_raw_bit_equal_to_unfused_autograd_dlogits(dtype, temperature):
    """The stage fp fusion breaks in fp32 on the H200: the gradient of the logits the fused
    backward forms in place (pass-A row chunks, pass-B vocabulary chunks), with both outputs in
    the loss, against autograd's sum of the unfused ``token_logprobs`` and ``entropy`` gradients.
    The same kernel launched with fp fusion on (``dz + de`` contracted into an
    fma) is recorded as evidence; it is expected to differ in fp32 at τ = 1."""
    import triton

    from rl_engine.backends.triton.gemm import kernels as gk
    from rl_engine.backends.triton.logprob import fused

    n, v = 130, 5000
    hidden, weight, targets = _data(n, 64, v, dtype, seed=n + v)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = (torch.randn(n, generator=g).cuda() for _ in range(2))
    lg = gemm.linear(hidden, weight).detach().requires_grad_()
    lp, ent = logprob.token_logprobs(lg, targets, temperature), logprob.entropy(lg, temperature)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    lp_f, ent_f, lse_f = fused.forward(hidden, weight, targets, temperature, True, n, 1024)
    assert same_bits(lp_f, lp.detach()) and same_bits(ent_f, ent.detach())
    rows_a = torch.cat([fused._dlogits_(gk.forward(hidden[r : r + 48], weight, None), 0, targets[r : r + 48],
                                        lse_f[r : r + 48], g_lp[r : r + 48], ent_f[r : r + 48], g_ent[r : r + 48],
                                        temperature) for r in range(0, n, 48)])
    cols_b = torch.cat([fused._dlogits_(gk.forward(hidden, weight[c : c + 2048], None), c, targets, lse_f, g_lp, ent_f,
                                        g_ent, temperature) for c in range(0, v, 2048)], 1)
    fusion_on = gk.forward(hidden, weight, None)
    fused.rlk_linear_logprob_dlogits[(n, triton.cdiv(v, fused.VOCAB_BLOCK))](
        fusion_on, fusion_on, v, v, 0, targets, lse_f, g_lp, ent_f, g_ent, lse_f, lse_f, n, float(temperature),
        HAS_LP=True, HAS_ENT=True, HAS_TEMP=temperature != 1.0, KEPT=False, BLOCK_V=fused.VOCAB_BLOCK, num_warps=4,
        enable_fp_fusion=True)
    evidence(f"linear_logprob_dlogits_{dtype}_{temperature}",
             {"pass_a": str(same_bits(rows_a, lg.grad)), "pass_b": str(same_bits(cols_b, lg.grad)),
              "fp_fusion_on": str(same_bits(fusion_on, lg.grad))})
    assert same_bits(rows_a, lg.grad), same_bits(rows_a, lg.grad)
    assert same_bits(cols_b, lg.grad), same_bits(cols_b, lg.grad)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_return_entropy_false_and_leading_dims(dtype):
    hidden, weight, targets = _data(24, 64, 2500, dtype, seed=4)
    h3, t3 = hidden.reshape(2, 12, 64), targets.reshape(2, 12)
    for tc, vc in [(None, None), (5, 1024)]:
        hh = h3.clone().requires_grad_()
        lp = logprob.linear_token_logprobs(hh, weight, t3, 0.9, token_chunk=tc, vocab_chunk=vc)
        assert lp.shape == (2, 12) and lp.dtype == torch.float32
        lp.sum().backward()
        hu = h3.clone().requires_grad_()
        want = unfused(hu, weight, t3, 0.9, return_entropy=False)
        want.sum().backward()
        assert same_bits(lp, want) and same_bits(hh.grad, hu.grad)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_at_the_lm_head_vocabulary(dtype):
    """V = 151936 (Qwen3), H = 256, N = 300: forward and grads raw-bit equal, default chunks and
    a coarser pair."""
    hidden, weight, targets = _data(300, 256, 151936, dtype, seed=11)
    failures = chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, 1.0, [(None, None), (128, 8192)])
    assert failures == [], failures[:5]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_vocab_chunk_merge_is_caught(dtype):
    """The checker must catch a log-prob whose log-sum-exp follows the vocabulary chunks (same
    Triton logits), while the fused op passes the same comparison at the same chunkings."""
    hidden, weight, targets = _data(130, 64, 5000, dtype, seed=3)
    bad = chunk_failures(chunk_merge_fused, hidden, weight, targets, 1.0, [(None, 1024), (None, 2048)])
    evidence(f"linear_logprob_negative_control_merge_{dtype}", {"failures": bad})
    assert bad, "a vocabulary-chunk-dependent merge was not detected"
    assert chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, 1.0, [(None, 1024), (None, 2048)]) == []


@gpu
def test_negative_control_cublas_logits_are_caught():
    """The checker must catch logits from another GEMM (cuBLAS ``F.linear``, fp32 without TF32,
    K = 1024: another accumulation order), the rest of the path unchanged. (In bf16 a small
    cuBLAS GEMM may happen to round to the same bits, so the asserted control is fp32; the bf16
    outcome is recorded as evidence.)"""
    found = {}
    for dtype in DTYPES:
        hidden, weight, targets = _data(130, 1024, 5000, dtype, seed=3)
        found[dtype] = chunk_failures(cublas_logits_fused, hidden, weight, targets, 1.0, [(None, None)])
    evidence("linear_logprob_negative_control_cublas", found)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert found["float32"], "cuBLAS logits were not detected"


def _on_gpu(weight, temperature, token_chunk):
    def fn(hid_cpu, tgt_cpu):
        lp, ent = logprob.linear_token_logprobs(
            hid_cpu.cuda(), weight, tgt_cpu.cuda(), temperature, True, token_chunk=token_chunk
        )
        return lp.cpu(), ent.cpu()

    return fn


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 48), v=st.sampled_from([1000, 2048, 3005]), temperature=st.sampled_from((1.0, 0.7)),
       token_chunk=st.sampled_from([None, 1, 16, 40]))
def test_row_invariance_forward_and_grad_hypothesis(dtype, data, n, v, temperature, token_chunk):
    hidden, weight, targets = _data(n, 64, v, dtype, seed=n * 31 + v)
    rep = check_row_invariance(_on_gpu(weight, temperature, token_chunk), [hidden.cpu(), targets.cpu()],
                               data.draw(row_trials(n)), grads=True)
    assert rep.ok, str(rep)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_run_to_run_determinism_forward_and_both_grads(dtype):
    hidden, weight, targets = _data(1024, 512, 32768, dtype, seed=5)
    fn = lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 1.0, True, token_chunk=256)  # noqa: E731
    runs = [outputs_and_grads(fn, hidden, weight, targets) for _ in range(3)]
    for run in runs[1:]:
        for name, a, b in zip(OUTPUT_NAMES, runs[0], run):
            assert same_bits(a, b), f"{name}: {same_bits(a, b)}"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_accuracy_forward_and_grads_vs_float64(dtype, temperature):
    hidden, weight, targets = _data(37, 64, 3000, dtype, seed=8)  # the CPU module's accuracy shape
    got = outputs_and_grads(lambda h, w, t: logprob.linear_token_logprobs(h, w, t, temperature, True), hidden, weight, targets)
    want = outputs_and_grads(lambda h, w, t: linear_token_logprobs_f64(h, w, t, temperature, True),
                             hidden.cpu().double(), weight.cpu().double(), targets.cpu())
    assert got[2].dtype == hidden.dtype and got[3].dtype == weight.dtype
    for name, quantity, a, b in zip(OUTPUT_NAMES, ("forward", "forward", "backward", "backward"), got, want):
        accuracy(OP, hidden.dtype, quantity, a, b, name)


@gpu
def test_dispatch_picks_triton_on_cuda_and_records_provenance():
    hidden, weight, targets = _data(4, 64, 100, "bfloat16")
    with provenance.record() as recs:
        logprob.linear_token_logprobs(hidden, weight, targets)
    (rec,) = recs
    assert rec.impl_id == IMPL and not rec.fallback and rec.platform.startswith("cuda:sm")
    _, rejections = select(make_request(OP, hidden))
    assert rejections == []


@gpu
def test_custom_ops_pass_opcheck():
    """Schema, autograd registration and fake (meta) implementation of the fused custom ops."""
    # the ops are registered when their backend module is imported (``import rl_engine`` registers
    # nothing): import it here, not rely on an earlier test of the same worker having dispatched
    import rl_engine.backends.triton.logprob  # noqa: F401

    hidden, weight, targets = _data(20, 64, 2100, "bfloat16", seed=6)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.rlk.linear_token_logprobs_triton.default,
                          (hidden.clone().requires_grad_(), weight.clone().requires_grad_(), targets, 0.9, True,
                           8, 1024, 8, 1024, 2048), test_utils=utils)
    lp, ent, lse = torch.ops.rlk.linear_token_logprobs_triton(hidden, weight, targets, 0.9, True, 8, 1024, 8, 1024,
                                                              2048)
    g = torch.ones_like(lp)
    torch.library.opcheck(torch.ops.rlk.linear_token_logprobs_triton_backward.default,
                          (g, g, hidden, weight, targets, lse, ent, 0.9, 8, 1024, 2048, True, True), test_utils=utils)


@gpu
def test_overflowing_logits_raise_naming_hidden():
    hidden, weight, targets = _data(4, 64, 2000, "float32")
    weight[5] = 1e36
    hidden[2] = 10.0  # logit [2, 5] = 64 · 10 · 1e36 overflows fp32; the other rows stay finite
    # the row check reads the logits' finiteness back: on a GPU only under the checking policy
    with nan_policy("raise"), pytest.raises(ValueError, match=r"^hidden: rows \[2\] are not finite in the logits"):
        logprob.linear_token_logprobs(hidden, weight, targets)


@gpu
def test_profiler_kernel_names_carry_the_prefix():
    hidden, weight, targets = _data(256, 256, 151936, "bfloat16", seed=1)

    def call():
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        lp, ent = logprob.linear_token_logprobs(h, w, targets, 0.9, True)
        (lp.sum() + ent.sum()).backward()

    check_profiler_names(
        f"{MODULE}.fused", call,
        {"rlk_linear_logprob_fold", "rlk_linear_logprob_dlogits", "rlk_linear_fwd", "rlk_linear_dx", "rlk_linear_dw"},
        "linear_logprob",
    )


def _extra_peak(fn) -> int:
    """Bytes allocated by ``fn`` at its peak above what was allocated before (outputs included)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


@gpu
def test_peak_memory_fused_much_below_naive():
    """N = 4096, H = 2048, V = 65536 bf16: the fused forward's extra memory is bounded by its
    logits chunk plus outputs, forward + backward by ``workspace_bytes`` of its chunks plus the
    gradients — at most the size of ``hidden``, below what Liger-Kernel's fused linear
    cross-entropy holds at this shape (its chunk rule: 32 MiB); both far below the naive path's
    materialised logits."""
    from rl_engine.backends.triton import logprob as tlp

    N, H, V = 4096, 2048, 65536
    hidden, weight, targets = _data(N, H, V, "bfloat16", seed=9)
    fused_fwd = lambda: logprob.linear_token_logprobs(hidden, weight, targets, 1.0, True)  # noqa: E731

    def naive_fwd():
        ls = torch.log_softmax(F.linear(hidden, weight).float(), -1)
        return ls.gather(1, targets[:, None]).squeeze(1), -(ls.exp() * ls).sum(-1)

    def fused_fwd_bwd():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        lp, ent = logprob.linear_token_logprobs(h, w, targets, 1.0, True)
        (lp.sum() + ent.sum()).backward()
        return h.grad, w.grad

    def naive_fwd_bwd():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        ls = torch.log_softmax(F.linear(h, w).float(), -1)
        (ls.gather(1, targets[:, None]).sum() - (ls.exp() * ls).sum()).backward()
        return h.grad, w.grad

    fused_fwd(), fused_fwd_bwd()  # compile outside the measurement
    got = {name: _extra_peak(fn) for name, fn in
           (("fused_fwd", fused_fwd), ("naive_fwd", naive_fwd), ("fused_fwd_bwd", fused_fwd_bwd), ("naive_fwd_bwd", naive_fwd_bwd))}
    scoring = tlp._chunks(N, H, V, torch.bfloat16, None, None, training=False)
    training = tlp._chunks(N, H, V, torch.bfloat16, None, None, training=True)
    outputs = 3 * N * 4 + 4 * scoring.fwd_rows * 4 + N * H  # lp, entropy, lse; the fold state; hidden's NaN scan
    grads = (N + V) * H * 2
    fwd_bound = scoring.fwd_rows * scoring.fwd_cols * 2 + outputs
    workspace = tlp.workspace_bytes(training, N, H, V, torch.bfloat16)
    assert workspace <= N * H * 2 + 16 * training.fwd_rows < _liger_workspace(N, H, V, 2)
    bwd_bound = workspace + grads + outputs
    evidence("linear_logprob_peak_memory", {"shape": [N, H, V], "extra_bytes": got, "fwd_bound": fwd_bound,
                                            "fwd_bwd_bound": bwd_bound, "liger_workspace": _liger_workspace(N, H, V, 2)})
    slack = 2 * 2**20  # allocator rounding
    assert got["fused_fwd"] <= fwd_bound + slack, got
    assert got["fused_fwd_bwd"] <= bwd_bound + slack, got
    assert got["fused_fwd_bwd"] - grads - outputs <= _liger_workspace(N, H, V, 2), got
    assert got["naive_fwd"] >= 2 * N * V * 4, "the measurement missed the naive path's [N, V] fp32 tensors"
    assert got["fused_fwd"] <= 0.15 * got["naive_fwd"], got
    assert got["fused_fwd_bwd"] - grads <= 0.25 * (got["naive_fwd_bwd"] - grads), got


@gpu
def test_bounded_performance_forward_vs_unfused():
    """Fused forward at N = 4096, H = 1024, V = 151936 bf16 within 1.5x of the unfused Triton
    path (same GEMM work; the fused one adds a fold per chunk), same device and run."""
    hidden, weight, targets = _data(4096, 1024, 151936, "bfloat16", seed=2)
    # eager timing: the public ops check their arguments on the host (no CUDA-graph capture)
    ours = event_us(lambda: logprob.linear_token_logprobs(hidden, weight, targets, 1.0, True))
    base = event_us(lambda: unfused(hidden, weight, targets))
    evidence("bounded_perf_linear_logprob", {"shape": [4096, 1024, 151936], "fused_us": ours, "unfused_us": base})
    assert ours <= 1.5 * base, f"{ours:.1f} us vs unfused {base:.1f} us"


@gpu
def test_bounded_performance_forward_backward_vs_unfused():
    """Fused forward + backward (grads to hidden and weight, both outputs in the loss) at N = 2048,
    H = 4096, V = 151936 bf16 within 3x of the unfused Triton path (which holds the [N, V] logits
    and runs 3 GEMMs; the fused one runs 5 with a training call's default chunks and never holds
    them), same device and run; expected about 5/3 (scalar-loaded dx/dW tiles would be ~18x the
    naive path)."""
    hidden = gpu_randn((2048, 4096), 2, torch.bfloat16)
    weight = gpu_randn((151936, 4096), 3, torch.bfloat16, scale=3.0 / 4096**0.5)
    targets = torch.randint(0, 151936, (2048,), device="cuda")
    up = gpu_randn((2048,), 4)

    def fwd_bwd(fn):
        def run():
            h = hidden.detach().requires_grad_()
            w = weight.detach().requires_grad_()
            lp, ent = fn(h, w)
            ((lp * up).sum() + (ent * up).sum()).backward()
        return run

    ours = event_us(fwd_bwd(lambda h, w: logprob.linear_token_logprobs(h, w, targets, 1.0, True)))
    base = event_us(fwd_bwd(lambda h, w: unfused(h, w, targets)))
    evidence("bounded_perf_linear_logprob_fwd_bwd", {"shape": [2048, 4096, 151936], "fused_us": ours, "unfused_us": base})
    assert ours <= 3.0 * base, f"{ours:.1f} us vs unfused {base:.1f} us"


# ---------------------------------------------------------------------------------------------
# processed log-probs (kept-set records) and the fp32 LM head (contract variants)


def processed_failures(candidate, hidden, weight, targets, kept, temperature, chunkings, logits_dtype=None):
    """Raw-bit differences of ``candidate(..., kept=, logits_dtype=)`` from the unfused processed path."""
    def unfused_processed(h, w, t):
        logits = gemm.linear(h, w, out_dtype=logits_dtype)
        return (logprob.token_logprobs(logits, t, temperature, kept=kept),
                logprob.entropy(logits, temperature, kept=kept))

    want = outputs_and_grads(unfused_processed, hidden, weight, targets)
    failures = []
    for tc, vc in chunkings:
        got = outputs_and_grads(lambda h, w, t: candidate(h, w, t, temperature, True, token_chunk=tc, vocab_chunk=vc,
                                                          kept=kept, logits_dtype=logits_dtype),
                                hidden, weight, targets)
        failures += [f"token_chunk={tc}, vocab_chunk={vc}, {n}: {same_bits(a, b)}"
                     for n, a, b in zip(OUTPUT_NAMES, got, want) if not same_bits(a, b).equal]
    return failures


def _records_of(logits, temperature, seed):
    """Canonical records of ``logits`` at ``temperature`` and a kept target per row (CPU)."""
    from rl_engine.ops.logprob import kept_set, scale_logits

    g = torch.Generator().manual_seed(seed)
    kept = kept_set(logits, temperature, torch.randint(1, 300, (logits.shape[0],), generator=g), 0.9)
    targets = torch.multinomial(kept.mask(scale_logits(logits, temperature)).float(), 1, generator=g).squeeze(1)
    return kept, targets


@interp
@pytest.mark.parametrize("fp32_logits", [False, True])
def test_interpreter_processed_fused_equals_unfused_kernels(fp32_logits):
    """In the Triton interpreter: the fused fold and gradient kernels with kept-set records
    (absolute column ids over three vocabulary chunks, the last ragged) give the bits of the
    unfused kernels on the whole logits — forward, and both gradients by both backward
    strategies — also with fp32 logits from 16-bit inputs (``fp32_logits``: the gradient rounded
    once to the input dtype into a separate block; float16 here, as the interpreter reads bf16
    storage wrongly); dropped entries get a ``+0`` logits gradient. A negative control — the
    records applied with chunk-relative column ids — is caught by the same comparison."""
    from rl_engine.backends.triton.gemm import kernels as gk
    from rl_engine.backends.triton.logprob import kernels as K

    fused = fused_mod()
    N, H, V, T = 20, 32, 2100, 0.8
    g = torch.Generator().manual_seed(0)
    dt = torch.float16 if fp32_logits else torch.float32
    h, w = torch.randn(N, H, generator=g).to(dt), (torch.randn(V, H, generator=g) * 0.3).to(dt)
    logits = gk.forward(h, w, None, out_dtype=torch.float32, allow_tma=False)
    kept, t = _records_of(logits, T, 1)
    kt, kb = kept.threshold, kept.boundary
    _, lp_u, lse_u, ent_u = K.forward(logits, T, targets=t, entropy=True, kept_threshold=kt, kept_boundary=kb)
    lp_f, ent_f, lse_f = fused.forward(h, w, t, T, True, 7, 1024, kt, kb, fp32_logits)
    assert same_bits(lp_u, lp_f) and same_bits(ent_u, ent_f) and same_bits(lse_u, lse_f)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    d_lp = K.token_logprobs_backward(g_lp, logits, t, lse_u, T, kt, kb)
    d_ent = K.entropy_backward(g_ent, logits, lse_u, ent_u, T, kt, kb)
    keep = kept.mask(logits / T)
    assert bool((d_lp[~keep] == 0).all()) and not bool(torch.signbit(d_lp[~keep]).any())
    dl = (d_lp + d_ent).to(dt)
    want = (gk.grad_input(dl, w), gk.grad_weight(dl, h))
    for chunks in ((N, 1024, 1024), (7, 1024, 2048)):  # the shared pass; separate passes
        got = fused.backward(g_lp, g_ent, h, w, t, lse_f, ent_f, T, *chunks, True, True, kt, kb, fp32_logits)
        assert got[0].dtype == dt and same_bits(got[0], want[0]) and same_bits(got[1], want[1]), chunks
    full_lp = K.forward(logits, T, targets=t)[1]
    assert not same_bits(full_lp, lp_u).equal, "the full-vocabulary log-prob must differ from the processed one"
    # a target outside its kept set (drifted logits) counts as kept, fused and unfused alike
    t2 = t.clone()
    t2[3] = int(torch.nonzero(~keep[3])[-1])
    lp2_u = K.forward(logits, T, targets=t2, kept_threshold=kt, kept_boundary=kb)[1]
    lp2_f = fused.forward(h, w, t2, T, False, 7, 1024, kt, kb, fp32_logits)[0]
    assert same_bits(lp2_u, lp2_f) and bool(torch.isfinite(lp2_u).all())
    # negative control: records applied per chunk with chunk-relative ids
    bad = [K.forward(logits[:, c0 : c0 + 1024].contiguous(), T, targets=torch.zeros_like(t), kept_threshold=kt,
                     kept_boundary=kb)[2] for c0 in range(0, V, 1024)]
    bad_lse = torch.logsumexp(torch.stack(bad, 1), 1)
    assert not same_bits(bad_lse, lse_u).equal


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("n,h,v", [(130, 64, 5000), (40, 64, 3005)])
def test_processed_raw_bit_equal_to_unfused_across_chunkings(dtype, temperature, n, h, v):
    """Processed variant: fused == unfused with the same records, forward and both grads, for
    every chunking (V % 16 != 0 included: the unspecialised fold)."""
    hidden, weight, _ = _data(n, h, v, dtype, seed=n + v)
    kept, targets = _records_of(gemm.linear(hidden, weight).cpu(), temperature, n)
    kept, targets = kept.to("cuda"), targets.cuda()
    failures = processed_failures(logprob.linear_token_logprobs, hidden, weight, targets, kept, temperature, CHUNKINGS)
    evidence(f"linear_logprob_processed_bits_{dtype}_{temperature}_{n}x{h}x{v}", {"chunkings": CHUNKINGS, "failures": failures})
    assert failures == [], failures[:5]


@gpu
@pytest.mark.parametrize("processed", [False, True])
@pytest.mark.parametrize("n,h,v", [(130, 64, 5000), (40, 64, 3005)])
def test_fp32_logits_raw_bit_equal_to_unfused_fp32_logits(processed, n, h, v):
    """fp32 LM head (bf16 in): fused == ``token_logprobs`` / ``entropy`` of ``gemm.linear(...,
    out_dtype=float32)``, forward and both grads, with and without records; the default mode
    (bf16-rounded logits) in its place is caught by the same checker (negative control)."""
    hidden, weight, _ = _data(n, h, v, "bfloat16", seed=n + v)
    logits32 = gemm.linear(hidden, weight, out_dtype=torch.float32)
    assert logits32.dtype == torch.float32
    kept, targets = _records_of(logits32.cpu(), 0.9, n)
    kept, targets = (kept.to("cuda") if processed else None), targets.cuda()
    failures = processed_failures(logprob.linear_token_logprobs, hidden, weight, targets, kept, 0.9, CHUNKINGS,
                                  logits_dtype=torch.float32)
    evidence(f"linear_logprob_fp32_logits_bits_{processed}_{n}x{h}x{v}", {"chunkings": CHUNKINGS, "failures": failures})
    assert failures == [], failures[:5]

    def default_mode(h_, w_, t_, temperature, return_entropy, *, token_chunk=None, vocab_chunk=None, kept=None,
                     logits_dtype=None):
        return logprob.linear_token_logprobs(h_, w_, t_, temperature, True, kept=kept)

    if not processed:
        assert processed_failures(default_mode, hidden, weight, targets, None, 0.9, [(None, None)],
                                  logits_dtype=torch.float32)


@gpu
def test_processed_negative_control_chunk_relative_mask_is_caught():
    hidden, weight, _ = _data(60, 64, 3100, "float32", seed=3)
    kept, targets = _records_of(gemm.linear(hidden, weight).cpu(), 0.8, 3)
    kept, targets = kept.to("cuda"), targets.cuda()

    def chunk_relative(h, w, t, temperature, return_entropy, *, token_chunk=None, vocab_chunk=None, kept=None,
                       logits_dtype=None):
        vc = vocab_chunk or 4096
        logits = gemm.linear(h, w)
        z = torch.cat([(lambda zc: zc.masked_fill(~kept.mask(zc, 0), float("-inf")))(logits[:, c0 : c0 + vc].float() / temperature)
                       for c0 in range(0, logits.shape[1], vc)], 1)
        logp = z - torch.logsumexp(z, -1, keepdim=True)
        p = logp.exp()
        return logp.gather(1, t[:, None]).squeeze(1), -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)

    assert processed_failures(chunk_relative, hidden, weight, targets, kept, 0.8, [(None, 1024)])


@gpu
def test_processed_dispatch_and_opcheck():
    import rl_engine.backends.triton.logprob  # noqa: F401

    hidden, weight, _ = _data(20, 64, 2100, "bfloat16", seed=6)
    kept, targets = _records_of(gemm.linear(hidden, weight, out_dtype=torch.float32).cpu(), 0.9, 6)
    kept, targets = kept.to("cuda"), targets.cuda()
    with provenance.record() as recs:
        logprob.linear_token_logprobs(hidden, weight, targets, 0.9, kept=kept, logits_dtype=torch.float32)
    assert [r.impl_id for r in recs] == [IMPL]
    _, rejections = select(make_request(OP, hidden, variants=frozenset({"processed", "fp32_logits"})))
    assert rejections == []
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    kt, kb = kept.threshold, kept.boundary
    torch.library.opcheck(torch.ops.rlk.linear_token_logprobs_triton.default,
                          (hidden.clone().requires_grad_(), weight.clone().requires_grad_(), targets, 0.9, True,
                           8, 1024, 8, 1024, 2048, kt, kb, True), test_utils=utils)
    lp, ent, lse = torch.ops.rlk.linear_token_logprobs_triton(hidden, weight, targets, 0.9, True, 8, 1024, 8, 1024, 2048,
                                                              kt, kb, True)
    g = torch.ones_like(lp)
    torch.library.opcheck(torch.ops.rlk.linear_token_logprobs_triton_backward.default,
                          (g, g, hidden, weight, targets, lse, ent, 0.9, 8, 1024, 2048, True, True, kt, kb, True),
                          test_utils=utils)
