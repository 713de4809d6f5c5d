"""FSDP2 training step of an HF Qwen3 with rl_engine installed; the bits do not depend on the world size.

Run it at 1, 2 and 4 ranks (gloo, CPU) and compare the two digests it prints — they are equal::

    torchrun --nproc_per_node 1 examples/distributed/fsdp2_qwen3.py
    torchrun --nproc_per_node 2 examples/distributed/fsdp2_qwen3.py
    torchrun --nproc_per_node 4 examples/distributed/fsdp2_qwen3.py

``--model DIR`` loads a HF Qwen3 checkpoint instead of the tiny random one. Each of the 8
micro-batches holds 2 sequences; rank ``r`` runs micro-batches ``r, r + W, ...`` and
:class:`~rl_engine.integrations.fsdp.ShardedGradTree` sums them in the canonical tree.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist

MICROBATCHES, B, P, N = 8, 2, 6, 6


def build(model_dir: str | None):
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    from rl_engine.models.qwen3 import PRESETS, Qwen3ForCausalLM

    if model_dir:
        return HFQwen3.from_pretrained(model_dir, dtype=torch.float32)
    spec = PRESETS["tiny"]
    cfg = Qwen3Config(**{k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "rope_theta")})
    model = HFQwen3(cfg)
    model.load_state_dict(Qwen3ForCausalLM.random(spec, seed=0).to_hf_state_dict(), strict=False)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF Qwen3 checkpoint directory (default: tiny random Qwen3)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from rl_engine.integrations.fsdp import ShardedGradTree, shard_model
    from rl_engine.integrations.hf import install, train_token_logprobs

    model = build(args.model).train()
    install(model)
    shard_model(model)
    tree = ShardedGradTree(model, num_microbatches=MICROBATCHES)
    vocab = model.config.vocab_size
    lps = {}
    for j in tree.microbatches():
        g = torch.Generator().manual_seed(1000 + j)
        seq = torch.randint(1, vocab, (B, P + N), generator=g)
        lp = train_token_logprobs(model, seq, torch.ones_like(seq), P)
        (lp * torch.randn(B, N, generator=g)).sum().backward()
        tree.accumulate()
        lps[j] = lp.detach()
    tree.finish()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, lps)
    h_lp = hashlib.sha256()
    for j in range(MICROBATCHES):
        h_lp.update(next(d[j] for d in every if j in d).numpy().tobytes())
    h_g = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h_g.update(p.grad.full_tensor().detach().numpy().tobytes())
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}: log-probs sha256 {h_lp.hexdigest()[:16]}, gradients sha256 {h_g.hexdigest()[:16]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
