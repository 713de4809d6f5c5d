"""Shared helpers of the attention tests (``tests/backends/triton/attention``): inputs, the GPU
paths as checker functions, decode caches and rows, CUDA-graph replay, the PDL race control and
the planted copies of the kernel modules (the negative controls' source edits). The fixtures that
use them are in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch

from rl_engine.ops.attention import ContiguousKVCache, PagedKVCache, cached_attention, varlen_attention
from rl_engine.utils.bits import same_bits
from rl_engine.validation.common.attention import Schedule
from tests.backends.triton._rowwise_common import interp, offline_sm90

__all__ = [
    "OPS",
    "IMPL",
    "MODULE",
    "DTYPES",
    "GARBAGE",
    "gpu",
    "interp",
    "offline_sm90",
    "make_qkv",
    "split",
    "gpu_train",
    "contiguous_cache",
    "paged_cache",
    "gpu_rollout",
    "cpu_io",
    "last_token_step",
    "decode_caches",
    "decode_rows",
    "assert_a_key_moves_its_sequence",
    "graph_replay",
    "assert_pdl_race_caught",
    "PLANTED_MODULES",
    "planted_kernels",
]

OPS = ("attention.varlen_attention", "attention.cached_attention")
IMPL = "triton.blocked_online_softmax"
MODULE = "rl_engine.backends.triton.attention"
DTYPES = ("float32", "bfloat16")
GARBAGE = 3.0e4  # stale cache content: large, so any leak into a visible row would show
gpu = pytest.mark.gpu


def make_qkv(lens, hkv, g, d, dtype, seed=0, q_scale=1.5):
    """CPU tensors (the checkers run the GPU paths through the wrappers below)."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    T = sum(lens)
    q = (torch.randn(T, hkv * g, d, generator=gen) * q_scale).to(dt)
    k = torch.randn(T, hkv, d, generator=gen).to(dt)
    v = torch.randn(T, hkv, d, generator=gen).to(dt)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def split(n, sizes):
    """Chunks of ``sizes`` (as far as they fit) and the remainder: they sum to ``n``."""
    out = []
    for c in sizes:
        if 0 < c <= n - sum(out):
            out.append(c)
    rest = n - sum(out)
    return out + ([rest] if rest else [])


# --------------------------------------------------------------------------- GPU paths as checker functions


def gpu_train(*, scale=None, window=None):
    """The train path on the GPU for CPU inputs (differentiable through the device copies)."""

    def run(q, k, v, cu):
        return varlen_attention(q.cuda(), k.cuda(), v.cuda(), cu.cuda(), scale=scale, window=window).cpu()

    return run


def contiguous_cache(stale: bool):
    def make(hkv, d, dtype, max_len, num_seqs):
        cache = ContiguousKVCache(num_seqs, max_len, hkv, d, dtype=dtype, device="cuda")
        if stale:  # unused slots and positions hold garbage, as after earlier sequences
            cache.k.uniform_(-GARBAGE, GARBAGE)
            cache.v.uniform_(-GARBAGE, GARBAGE)
        return cache

    return make


def paged_cache(block_size: int, fragment: bool = True):
    """A paged pool on the GPU whose pages are handed out out of order and hold stale data: two
    filler sequences written interleaved, then one freed, leaving holes among used pages."""

    def make(hkv, d, dtype, max_len, num_seqs):
        per_seq = -(-max_len // block_size)
        filler = 3 if fragment else 0
        cache = PagedKVCache(num_seqs * per_seq + 2 * filler, block_size, hkv, d, dtype=dtype, device="cuda",
                             max_seqs=num_seqs + 2, max_blocks_per_seq=max(per_seq, filler))
        gen = torch.Generator().manual_seed(block_size)
        for _ in range(filler):
            for slot in (num_seqs, num_seqs + 1):
                x = ((torch.rand(block_size, hkv, d, generator=gen) * 2 - 1) * GARBAGE).to(dtype).cuda()
                cached_attention(x, x, x, cache, [slot], torch.tensor([0, block_size], device="cuda"))
        if filler:
            cache.free(num_seqs)
        return cache

    return make


def gpu_rollout(cache_factory=None, *, scale=None, window=None, slots=None):
    """The rollout path on the GPU (``cached_attention`` per schedule step) for CPU inputs."""
    factory = cache_factory or contiguous_cache(stale=True)

    def run(q, k, v, cu_seqlens, schedule: Schedule):
        c = [int(x) for x in cu_seqlens.tolist()]
        bounds = list(zip(c[:-1], c[1:]))
        ids = list(slots) if slots is not None else list(range(len(bounds)))
        max_len = max([1] + [e - s for s, e in bounds])
        cache = factory(k.shape[1], k.shape[2], q.dtype, max_len, max(ids) + 1 if ids else 1)
        qd, kd, vd = q.cuda(), k.cuda(), v.cuda()
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        done = [0] * len(bounds)
        for step in schedule:
            rows = []
            for i, n in step:
                s = bounds[i][0] + done[i]
                rows.append(torch.arange(s, s + n))
                done[i] += n
            idx = torch.cat(rows).cuda()
            cu = torch.tensor([0] + list(torch.tensor([n for _, n in step]).cumsum(0).tolist()), device="cuda")
            out[idx] = cached_attention(qd[idx], kd[idx], vd[idx], cache, [ids[i] for i, _ in step], cu,
                                        scale=scale, window=window)
        return out.cpu()

    return run


def cpu_io(fn):
    """``fn`` on GPU copies of its floating-point tensor arguments, the result back on the CPU."""

    def run(*args):
        return fn(*[a.cuda() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]).cpu()

    return run


# --------------------------------------------------------------------------- decode steps


def last_token_step(hkv, seed):
    """``launch.cached_forward``'s positional arguments for a decode step of the last tokens of
    three sequences of 40, 150 and 300 tokens (fp32, G = 2, D = 32) over their packed rows as a
    contiguous cache of 320 positions (scale 0.2, no window)."""
    lens = [40, 150, 300]
    q, k, v, cu = make_qkv(lens, hkv, 2, 32, "float32", seed=seed)
    qd = q[(cu[1:] - 1).long()].contiguous()
    page_rows = cu[:-1].to(torch.int64)[:, None].contiguous()
    return qd, k, v, page_rows, 320, torch.arange(3), torch.tensor(lens) - 1, 0.2, None


def decode_caches(k, v, cu, lens, ps, seed):
    """Key / value storage rows of sequences ``lens`` (rows ``cu``) and the step's ``page_rows``:
    ``ps``-key pages in shuffled order (unused table entries point at a page of NaN), or, with
    ``ps=None``, one contiguous run per sequence followed by 70 rows of NaN (stale slots: a read
    past a sequence's written rows shows)."""
    hkv, d = k.shape[1], k.shape[2]
    if ps is None:
        starts, at = [], 0
        for x in lens:
            starts.append(at)
            at += x + 70
        kc = torch.full((at, hkv, d), float("nan"), dtype=k.dtype, device=k.device)
        vc = torch.full_like(kc, float("nan"))
        for i, x in enumerate(lens):
            kc[starts[i] : starts[i] + x] = k[cu[i] : cu[i] + x]
            vc[starts[i] : starts[i] + x] = v[cu[i] : cu[i] + x]
        return kc, vc, torch.tensor(starts, dtype=torch.int64, device=k.device)[:, None].contiguous()
    gen = torch.Generator().manual_seed(seed)
    npages = [-(-x // ps) for x in lens]
    total = sum(npages) + 1  # the last page: NaN, where every unused table entry points
    order = torch.randperm(total - 1, generator=gen).tolist()
    kc = torch.full((total * ps, hkv, d), float("nan"), dtype=k.dtype, device=k.device)
    vc = torch.full_like(kc, float("nan"))
    table = torch.full((len(lens), max(npages) + 1), (total - 1) * ps, dtype=torch.int64)
    at = 0
    for i, x in enumerate(lens):
        for j in range(npages[i]):
            page = order[at]
            at += 1
            table[i, j] = page * ps
            lo, hi = j * ps, min(x, (j + 1) * ps)
            kc[page * ps : page * ps + hi - lo] = k[cu[i] + lo : cu[i] + hi]
            vc[page * ps : page * ps + hi - lo] = v[cu[i] + lo : cu[i] + hi]
    return kc, vc, table.to(k.device)


def assert_a_key_moves_its_sequence(step, kc, row0, q_seq, got):
    """The negative control of the decode bits tests: position 5 of sequence 0 (storage row
    ``row0 + 5``, kv head 0), which every query of it sees, perturbed, ``step(kc)`` moves that
    sequence's rows of ``got`` and no other."""
    k2 = kc.clone()
    k2[row0 + 5, 0, 3] += 0.5
    moved = step(k2)
    first = int((q_seq == 0).sum())
    assert not same_bits(moved[:first], got[:first]) and same_bits(moved[first:], got[first:])


def decode_rows(lens, cu, n):
    """A decode step of each sequence's last ``min(n, len)`` tokens: their packed rows (into the
    varlen tensors of ``cu``), sequence indices and positions, on the GPU."""
    rows = torch.cat([torch.arange(int(cu[i + 1]) - min(n, x), int(cu[i + 1])) for i, x in enumerate(lens)]).cuda()
    q_seq = torch.cat([torch.full((min(n, x),), i) for i, x in enumerate(lens)]).cuda()
    q_pos = torch.cat([torch.arange(x - min(n, x), x) for x in lens]).cuda()
    return rows, q_seq, q_pos


# --------------------------------------------------------------------------- programmatic dependent launch


def graph_replay(fn):
    """``fn()`` captured in a CUDA graph (after an eager warm-up on a side stream), replayed once."""
    from benchmarks.common.harness import capture_cuda_graph

    graph, out = capture_cuda_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    return out


def assert_pdl_race_caught(waits, skips, out_of, want, label):
    """The negative control of the PDL tests: ``waits`` / ``skips`` run an attention call of a
    planted module after a slowed table kernel, with and without the device-side wait; ``out_of``
    picks the output compared with ``want``. Both are compiled first (a first call's compilation
    between the two launches outlasts the slow table kernel, so the attention kernel would start
    after it whatever the wait). A race: the copy without the wait reads the table before the slow
    kernel writes it unless the GPU runs the two kernels apart (other test processes share it), so
    it must be caught at least once in 20 tries (the loop stops at the first catch; a GPU shared with
    15 other test processes has let five pass uncaught); the copy that waits is
    right every time."""
    kept = [waits(), skips()]  # outputs stay alive: a freed one's memory could come back holding the right rows
    torch.cuda.synchronize()
    for fn, caught in ((waits, False), (skips, True)):
        results = []
        for _ in range(20 if caught else 2):
            # the output memory the caching allocator hands out next holds NaN, not an earlier result
            poison = torch.full_like(want, float("nan"))
            del poison
            kept.append(fn())
            torch.cuda.synchronize()
            results.append(bool(same_bits(out_of(kept[-1]), want)))
            if caught and not results[-1]:
                break
        if caught:
            assert not all(results), (label, "the copy without the wait was never caught")
        else:
            assert all(results), (label, "the copy that waits", results)


# --------------------------------------------------------------------------- planted negative controls

#: The modules a planted copy holds: every module with kernel code, and the launchers that import
#: them. ``configs``, ``eligibility`` and ``tuning`` stay the package's: the selection rules and the
#: switches (``attention_tuning``) are shared by the copy and the package.
PLANTED_MODULES = ("device", "portable_forward", "portable_backward", "split_kv_combine", "tile_tables",
                   "hopper_common", "hopper_warpgroup", "hopper_transposed_decode", "launch")


@contextlib.contextmanager
def planted_kernels(edits: dict[str, tuple[tuple[str, str], ...]], tag: str) -> Iterator[object]:
    """A copy of ``PLANTED_MODULES`` with source ``edits`` (``{module: ((old, new), ...)}``, each
    ``old`` found exactly once in its module), as a package of its own whose modules import each
    other; yields its ``launch`` module. The copy is removed on exit."""
    unknown = set(edits) - set(PLANTED_MODULES)
    assert not unknown, unknown
    package = f"rlk_planted_{tag}_{os.getpid()}"
    root = tempfile.mkdtemp(prefix="rlk_planted_", dir=os.environ.get("TMPDIR"))
    here = os.path.join(root, package)
    os.makedirs(here)
    open(os.path.join(here, "__init__.py"), "w").close()
    source_dir = os.path.dirname(importlib.import_module(MODULE).__file__)
    names = "|".join(PLANTED_MODULES)
    try:
        for name in PLANTED_MODULES:
            with open(os.path.join(source_dir, f"{name}.py")) as f:
                text = f.read()
            for old, new in edits.get(name, ()):
                assert text.count(old) == 1, (name, old)
                text = text.replace(old, new)
            text = re.sub(rf"\b{re.escape(MODULE)}\.({names}) import", rf"{package}.\1 import", text)
            text = re.sub(rf"\bfrom {re.escape(MODULE)} import ({names})$", rf"from {package} import \1", text,
                          flags=re.MULTILINE)
            with open(os.path.join(here, f"{name}.py"), "w") as f:
                f.write(text)
        sys.path.insert(0, root)
        yield importlib.import_module(f"{package}.launch")
    finally:
        for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
            sys.modules.pop(name, None)
        if root in sys.path:
            sys.path.remove(root)
        shutil.rmtree(root, ignore_errors=True)
