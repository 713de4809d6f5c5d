"""Rank functions the distributed tests start with :func:`rl_engine.distributed.launch.spawn`.

Every rank builds the same full inputs from fixed seeds, keeps its shard, runs the block forward
and backward, and returns its outputs; the tests compare them with the single-process operators
computed in the test process. One world per size runs every check (:func:`all_checks`), so a
test session starts each world once.
"""

from __future__ import annotations

import torch

from rl_engine.distributed.transports import Group

DTYPES = (torch.float32, torch.bfloat16)
# linear shapes: M rows, K in, N out (divisible by 8 = k_tree's K blocks, and by 4 ranks)
M, K, N = 11, 64, 48
# vocabulary: 3 blocks of 1024 plus a short block (4 ranks: one block each; 2 ranks: two each)
V, H, T = 3 * 1024 + 333, 32, 13
TEMPERATURE = 0.7
MICROBATCHES = 4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def linear_inputs(dtype: torch.dtype):
    g = gen(1)
    x, w, b, dy = (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / 8, torch.randn(N, generator=g),
                   torch.randn(M, N, generator=g))
    return x.to(dtype), w.to(dtype), b.to(dtype), dy.to(dtype)


def vocab_inputs(dtype: torch.dtype):
    g = gen(2)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[3] = ids[7] = ids[0]  # repeated ids: one table row gets several tokens' gradients
    ids[5] = V - 1  # the short last block
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    dy_emb = torch.randn(T, H, generator=g).to(dtype)
    w[ids[9], 4] = -0.0  # a -0.0 table entry: the combination must keep its sign
    return h, w, ids, g_lp, g_ent, dy_emb


def vocab_kept(h: torch.Tensor, w: torch.Tensor):
    """Top-k / top-p kept sets of the vocabulary inputs' rows (every shard holds kept and dropped
    columns; row 2 keeps everything)."""
    from rl_engine.ops.gemm import linear
    from rl_engine.ops.logprob import KeptSet, kept_set

    kept = kept_set(linear(h, w, out_dtype=torch.float32), TEMPERATURE, top_k=1500, top_p=0.9)
    return KeptSet(kept.threshold.clone().index_fill_(0, torch.tensor([2]), float("-inf")),
                   kept.boundary.clone().index_fill_(0, torch.tensor([2]), 2**31 - 1))


def mlp_params():
    g = gen(3)
    return [torch.randn(24, 16, generator=g) / 4, torch.randn(24, generator=g), torch.randn(8, 24, generator=g) / 5]


def microbatch(j: int):
    g = gen(100 + j)
    return torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)


def mlp_loss(params, j: int) -> torch.Tensor:
    from rl_engine.ops.gemm import linear

    w1, b1, w2 = params
    x, target = microbatch(j)
    y = linear(torch.relu(linear(x, w1, b1)), w2)
    return ((y - target) ** 2).sum() / 64.0  # one constant of the global batch


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _grads(*ts):
    return tuple(None if t.grad is None else t.grad.clone() for t in ts)


def linear_checks(group: Group) -> dict:
    from rl_engine.distributed import tensor_parallel as tp

    p, r = group.size, group.rank
    n, k = N // p, K // p
    out = {}
    for dtype in DTYPES:
        x, w, b, dy = linear_inputs(dtype)
        xc, wc, bc = _leaf(x), _leaf(w[r * n:(r + 1) * n]), _leaf(b[r * n:(r + 1) * n])
        y = tp.column_parallel_linear(xc, wc, bc, group)
        y.backward(dy[:, r * n:(r + 1) * n])
        out[("column", dtype)] = (y.detach(), *_grads(xc, wc, bc))
        for scheme in tp.ROW_SCHEMES:
            xs = _leaf(x[:, r * k:(r + 1) * k])
            if scheme == "full_k":
                ws, bs = _leaf(w[r * n:(r + 1) * n]), _leaf(b[r * n:(r + 1) * n])
            else:
                ws, bs = _leaf(w[:, r * k:(r + 1) * k]), _leaf(b)
            y = tp.row_parallel_linear(xs, ws, bs, group, scheme=scheme)
            y.backward(dy)
            out[(scheme, dtype)] = (y.detach(), *_grads(xs, ws, bs))
    return out


def vocab_checks(group: Group) -> dict:
    from rl_engine.distributed import tensor_parallel as tp
    from rl_engine.distributed.algorithms.vocab import vocab_partition

    parts = vocab_partition(V, group.size)
    lo, hi = parts[group.rank]
    blocks = [-(-(e - s) // 1024) for s, e in parts]
    out = {}
    for dtype in DTYPES:
        h, w, ids, g_lp, g_ent, dy_emb = vocab_inputs(dtype)
        hl, wl = _leaf(h), _leaf(w[lo:hi])
        lp, ent = tp.vocab_parallel_logprobs(hl, wl, ids, group, start=lo, vocab_size=V, blocks=blocks,
                                             temperature=TEMPERATURE, return_entropy=True, token_chunk=5)
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        out[("logprobs", dtype)] = (lp.detach(), ent.detach(), *_grads(hl, wl))
        kept = vocab_kept(h, w)
        hl, wl = _leaf(h), _leaf(w[lo:hi])
        lp, ent = tp.vocab_parallel_logprobs(hl, wl, ids, group, start=lo, vocab_size=V, blocks=blocks,
                                             temperature=TEMPERATURE, return_entropy=True, token_chunk=5,
                                             kept_threshold=kept.threshold, kept_boundary=kept.boundary)
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        out[("logprobs_kept", dtype)] = (lp.detach(), ent.detach(), *_grads(hl, wl))
        we = _leaf(w[lo:hi])
        e = tp.vocab_parallel_embedding(ids, we, lo, group)
        e.backward(dy_emb)
        out[("embedding", dtype)] = (e.detach(), *_grads(we))
        # negative control: the zero-masked shards combined by the float all-reduce
        flat = ids.reshape(-1)
        mask = (flat >= lo) & (flat < hi)
        masked = torch.zeros(T, H, dtype=dtype)
        masked[mask] = w[flat[mask]]
        out[("embedding_native", dtype)] = group.all_reduce_native(masked)
    return out


def dp_checks(group: Group) -> dict:
    from rl_engine.distributed.data_parallel import TreeGradReducer

    params = [_leaf(t) for t in mlp_params()]
    red = TreeGradReducer(params, num_microbatches=MICROBATCHES, group=group)
    for j in red.microbatches():
        mlp_loss(params, j).backward()
        red.accumulate()
    red.finish()
    tree = [q.grad.clone() for q in params]
    # negative control: autograd's sequential accumulation over the local micro-batches, then
    # the backend's all-reduce
    for q in params:
        q.grad = None
    for j in red.microbatches():
        mlp_loss(params, j).backward()
    native = [group.all_reduce_native(q.grad) for q in params]
    return {"tree": tree, "native": native}


def transport_checks(group: Group) -> dict:
    from rl_engine.distributed.algorithms.exact_k import tree_all_reduce

    r = group.rank
    t = torch.randn(7, 5, generator=gen(50 + r))
    owner = torch.zeros(6, dtype=torch.bfloat16)
    if r == group.size - 1:
        owner[:] = torch.tensor([-0.0, 1.5, -2.0, 0.0, 3.0, -0.0])
    return {"tree_all_reduce": tree_all_reduce(t, group), "inputs": t,
            "one_owner": group.all_reduce_one_owner(owner),
            "sizes": group.all_gather_sizes(torch.full((2, r + 1), float(r)), [q + 1 for q in range(group.size)], dim=1)}


def checks(group: Group) -> dict:
    return {"linear": linear_checks(group), "vocab": vocab_checks(group), "dp": dp_checks(group),
            "transport": transport_checks(group)}


def all_checks(world: Group) -> dict:
    """Every check on the world (4 ranks) and on its two halves (2 ranks each): ``{size: result}``."""
    half = world.subgroups([list(range(0, world.size // 2)), list(range(world.size // 2, world.size))])
    return {world.size: checks(world), half.size: checks(half), "fsdp": fsdp_checks(world),
            "megatron": megatron_checks(world)}


# ------------------------------------------------------------------------------------------------
# FSDP2 on an HF Qwen3 with rl_engine installed

FSDP_CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
FSDP_MICROBATCHES, FSDP_B, FSDP_P, FSDP_N = 4, 2, 5, 4


def fsdp_batch(j: int):
    """Micro-batch ``j``: ``[B, P + N]`` tokens (row 1 left-padded by 2), its mask, per-token loss weights."""
    g = gen(200 + j)
    seq = torch.randint(1, FSDP_CFG["vocab_size"], (FSDP_B, FSDP_P + FSDP_N), generator=g)
    mask = torch.ones_like(seq)
    mask[1, :2] = 0
    seq[1, :2] = 0
    u = torch.randn(FSDP_B, FSDP_N, generator=g)
    return seq, mask, u


def fsdp_model():
    from rl_engine.integrations.hf import install
    from tests.helpers.qwen3 import build_hf_model

    model = build_hf_model(FSDP_CFG, seed=0).train()
    install(model)
    return model


def fsdp_step(model, j: int) -> torch.Tensor:
    from rl_engine.integrations.hf import train_token_logprobs

    seq, mask, u = fsdp_batch(j)
    lp = train_token_logprobs(model, seq, mask, FSDP_P)
    (lp * u).sum().backward()
    return lp.detach()


def _fsdp_run(group: Group, native: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from rl_engine.integrations.fsdp import ShardedGradTree, shard_model

    model = fsdp_model()
    mesh = DeviceMesh.from_group(group.pg if group.pg is not None else dist.group.WORLD, "cpu")
    lps = {}
    if native:  # FSDP2's own reduce-scatter (gloo) and gradient accumulation, summed (no averaging)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
        for j in range(group.rank, FSDP_MICROBATCHES, group.size):
            lps[j] = fsdp_step(model, j)
    else:
        shard_model(model, mesh=mesh)
        tree = ShardedGradTree(model, num_microbatches=FSDP_MICROBATCHES, group=group)
        for j in tree.microbatches():
            lps[j] = fsdp_step(model, j)
            tree.accumulate()
        tree.finish()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"logprobs": lps, "grads": grads}


def fsdp_checks(world: Group) -> dict:
    """FSDP2 at 1, 2 and 4 ranks (groups of the world), tree reduction; the native control at 1 and 2."""
    out = {}
    for W in (1, 2, 4):
        g = world if W == world.size else world.subgroups([list(range(i, i + W)) for i in range(0, world.size, W)])
        out[("tree", W)] = _fsdp_run(g, native=False)
        if W < 4:
            out[("native", W)] = _fsdp_run(g, native=True)
    return out


# ------------------------------------------------------------------------------------------------
# Megatron-core GPTModel on rl_engine's layers

MEGATRON_RUNS = ((1, "full_k"), (2, "full_k"), (4, "full_k"), (4, "exact_k"), (2, "native"))


def megatron_batch():
    """The workload ws2-tiny's rollout (rl_engine reference executor, R/R), packed: ids, positions,
    bounds, targets, and the rollout's log-prob of every response token by packed index."""
    from rl_engine.validation.ws2 import _rollout
    from rl_engine.workloads import load_workload

    seqs = _rollout(load_workload("ws2-tiny").workload)
    ids, pos, cu, tgt, rollout = [], [], [0], [], {}
    for s in seqs:
        toks, L = s["tokens"], len(s["tokens"])
        o = len(ids)
        ids += toks
        pos += list(range(L))
        tgt += toks[1:] + [0]
        cu.append(cu[-1] + L)
        for (_, p), lp in s["rollout_logprobs"].items():
            rollout[o + p - 1] = lp
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return t(ids), t(pos), torch.tensor(cu, dtype=torch.int32), t(tgt), rollout


def megatron_checks(world: Group) -> dict:
    """Megatron TP 1, 2, 4 (full_k; exact_k at 4; the native row-parallel control at 2) on the
    world; HF checkpoint loaded from a directory; log-probs, gradients (HF names), round trip."""
    import json
    import tempfile
    from pathlib import Path

    from megatron.core import parallel_state
    from safetensors.torch import save_file

    from rl_engine.integrations.megatron.model import MegatronQwen3, megatron_to_hf
    from rl_engine.models.qwen3 import PRESETS, Qwen3ForCausalLM

    spec = PRESETS["tiny-tp"]
    d = world.broadcast_object(tempfile.mkdtemp(prefix="rlk-megatron-") if world.rank == 0 else None)
    if world.rank == 0:
        save_file(Qwen3ForCausalLM.random(spec, seed=0).to_hf_state_dict(), str(Path(d) / "model.safetensors"))
        (Path(d) / "config.json").write_text(json.dumps(spec.to_hf_config()))
    world.broadcast_object(None)  # barrier: the checkpoint is written
    ids, pos, cu, tgt, _ = megatron_batch()
    out = {}
    for tp, scheme in MEGATRON_RUNS:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            m = MegatronQwen3.from_pretrained(d, row_scheme=scheme)
            lp = m.token_logprobs(ids, pos, cu, tgt)
            w = torch.linspace(-1.0, 1.0, lp.shape[0])
            (lp * w).sum().backward()
            grads = megatron_to_hf({k: v.grad for k, v in m.megatron_state_dict().items()}, spec, m.group,
                                   row_scheme=scheme)
            back = m.to_hf_state_dict()  # a collective: every rank calls it
            out[(tp, scheme)] = {"logprobs": lp.detach(), "grads": grads if world.rank == 0 else None,
                                 "roundtrip": back if world.rank == 0 else None}
        finally:
            parallel_state.destroy_model_parallel()
    return out


# ------------------------------------------------------------------------------------------------
# NCCL at world size 1 on a CUDA device


def nccl_checks(group: Group) -> dict:
    """Every block on ``cuda`` through NCCL at world size 1 (the code path of a multi-GPU run)."""
    from rl_engine.distributed import tensor_parallel as tp
    from rl_engine.distributed.algorithms.exact_k import tree_all_reduce
    from rl_engine.distributed.data_parallel import TreeGradReducer
    from rl_engine.ops.gemm import linear

    dev = torch.device("cuda", torch.cuda.current_device())
    out = {"backend": group.backend}
    for dtype in DTYPES:
        x, w, b, dy = (t.to(dev) for t in linear_inputs(dtype))
        xc, wc = _leaf(x), _leaf(w)
        y = tp.column_parallel_linear(xc, wc, None, group)
        y.backward(dy)
        out[("column", dtype)] = (y.detach().cpu(), xc.grad.cpu(), linear(x, w).cpu())
        for scheme in ("full_k", "exact_k"):
            xs, ws = _leaf(x), _leaf(w)
            ys = tp.row_parallel_linear(xs, ws, None, group, scheme=scheme)
            ys.backward(dy)
            out[(scheme, dtype)] = (ys.detach().cpu(), xs.grad.cpu())
        h, wv, ids, g_lp, g_ent, _ = vocab_inputs(dtype)
        hl, wl = _leaf(h.to(dev)), _leaf(wv.to(dev))
        lp, ent = tp.vocab_parallel_logprobs(hl, wl, ids.to(dev), group, start=0, vocab_size=V,
                                             blocks=[-(-V // 1024)], temperature=TEMPERATURE, return_entropy=True)
        torch.autograd.backward([lp, ent], [g_lp.to(dev), g_ent.to(dev)])
        logits = linear(h.to(dev), wv.to(dev))
        from rl_engine.backends.cpu.logprob.lse import LseAccumulator, scale_logits
        from rl_engine.ops.logprob import token_logprobs

        z = scale_logits(logits, TEMPERATURE)
        acc = LseAccumulator(z.shape[0], entropy=False, vocab_size=V)
        acc.m, acc.s = acc.m.to(dev), acc.s.to(dev)
        acc.update(z, 0)  # the canonical log-sum-exp in one piece, on the GPU
        one_piece = (z.gather(1, ids.to(dev)[:, None])[:, 0] - acc.finish().lse).cpu()
        out[("logprobs", dtype)] = (lp.detach().cpu(), ent.detach().cpu(), hl.grad.cpu(), logits.cpu(), one_piece,
                                    token_logprobs(logits, ids.to(dev), TEMPERATURE).cpu())
        e = tp.vocab_parallel_embedding(ids.to(dev), wv.to(dev), 0, group)
        out[("embedding", dtype)] = e.cpu()
    t = torch.randn(7, 5, generator=gen(9)).to(dev)
    out["tree_all_reduce"] = (tree_all_reduce(t, group).cpu(), t.cpu())
    params = [_leaf(q.to(dev)) for q in mlp_params()]
    red = TreeGradReducer(params, num_microbatches=2, group=group)
    for j in red.microbatches():
        w1, b1, w2 = params
        xb, target = (q.to(dev) for q in microbatch(j))
        (((linear(torch.relu(linear(xb, w1, b1)), w2) - target) ** 2).sum() / 64.0).backward()
        red.accumulate()
    red.finish()
    out["dp"] = [q.grad.cpu() for q in params]
    return out
