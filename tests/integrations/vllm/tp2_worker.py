"""TP=2 vLLM runs for test_vllm_tp2.py, in a fresh process (vLLM spawns one worker per rank).

Usage: tp2_worker.py CHECKPOINT_DIR OUT_JSON PLAN:DTYPE [PLAN:DTYPE ...]  (PLAN: rlk | native)
For each spec, builds ``LLM(tensor_parallel_size=2)`` (plugin installed in strict mode for
``rlk``), generates greedy and sampled completions of mixed-length prompts, scores them on the
training side (rl_engine Qwen3, TP=1) and writes the comparison and every rank's provenance.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
os.environ["HF_HUB_OFFLINE"] = "1"


def main() -> None:
    import torch

    from rl_engine.integrations.vllm import install, parity, uninstall, vllm_provenance

    ckpt, out_path, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    from vllm import LLM

    prompts = parity.mixed_prompts(6, 2048, seed=1, max_len=60)
    results = []
    for spec in specs:
        plan, dtype = spec.split(":")
        t0 = time.perf_counter()
        if plan == "rlk":
            install(strict=True)
        llm = LLM(model=ckpt, dtype=dtype, enforce_eager=True, max_model_len=128, seed=0, tensor_parallel_size=2,
                  block_size=32, max_num_batched_tokens=32, max_num_seqs=4)
        res = {"plan": plan, "dtype": dtype, "runs": {}}
        for name, temp in (("greedy", 0.0), ("sampled", 0.8)):
            rep, _ = parity.run_parity(llm, ckpt, getattr(torch, dtype), prompts, max_tokens=8, temperature=temp,
                                       seed=None)
            res["runs"][name] = rep.as_dict()
        res["provenance"] = vllm_provenance(llm) if plan == "rlk" else None
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if plan == "rlk":
            uninstall()
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        print(f"tp2_worker: {spec} done in {res['seconds']} s", flush=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
