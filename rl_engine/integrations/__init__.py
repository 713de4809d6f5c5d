"""Engine integrations, one package per engine.

``hf`` (transformers: training forward and ``generate``), ``vllm`` (the rollout plugin),
``deepspeed`` (ZeRO training around an HF model with rl_engine installed) and ``trl`` (GRPO
with rl_engine on both sides). Each imports its engine lazily.
"""
