"""One rank of the DeepSpeed parity run (launched by test_deepspeed.py with RANK/WORLD_SIZE set).

For every (ZeRO stage, dtype) in argv: build the tiny Qwen3, ``initialize`` (rl_engine installed,
gloo, CPU accelerator), then 3 steps of: rollout with ``generate`` on the full weights →
training forward through the engine → raw-bit comparison → loss → backward → step.
A spec ``<stage>:<dtype>:native`` skips the install (negative control).
Writes ``{config: {"losses": [...], "mismatched": [...], "compared": [...]}}`` to $OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.environ["RLK_REPO"])

from rl_engine.integrations.hf.rollout import generate_with_logprobs  # noqa: E402
from rl_engine.integrations.deepspeed import full_parameters, initialize  # noqa: E402
from rl_engine.integrations.hf.train import train_token_logprobs  # noqa: E402
from rl_engine.utils.bits import same_bits  # noqa: E402
from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model  # noqa: E402


def prompts(rank: int, step: int, vocab: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    lengths = [5, 2, 8, 3]
    P = max(lengths)
    ids = torch.zeros(len(lengths), P, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


def run(stage: int, dtype: str, rank: int, native: bool) -> dict:
    model = build_hf_model(TINY_CONFIGS["h16-gqa2-tied-2l"])
    model.generation_config.pad_token_id = 0
    bf16 = dtype == "bfloat16"
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "steps_per_print": 10**9}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if native:  # the negative control: plain transformers under DeepSpeed
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        inst = None
    else:
        engine, _, inst = initialize(model, config=config, optimizer=opt)
    out = {"losses": [], "mismatched": [], "compared": []}
    for step in range(3):
        ids, mask = prompts(rank, step, model.config.vocab_size)
        engine.eval()
        with full_parameters(engine) as m:
            r = generate_with_logprobs(m, ids, mask, max_new_tokens=5, do_sample=True, temperature=0.9, seed=step)
        engine.train()
        lp = train_token_logprobs(engine, r.sequences, r.attention_mask, r.prompt_len, temperature=0.9)
        d = same_bits(r.logprobs, lp.detach())
        out["mismatched"].append(d.mismatched)
        out["compared"].append(lp.numel())
        loss = -lp.mean()
        engine.backward(loss)
        engine.step()
        out["losses"].append(float(loss.detach()).hex())
    if inst is not None:
        inst.unapply()
    return out


def main() -> None:
    import deepspeed
    import deepspeed.comm.torch as ds_torch_comm

    # DeepSpeed JIT-compiles a C++ shared-memory all-reduce when its torch backend starts (minutes
    # on a small CPU machine). Its one user is AutoTP inference (``inference_all_reduce``), which
    # this run never calls: ZeRO's collectives go through the gloo process group. So it is not built.
    ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    res = {}
    for spec in sys.argv[1:]:
        stage, dtype, *flags = spec.split(":")  # "<stage>:<dtype>[:native][:<tag>]"
        res[spec] = run(int(stage), dtype, rank, "native" in flags)
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    # Tear the group down in step, then leave without running static destructors: native
    # extensions DeepSpeed loads may hold joinable threads in static objects, and a destructor that
    # terminates the process after the results are written would fail a finished run.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
