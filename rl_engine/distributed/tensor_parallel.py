"""Tensor-parallel building blocks whose bits do not depend on the TP size, forward and backward.

Each block is an ``autograd.Function`` with explicit collectives over a
:class:`~rl_engine.distributed.transports.Group`; local arithmetic goes through
``rl_engine.ops`` (``gemm.linear``, ``embedding.embedding``), reductions over a sharded dimension
through :mod:`rl_engine.distributed.algorithms`. Activations are **replicated** on the TP ranks
unless a block says they are sharded (Megatron's layout without sequence parallelism). ``M``
rows (tokens, leading dims flattened), ``K`` input features, ``N`` output features, ``p`` ranks.

=====================  ==========================================================================
block                  forward / backward (what makes the bits TP-independent)
=====================  ==========================================================================
column-parallel        ``y_r = linear(x, W_r, b_r)``: column-chunk invariance of ``gemm.linear``.
linear                 ``dW_r, db_r``: row-local products. ``dx = Σ_r dy_r W_r`` reduces over the
                       sharded ``N``: the sharded exact GEMM (bits of the unsharded ``dy W``).
row-parallel linear    ``x_r`` ``[M, K_r]`` sharded, output replicated; one of four schemes:
                       ``full_k`` (``W_r`` = rows ``[N_r, K]`` with full K): all-gather ``x``,
                       ``y_r = linear(x, W_r)``, all-gather ``y`` — the bits of ``gemm.linear``
                       on every device (the vLLM plugin's scheme, ``RlkRowParallelLinear``);
                       ``exact_k`` (Megatron's ``[N, K_r]``): the sharded exact GEMM — the bits of
                       ``gemm.linear`` on the CPU; ``k_tree``: ``G`` fixed K blocks, fp32 partials
                       summed by the canonical tree (TP-independent, but its own bits, not
                       ``gemm.linear``'s); ``native``: the rounded partials all-reduced by the
                       backend — **not** TP-invariant, the negative control.
vocab-parallel         lookup of the in-shard tokens; the shards combined bit-pattern-exactly
embedding              (each element has one owner). Backward: the embedding op's own backward on
                       the in-shard tokens, in token order.
vocab-parallel         logits of the shard, per-block log-sum-exp statistics gathered and merged in
log-probs              block order (:mod:`~rl_engine.distributed.algorithms.vocab`); the target
                       logit from its owner. Backward: ``dW_r`` local, ``dh`` by the sharded exact
                       GEMM over the vocabulary.
=====================  ==========================================================================

Bias gradients and the ``dW`` products are computed exactly as the CPU ``gemm.linear``
backward computes them (``dW = exact(dyᵀ x)``, ``db = fixed_order_sum(dyᵀ)``), so on the CPU a
TP = 1 block has the bits of the unsharded model, forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl_engine.backends.cpu.logprob import fused_dlogits
from rl_engine.backends.cpu.logprob.lse import mask_kept, scale_logits
from rl_engine.distributed.algorithms.exact_k import sharded_k_matmul, tree_all_reduce
from rl_engine.distributed.algorithms.tree import check_blocks, tree_sum
from rl_engine.distributed.algorithms.vocab import VOCAB_BLOCK, merge_shard_stats, shard_block_stats
from rl_engine.distributed.transports import Group
from rl_engine.utils.reductions import fixed_order_sum

__all__ = [
    "ROW_SCHEMES",
    "choose_row_scheme",
    "shard_sizes",
    "column_parallel_linear",
    "row_parallel_linear",
    "vocab_parallel_embedding",
    "vocab_parallel_logprobs",
    "gather_heads",
    "slice_heads",
]

#: Row-parallel schemes: TP-invariant (``full_k``, ``exact_k``, ``k_tree``) and the control.
ROW_SCHEMES = ("full_k", "exact_k", "k_tree", "native")
def choose_row_scheme(K: int, N: int, dtype: torch.dtype, device_type: str) -> str:
    """The cheaper of the two row-parallel schemes with ``gemm.linear``'s bits, for a ``[M, K] → [M, N]`` layer.

    On CUDA/ROCm ``full_k`` (``exact_k``'s float64 GEMMs run at ~1/12 of the bf16 tensor-core
    rate on an H200; docs/distributed.md). On the CPU, where both give the unsharded bits:
    ``exact_k`` when ``K > 2N`` (the all-gather of ``x`` outweighs the float64 all-reduce) or
    for float32, else ``full_k`` — the choice measured by ``benchmarks/distributed/bench_tp_schemes.py``.
    """
    if device_type != "cpu":
        return "full_k"
    return "exact_k" if (K > 2 * N or dtype == torch.float32) else "full_k"


#: Fixed number of K blocks of the ``k_tree`` scheme (independent of the TP size; TP ≤ 8).
K_TREE_BLOCKS = 8
_TOKEN_BUDGET_BYTES = 256 << 20


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    from rl_engine.ops.gemm import linear

    return linear(x.contiguous(), w.contiguous(), b)


def _weight_grad(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``dW = dyᵀ x`` ``[N, K]`` from ``dy`` ``[M, N]`` and ``x`` ``[M, K]`` (the linear backward's product)."""
    return _linear(dy2.t(), x2.t())


def _bias_grad(dy2: torch.Tensor) -> torch.Tensor:
    return fixed_order_sum(dy2.t().contiguous().float()).to(dy2.dtype)


def shard_sizes(total: int, parts: int, *, name: str = "size") -> list[int]:
    """Equal shards of ``total`` over ``parts`` ranks (``ValueError`` naming ``name`` if it does not divide)."""
    if total % parts:
        raise ValueError(f"{name}: {total} is not divisible by the tensor-parallel size {parts}")
    return [total // parts] * parts


# ------------------------------------------------------------------------------------------------
# column-parallel linear


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group: Group, n_total: int):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.n_total, ctx.has_bias = group, n_total, bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, w.shape[0]).contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = sharded_k_matmul(dy2, w.t(), ctx.group, k_total=ctx.n_total).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(dy2, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _bias_grad(dy2)
        return dx, dw, db, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                           *, n_total: int | None = None) -> torch.Tensor:
    r"""Column-parallel ``y_r = x W_rᵀ + b_r`` with a TP-invariant backward.

    .. math:: y_r = x W_r^\top + b_r, \qquad \frac{\partial L}{\partial x} = \sum_r dy_r W_r
              \ (\text{exact over the sharded } N)

    Shapes:
        x: ``[..., K]`` replicated; weight: ``[N_r, K]`` this rank's rows; bias: ``[N_r]`` or
        ``None``; returns ``[..., N_r]`` (the columns of the full output this rank owns).

    Args:
        n_total: ``N`` of the whole layer (default: ``N_r · size``).

    The forward is ``gemm.linear`` on the shard (raw-bit equal to those columns of the full
    product by column-chunk invariance); ``dx`` is the sharded exact GEMM, the same on every
    rank and raw-bit equal to the unsharded ``dy W`` on the CPU.
    """
    n_total = weight.shape[0] * group.size if n_total is None else n_total
    return _ColumnParallel.apply(x, weight, bias, group, n_total)


# ------------------------------------------------------------------------------------------------
# row-parallel linear


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group: Group, scheme: str, k_sizes: tuple[int, ...], n_sizes: tuple[int, ...]):
        lead, K_r = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K_r).contiguous()
        r = group.rank
        ctx.group, ctx.scheme, ctx.k_sizes, ctx.n_sizes, ctx.lead = group, scheme, k_sizes, n_sizes, lead
        ctx.has_bias = bias is not None
        K = sum(k_sizes)
        if scheme == "full_k":
            x_full = group.all_gather_sizes(x2, list(k_sizes), dim=1)
            y_r = _linear(x_full, weight, bias)
            y = group.all_gather_sizes(y_r, list(n_sizes), dim=1)
            ctx.save_for_backward(x_full, weight)
        else:
            if scheme == "exact_k":
                y = sharded_k_matmul(x2, weight, group, k_total=K)
            elif scheme == "k_tree":
                y = _k_tree_forward(x2, weight, group, K)
            else:  # native: rounded partials, backend all-reduce (the negative control)
                y = group.all_reduce_native(_linear(x2, weight))
            if bias is not None:
                y = y + bias
            ctx.save_for_backward(x2, weight)
        del r
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        group = ctx.group
        N = sum(ctx.n_sizes)
        dy2 = dy.reshape(-1, N).contiguous()
        dx = dw = db = None
        if ctx.scheme == "full_k":
            lo = sum(ctx.n_sizes[: group.rank])
            dy_r = dy2[:, lo: lo + ctx.n_sizes[group.rank]].contiguous()
            if ctx.needs_input_grad[0]:
                equal = len(set(ctx.k_sizes)) == 1
                dx = sharded_k_matmul(dy_r, w.t(), group, k_total=N, scatter=equal)
                if not equal:
                    k0 = sum(ctx.k_sizes[: group.rank])
                    dx = dx[:, k0: k0 + ctx.k_sizes[group.rank]].contiguous()
            if ctx.needs_input_grad[1]:
                dw = _weight_grad(dy_r, x2)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = _bias_grad(dy_r)
        else:
            if ctx.needs_input_grad[0]:
                dx = _linear(dy2, w.t())
            if ctx.needs_input_grad[1]:
                dw = _weight_grad(dy2, x2)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = _bias_grad(dy2)
        if dx is not None:
            dx = dx.reshape(*ctx.lead, dx.shape[-1])
        return dx, dw, db, None, None, None, None


def _k_tree_forward(x2: torch.Tensor, w: torch.Tensor, group: Group, K: int) -> torch.Tensor:
    """Fixed ``K_TREE_BLOCKS`` K blocks, fp32 partials by ``gemm.linear``, the canonical tree over
    blocks (local subtree, then :func:`tree_all_reduce` over the ranks), rounded to the dtype."""
    G, p = K_TREE_BLOCKS, group.size
    check_blocks(G, p, name="tensor-parallel size")
    if K % G:
        raise ValueError(f"x: the k_tree scheme splits K = {K} into {G} equal blocks; K must be divisible by {G}")
    kb = K // G
    local = [_linear(x2[:, j * kb:(j + 1) * kb].float(), w[:, j * kb:(j + 1) * kb].float()) for j in range(G // p)]
    return tree_all_reduce(tree_sum(local), group).to(x2.dtype)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, *,
                        scheme: str = "full_k", k_sizes: Sequence[int] | None = None,
                        n_sizes: Sequence[int] | None = None) -> torch.Tensor:
    r"""Row-parallel ``y = x Wᵀ + b`` over a K-sharded input, output replicated.

    .. math:: y = \sum_r x_r W_{:, K_r}^\top + b \quad (\text{one canonical reduction order})

    Shapes (``x`` ``[..., K_r]`` this rank's K shard, returns ``[..., N]`` on every rank):
        ``scheme="full_k"``: weight ``[N_r, K]`` (this rank's output rows, full K), bias
        ``[N_r]`` or ``None``. Other schemes: weight ``[N, K_r]``, bias ``[N]`` or ``None``.

    Args:
        scheme: one of :data:`ROW_SCHEMES` (see the module table; ``native`` is the control).
        k_sizes: every rank's ``K_r`` (default: equal shards of ``K_r · size``).
        n_sizes: ``full_k``: every rank's ``N_r`` (default equal); ignored otherwise.

    Raises:
        ValueError: unknown ``scheme``, shapes that do not match the scheme's layout, a
            ``k_tree`` K not divisible by its block count or a TP size that is not a power of two.
    """
    if scheme not in ROW_SCHEMES:
        raise ValueError(f"scheme: expected one of {ROW_SCHEMES}, got {scheme!r}")
    p = group.size
    k_sizes = tuple(k_sizes) if k_sizes is not None else (x.shape[-1],) * p
    if len(k_sizes) != p or k_sizes[group.rank] != x.shape[-1]:
        raise ValueError(f"k_sizes: expected {p} sizes with this rank's = {x.shape[-1]}, got {k_sizes}")
    if scheme == "full_k":
        n_sizes = tuple(n_sizes) if n_sizes is not None else (weight.shape[0],) * p
        if weight.shape[1] != sum(k_sizes) or n_sizes[group.rank] != weight.shape[0]:
            raise ValueError(f"weight: the full_k scheme expects this rank's rows [N_r, K] = [{n_sizes[group.rank]}, "
                             f"{sum(k_sizes)}], got {tuple(weight.shape)}")
    else:
        if weight.shape[1] != x.shape[-1]:
            raise ValueError(f"weight: the {scheme} scheme expects [N, K_r] with K_r = {x.shape[-1]}, got {tuple(weight.shape)}")
        n_sizes = (weight.shape[0],)
    return _RowParallel.apply(x, weight, bias, group, scheme, k_sizes, tuple(n_sizes))


# ------------------------------------------------------------------------------------------------
# vocabulary-parallel embedding


class _OneOwnerAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group: Group):
        return group.all_reduce_one_owner(t)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int, group: Group) -> torch.Tensor:
    """Embedding lookup with the table's rows ``[start, start + V_r)`` on this rank.

    Shapes:
        ids: ``[...]`` int64/int32 token ids (global); weight: ``[V_r, H]``; returns ``[..., H]``
        replicated — every row a bit copy of the owner's table row (``-0.0`` kept).

    Backward: ``embedding.embedding``'s own backward on the in-shard tokens in token order, so
    every table row's gradient has the single-process bits.
    """
    flat = ids.reshape(-1)
    V_r, H = weight.shape
    mask = (flat >= start) & (flat < start + V_r)
    idx = torch.nonzero(mask).squeeze(1)
    out = weight.new_zeros((flat.shape[0], H))
    if idx.numel():
        from rl_engine.ops.embedding import embedding

        local = embedding((flat.index_select(0, idx) - start).contiguous(), weight)
        out = out.index_copy(0, idx, local)
    else:  # no token of this shard: keep the table in the graph (its gradient is +0, as at TP = 1)
        out = out + weight.narrow(0, 0, 0).sum()
    out = _OneOwnerAllReduce.apply(out, group)
    return out.reshape(*ids.shape, H)


# ------------------------------------------------------------------------------------------------
# head-sharded activations through a replicated-parameter op


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, dim: int):
        ctx.group, ctx.dim, ctx.n = group, dim, x.shape[dim]
        return group.all_gather(x, dim=dim)

    @staticmethod
    def backward(ctx, dy):
        return dy.narrow(ctx.dim, ctx.group.rank * ctx.n, ctx.n).contiguous(), None, None


class _SliceHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group: Group, dim: int):
        ctx.group, ctx.dim = group, dim
        n = y.shape[dim] // group.size
        return y.narrow(dim, group.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return ctx.group.all_gather(dy, dim=ctx.dim), None, None


def gather_heads(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """All-gather a head-sharded tensor along ``dim`` (exact). Backward: this rank's slice of the
    (replicated) full gradient. Use with :func:`slice_heads` around an op with replicated
    parameters (QK-norm): every rank then runs the op on all heads, so the parameter gradient is
    the single-process one."""
    return _GatherHeads.apply(x, group, dim)


def slice_heads(y: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """This rank's equal slice of ``y`` along ``dim``. Backward: all-gather of every rank's
    slice gradient, so the op before it sees the full, replicated upstream gradient."""
    return _SliceHeads.apply(y, group, dim)


# ------------------------------------------------------------------------------------------------
# vocabulary-parallel log-probs


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, return_entropy: bool, group: Group,
                start: int, vocab_size: int, blocks: tuple[int, ...], token_chunk: int, kept_threshold, kept_boundary):
        N = hidden.shape[0]
        V_r = weight.shape[0]
        dev = hidden.device
        lp = torch.empty(N, dtype=torch.float32, device=dev)
        lse = torch.empty(N, dtype=torch.float32, device=dev)
        ent = torch.empty(N if return_entropy else 0, dtype=torch.float32, device=dev)
        t64 = targets.long()
        for r0 in range(0, N, token_chunk):
            h = hidden[r0:r0 + token_chunk]
            tgt = t64[r0:r0 + token_chunk]
            z = scale_logits(_linear(h, weight), temperature)
            if kept_threshold is not None:  # the kept set, with absolute column ids (the target stays)
                z, _ = mask_kept(z, start, kept_threshold[r0:r0 + token_chunk], kept_boundary[r0:r0 + token_chunk], tgt)
            res = merge_shard_stats(shard_block_stats(z, entropy=return_entropy), group, list(blocks), vocab_size,
                                    entropy=return_entropy)
            local = tgt - start
            hit = (local >= 0) & (local < V_r)
            rows = torch.nonzero(hit).squeeze(1)
            z_t = torch.zeros(h.shape[0], dtype=torch.float32, device=dev)
            z_t[rows] = z[rows, local[rows]]
            z_t = group.all_reduce_one_owner(z_t)  # the owner's bits of the target logit
            lp[r0:r0 + h.shape[0]] = z_t - res.lse
            lse[r0:r0 + h.shape[0]] = res.lse
            if return_entropy:
                ent[r0:r0 + h.shape[0]] = res.entropy
        if N and not bool(torch.isfinite(lse).all()):
            raise ValueError("hidden: some rows of the logits hidden @ weight.T / temperature are not finite (+inf or overflow)")
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, t64, lse, ent, kept_threshold, kept_boundary)
        ctx.args = (temperature, group, start, vocab_size, token_chunk)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        hidden, weight, targets, lse, ent, kept_threshold, kept_boundary = ctx.saved_tensors
        temperature, group, start, vocab_size, token_chunk = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and ent.numel() == 0:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 12
        N, H = hidden.shape
        V_r = weight.shape[0]
        g_lp = g_lp.contiguous() if g_lp is not None else None
        g_ent = g_ent.contiguous() if g_ent is not None else None

        def rows(r0, r1):
            return (targets[r0:r1], lse[r0:r1], ent[r0:r1] if g_ent is not None else None,
                    g_lp[r0:r1] if g_lp is not None else None, g_ent[r0:r1] if g_ent is not None else None)

        def kept(r0, r1):  # this chunk's rows of the kept-set records (None, None without them)
            return (None, None) if kept_threshold is None else (kept_threshold[r0:r1], kept_boundary[r0:r1])

        dh = dw = None
        if need_h:
            # dh = dlogits @ W over the sharded vocabulary: the sharded exact GEMM per token chunk
            dh = hidden.new_empty((N, H))
            for r0 in range(0, N, token_chunk):
                h = hidden[r0:r0 + token_chunk]
                tgt, l_, e_, gl, ge = rows(r0, r0 + h.shape[0])
                dl = fused_dlogits(_linear(h, weight), start, tgt, l_, e_, gl, ge, temperature, *kept(r0, r0 + h.shape[0]))
                dh[r0:r0 + h.shape[0]] = sharded_k_matmul(dl, weight.t(), group, k_total=vocab_size)
        if need_w:
            # dW_r[cols] = dlogits[:, cols]ᵀ @ h over all tokens, per vocabulary chunk (row-local)
            dw = weight.new_empty((V_r, H))
            chunk = 4 * VOCAB_BLOCK
            for c0 in range(0, V_r, chunk):
                w = weight[c0:c0 + chunk]
                dl = hidden.new_empty((N, w.shape[0]))
                for r0 in range(0, N, token_chunk):
                    h = hidden[r0:r0 + token_chunk]
                    tgt, l_, e_, gl, ge = rows(r0, r0 + h.shape[0])
                    dl[r0:r0 + h.shape[0]] = fused_dlogits(_linear(h, w), start + c0, tgt, l_, e_, gl, ge, temperature,
                                                           *kept(r0, r0 + h.shape[0]))
                dw[c0:c0 + w.shape[0]] = _weight_grad(dl, hidden)
        return (dh if need_h else None), (dw if need_w else None), None, None, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: Group, *,
                            start: int, vocab_size: int, blocks: Sequence[int], temperature: float = 1.0,
                            return_entropy: bool = False, token_chunk: int | None = None,
                            kept_threshold: torch.Tensor | None = None, kept_boundary: torch.Tensor | None = None):
    r"""Selected-token log-probs (and entropy) of a vocabulary-sharded LM head.

    .. math:: \mathrm{lp}_i = z_{i, t_i} - \mathrm{lse}_i, \qquad
              z = \mathrm{fl}_{32}(h W^\top) / \mathrm{fl}_{32}(\tau)

    with ``lse`` the canonical blocked log-sum-exp, merged across the shards in block order.

    Shapes:
        hidden: ``[..., H]`` replicated; weight: ``[V_r, H]``, this rank's rows
        ``[start, start + V_r)`` — whole blocks of :data:`VOCAB_BLOCK` (see
        :func:`~rl_engine.distributed.algorithms.vocab.vocab_partition`); targets: ``[...]``
        global ids in ``[0, vocab_size)``; returns ``[...]`` float32 (and the entropy).

    Args:
        blocks: every rank's number of vocabulary blocks, in rank order.
        token_chunk: rows per chunk (default: sized so one logits chunk is at most 256 MiB). No
            value changes a bit.
        kept_threshold, kept_boundary: the kept-set record of every token (``[...]`` like
            ``targets``; float32 and int32/int64, :mod:`rl_engine.utils.kept`), or ``None``: the
            log-prob (and entropy) is renormalised over each row's kept set, the target counted
            as kept — top-k / top-p replay. Each shard masks its own columns by absolute id, so
            the merged statistics are the single-process op's.

    Contract: raw-bit equal, at every TP size, to ``rl_engine.ops.logprob.linear_token_logprobs``
    of the full weight on the CPU (forward, and the gradients to ``hidden`` and ``weight``).

    Raises:
        ValueError: targets out of range, a weight shard that does not start on a block boundary,
            non-finite logits.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.0 < float(temperature) < float("inf"):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature!r}")
    t = float(temperature)
    if start % VOCAB_BLOCK:
        raise ValueError(f"start: a vocabulary shard must start on a multiple of {VOCAB_BLOCK}, got {start}")
    blocks = tuple(int(b) for b in blocks)
    V_r = weight.shape[0]
    if blocks[group.rank] != -(-V_r // VOCAB_BLOCK):
        raise ValueError(f"blocks: rank {group.rank} holds {V_r} rows ({-(-V_r // VOCAB_BLOCK)} blocks), got {blocks}")
    H = hidden.shape[-1]
    if weight.shape[1] != H:
        raise ValueError(f"weight: expected [V_r, {H}] to match hidden's last dim, got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"targets: expected token ids in [0, {vocab_size})")
    if (kept_threshold is None) != (kept_boundary is None):
        raise ValueError("kept_threshold, kept_boundary: give both records or neither")
    if kept_threshold is not None:
        if kept_threshold.shape != targets.shape or kept_boundary.shape != targets.shape:
            raise ValueError(f"kept_threshold, kept_boundary: expected shape {tuple(targets.shape)} (one record per "
                             f"target), got {tuple(kept_threshold.shape)} and {tuple(kept_boundary.shape)}")
        if kept_threshold.dtype != torch.float32 or kept_boundary.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kept_threshold, kept_boundary: expected float32 and int32/int64, got "
                             f"{kept_threshold.dtype} and {kept_boundary.dtype}")
        kept_threshold = kept_threshold.reshape(-1).to(hidden.device)
        kept_boundary = kept_boundary.reshape(-1).to(hidden.device)
    if token_chunk is None:
        token_chunk = max(1, _TOKEN_BUDGET_BYTES // max(1, 4 * V_r))
    lp, ent, _ = _VocabParallelLogprobs.apply(hidden.reshape(-1, H).contiguous(), weight, targets.reshape(-1), t,
                                              bool(return_entropy), group, int(start), int(vocab_size), blocks,
                                              int(token_chunk), kept_threshold, kept_boundary)
    lp = lp.reshape(targets.shape)
    return (lp, ent.reshape(targets.shape)) if return_entropy else lp
