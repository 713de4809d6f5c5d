"""logprob.linear_token_logprobs (fused LM head + token log-prob + entropy): raw-bit equality with
the unfused path across (token_chunk, vocab_chunk) settings, forward and both gradients; row and
chunk invariance with a negative control; accuracy; thread count; the memory bar; bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.common.harness import peak_memory
from rl_engine import contracts, runtime
from rl_engine.ops import gemm, logprob
from rl_engine.reference.logprob import linear_token_logprobs_f64
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common import check_row_invariance
from tests.helpers.determinism import run_to_run_failures
from tests.helpers.strategies import DTYPES, row_trials
from tests.helpers.threads import threads

OP = "logprob.linear_token_logprobs"
# (token_chunk, vocab_chunk); token chunks below the GEMM's 64-row tile are valid but pay for a
# whole tile per chunk, so the very small ones are exercised by the property test on small shapes
CHUNKINGS = [(None, None), (9, 1024), (64, 2048), (37, 3072), (100, 4096), (1000, 8192)]


def _data(n, h, v, dtype, seed=0, lead=None):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    shape = (n,) if lead is None else lead
    hidden = torch.randn(*shape, h, generator=g).to(dt)
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dt)
    targets = torch.randint(0, v, shape, generator=g)
    return hidden, weight, targets


def unfused(hidden, weight, targets, temperature=1.0, return_entropy=True):
    logits = gemm.linear(hidden, weight)
    lp = logprob.token_logprobs(logits, targets, temperature)
    return (lp, logprob.entropy(logits, temperature)) if return_entropy else lp


def outputs_and_grads(fn, hidden, weight, targets, use=("lp", "ent"), seed=1):
    """Forward outputs and grads of (hidden, weight) under a fixed upstream gradient."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets)
    g = torch.Generator().manual_seed(seed)
    g_lp, g_ent = torch.randn(lp.shape, generator=g), torch.randn(ent.shape, generator=g)
    terms = {"lp": (lp * g_lp).sum(), "ent": (ent * g_ent).sum()}
    sum(terms[k] for k in use).backward()
    return [lp.detach(), ent.detach(), h.grad, w.grad]


def chunk_failures(candidate, hidden, weight, targets, temperature, chunkings, use=("lp", "ent")):
    """Raw-bit differences between ``candidate(..., token_chunk, vocab_chunk)`` and the unfused
    path, for every chunking (empty list: equal everywhere)."""
    want = outputs_and_grads(lambda h, w, t: unfused(h, w, t, temperature), hidden, weight, targets, use)
    failures = []
    for tc, vc in chunkings:
        got = outputs_and_grads(
            lambda h, w, t: candidate(h, w, t, temperature, True, token_chunk=tc, vocab_chunk=vc), hidden, weight, targets, use
        )
        for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, want):
            d = same_bits(a, b)
            if not d.equal:
                failures.append(f"token_chunk={tc}, vocab_chunk={vc}, {name}: {d}")
    return failures


def chunk_dependent_fused(hidden, weight, targets, temperature=1.0, return_entropy=True, *, token_chunk=None, vocab_chunk=None):
    """Negative control: a chunked LM-head log-prob that merges whole vocabulary chunks (one
    ``logsumexp`` per chunk, chunk results combined) instead of fixed blocks, so its bits depend
    on ``vocab_chunk``."""
    vc = vocab_chunk or 4096
    logits = gemm.linear(hidden, weight)
    z = logits.float() / temperature
    parts = [torch.logsumexp(z[:, c : c + vc], dim=-1) for c in range(0, z.shape[1], vc)]
    lse = torch.logsumexp(torch.stack(parts, dim=-1), dim=-1)
    logp = z - lse.unsqueeze(1)
    lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_raw_bit_equal_to_unfused_forward_and_grads_across_chunkings(dtype, temperature):
    hidden, weight, targets = _data(100, 48, 4100, dtype, seed=1)
    failures = chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, temperature, CHUNKINGS)
    assert failures == [], failures[:5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use", [("lp",), ("ent",)])
def test_raw_bit_equal_when_only_one_output_enters_the_loss(dtype, use):
    hidden, weight, targets = _data(70, 32, 2100, dtype, seed=2)
    failures = chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, 1.0, [(16, 1024), (None, None)], use)
    assert failures == [], failures[:5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_chunk_dependent_merge_is_caught(dtype):
    """The same comparison must catch a log-prob whose reduction follows the vocabulary chunks."""
    hidden, weight, targets = _data(100, 48, 4100, dtype, seed=1)
    bad = chunk_failures(chunk_dependent_fused, hidden, weight, targets, 1.0, [(None, 1024), (None, 2048), (None, 3072)])
    assert bad, "a vocabulary-chunk-dependent reduction was not detected"


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=200)
@given(
    data=st.data(),
    n=st.integers(1, 20),
    h=st.sampled_from([8, 24]),
    v=st.integers(1, 2600),
    temperature=st.sampled_from((1.0, 0.7)),
    token_chunk=st.sampled_from([None, 1, 3, 8]),
)
def test_row_invariance_forward_and_grad(dtype, data, n, h, v, temperature, token_chunk):
    with threads(1):
        hidden, weight, targets = _data(n, h, v, dtype, seed=n * 31 + v + h)

        def fn(hid, tgt, w):
            return logprob.linear_token_logprobs(hid, w, tgt, temperature, True, token_chunk=token_chunk)

        rep = check_row_invariance(fn, [hidden, targets], data.draw(row_trials(n)), (weight,), grads=True)
        assert rep.ok, str(rep)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60)
@given(
    n=st.integers(1, 40),
    v=st.integers(1, 3100),
    token_chunk=st.integers(1, 45),
    vocab_chunk=st.sampled_from([1024, 2048, 3072]),
    temperature=st.sampled_from((1.0, 1.25)),
)
def test_chunk_invariance_property(dtype, n, v, token_chunk, vocab_chunk, temperature):
    with threads(1):
        hidden, weight, targets = _data(n, 16, v, dtype, seed=n + 7 * v)
        failures = chunk_failures(logprob.linear_token_logprobs, hidden, weight, targets, temperature, [(token_chunk, vocab_chunk)])
        assert failures == [], failures[:3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_return_entropy_false(dtype):
    hidden, weight, targets = _data(0, 40, 2500, dtype, seed=3, lead=(3, 11))
    lp = logprob.linear_token_logprobs(hidden, weight, targets, 0.9, token_chunk=5, vocab_chunk=1024)
    assert isinstance(lp, torch.Tensor) and lp.shape == (3, 11) and lp.dtype == torch.float32
    assert same_bits(lp, unfused(hidden, weight, targets, 0.9, return_entropy=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_forward_and_grads(dtype):
    dt = getattr(torch, dtype)
    hidden, weight, targets = _data(37, 64, 3000, dtype, seed=4)
    got = outputs_and_grads(lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 0.9, True), hidden, weight, targets)
    want = outputs_and_grads(lambda h, w, t: linear_token_logprobs_f64(h, w, t, 0.9, True), hidden.double(), weight.double(), targets)
    fwd = contracts.tolerance(OP, dt, "forward")
    bwd = contracts.tolerance(OP, dt, "backward")
    for a, b in zip(got[:2], want[:2]):
        assert fwd.check(a, b), fwd.max_violation(a, b)
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == dt
        assert bwd.check(a, b), bwd.max_violation(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bits_do_not_depend_on_the_thread_count(dtype):
    hidden, weight, targets = _data(130, 64, 3000, dtype, seed=5)
    fn = lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 1.0, True)  # noqa: E731
    with threads(1):
        one = outputs_and_grads(fn, hidden, weight, targets)
    with threads(2):
        two = outputs_and_grads(fn, hidden, weight, targets)
    for a, b in zip(one, two):
        assert same_bits(a, b)


def test_run_to_run_determinism_including_weight_grad():
    hidden, weight, targets = _data(90, 32, 2100, "bfloat16", seed=6)
    fn = lambda h, w: logprob.linear_token_logprobs(h, w, targets, 1.0, True, token_chunk=40)  # noqa: E731
    assert run_to_run_failures(fn, [hidden, weight]) == []


def test_memory_bar_at_4096x1024x32000():
    """Peak extra memory of the fused forward (what RL scoring runs) at T=4096, H=1024, V=32000
    is at most 5% of the naive path's ``[T, V]`` fp32 logits + log-softmax.

    Method: the torch profiler's allocation events (every CPU allocation and free torch makes,
    in time order), summed into a running total; the peak is its maximum above the level at the
    start of the call, outputs and argument checks included. The method is validated on the
    naive path at a smaller T, where it must see the two ``[T, V]`` fp32 tensors.
    """
    T, H, V = 4096, 1024, 32000
    naive_bytes = 2 * T * V * 4
    # bf16 is the larger case for the fused path (a bf16 logits chunk plus its fp32 copy)
    hidden, weight, targets = _data(T, H, V, "bfloat16", seed=7)
    fused, method = peak_memory(lambda: logprob.linear_token_logprobs(hidden, weight, targets))
    assert method == "torch.profiler"
    assert fused <= 0.05 * naive_bytes, f"fused peak {fused / 2**20:.1f} MiB > 5% of {naive_bytes / 2**20:.0f} MiB"
    t_small = 256
    h_s, t_s = hidden[:t_small], targets[:t_small]
    naive, _ = peak_memory(lambda: torch.log_softmax((h_s @ weight.T).float(), dim=-1).gather(1, t_s[:, None]))
    # the fused peak is the chunk temporaries: the exact GEMM's float64 partial products of a
    # [256, 4096] logits chunk and fp32 blocks of that shape (34.7 MiB on the 2-core CI machine);
    # the bound is eight fp32 blocks plus V·H bytes
    assert fused <= 8 * 256 * 4096 * 4 + V * H
    assert naive >= 2 * t_small * V * 4, "the profiler method missed the naive path's intermediates"


def test_dispatch_and_provenance():
    hidden, weight, targets = _data(4, 8, 50, "float32")
    with runtime.provenance.record() as recs:
        logprob.linear_token_logprobs(hidden, weight, targets)
    assert [(r.op, r.impl_id, r.fallback) for r in recs] == [(OP, "cpu.canonical_lse", False)]


def test_bad_input_messages_name_the_argument():
    hidden, weight, targets = _data(4, 8, 50, "float32")
    f = logprob.linear_token_logprobs
    with pytest.raises(ValueError, match="^vocab_chunk: expected a multiple of VOCAB_BLOCK=1024"):
        f(hidden, weight, targets, vocab_chunk=1000)
    with pytest.raises(ValueError, match="^vocab_chunk: expected a positive int"):
        f(hidden, weight, targets, vocab_chunk=0)
    with pytest.raises(ValueError, match="^token_chunk: expected a positive int"):
        f(hidden, weight, targets, token_chunk=-3)
    with pytest.raises(ValueError, match="^token_chunk: expected a positive int"):
        f(hidden, weight, targets, token_chunk=2.5)
    with pytest.raises(ValueError, match=r"^weight: expected shape \[V, 8\]"):
        f(hidden, torch.randn(50, 9), targets)
    with pytest.raises(ValueError, match="^weight: expected dtype"):
        f(hidden, weight.bfloat16(), targets)
    with pytest.raises(ValueError, match="^weight: expected a non-empty tensor"):
        f(hidden, torch.empty(0, 8), targets)
    with pytest.raises(ValueError, match=r"^targets: expected token ids in \[0, 50\)"):
        f(hidden, weight, torch.tensor([0, 1, 2, 50]))
    with pytest.raises(ValueError, match=r"^targets: expected shape \(4,\)"):
        f(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="^hidden: contains NaN"):
        f(torch.full((4, 8), float("nan")), weight, targets)
    with pytest.raises(ValueError, match="^hidden: expected a contiguous"):
        f(torch.randn(8, 4).t(), weight, targets)
    with pytest.raises(ValueError, match=r"^hidden: rows \[0\] are not finite"):
        f(torch.full((1, 8), 1e30), torch.full((50, 8), 1e30), targets[:1])
    with pytest.raises(TypeError, match="^return_entropy: expected a bool"):
        f(hidden, weight, targets, 1.0, 1)
    with pytest.raises(ValueError, match="^temperature: expected a finite value > 0"):
        f(hidden, weight, targets, 0.0)


def test_empty_batch():
    hidden, weight, _ = _data(0, 8, 50, "float32")
    lp, ent = logprob.linear_token_logprobs(hidden, weight, torch.empty(0, dtype=torch.long), return_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_only_the_needed_gradient_is_computed_and_it_is_bitwise(frozen):
    hidden, weight, targets = _data(40, 16, 2100, "bfloat16", seed=8)
    up = torch.randn(40, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (unfused, lambda h, w, t: logprob.linear_token_logprobs(h, w, t, 1.0, True, token_chunk=16)):
        h = hidden.clone().requires_grad_(frozen != "hidden")
        w = weight.clone().requires_grad_(frozen != "weight")
        lp, ent = fn(h, w, targets)
        ((lp + ent) * up).sum().backward()
        assert (h.grad is None) == (frozen == "hidden") and (w.grad is None) == (frozen == "weight")
        grads.append(h.grad if frozen == "weight" else w.grad)
    assert same_bits(grads[1], grads[0])
