"""Megatron-core GPTModel of Qwen3 on rl_engine's layers; the log-probs do not depend on the TP size.

Run it at TP 1, 2 and 4 (gloo, CPU; one process per TP rank) and compare the digests it prints —
they are equal, and equal to rl_engine's single-process Qwen3 (printed by the TP = 1 run as well)::

    torchrun --nproc_per_node 1 examples/distributed/megatron_qwen3.py
    torchrun --nproc_per_node 2 examples/distributed/megatron_qwen3.py
    torchrun --nproc_per_node 4 examples/distributed/megatron_qwen3.py

``--model DIR`` loads a HF Qwen3 checkpoint (tied embeddings) instead of the random ``tiny-tp``
preset; ``--row-scheme exact_k`` uses Megatron's K-sharded row-parallel weights.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF Qwen3 checkpoint directory (default: random tiny-tp Qwen3)")
    ap.add_argument("--row-scheme", default="full_k", choices=["full_k", "exact_k"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    from rl_engine.integrations.megatron.model import MegatronQwen3
    from rl_engine.models.qwen3 import PRESETS, Qwen3ForCausalLM

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    if args.model:
        model = MegatronQwen3.from_pretrained(args.model, row_scheme=args.row_scheme)
    else:
        ref = Qwen3ForCausalLM.random(PRESETS["tiny-tp"], seed=0)
        model = MegatronQwen3.from_hf_state_dict(ref.spec, ref.to_hf_state_dict(), row_scheme=args.row_scheme)
    g = torch.Generator().manual_seed(0)
    lengths = [17, 9, 30]
    ids = torch.randint(0, model.spec.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tgt = torch.roll(ids, -1)
    lp = model.token_logprobs(ids, pos, cu, tgt)
    if dist.get_rank() == 0:
        msg = f"TP {dist.get_world_size()}: log-probs sha256 {hashlib.sha256(lp.detach().numpy().tobytes()).hexdigest()[:16]}"
        if dist.get_world_size() == 1 and not args.model:
            from rl_engine.engine import ops_for
            from rl_engine.runtime.plan import Plan

            ops = ops_for(Plan.parse("R/R"), "train")
            ref_lp, _ = ops.lm_head_logprobs(ref.hidden_train(ids, pos, cu, ops), ref.lm_head_weight, tgt)
            msg += f" (rl_engine single process: {hashlib.sha256(ref_lp.numpy().tobytes()).hexdigest()[:16]})"
        print(msg)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
