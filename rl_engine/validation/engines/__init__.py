"""``rlk check`` against a real engine: the rollout and the training scores of one engine pair.

:mod:`~rl_engine.validation.engines.hf` drives HF ``generate`` against the HF training forward;
:mod:`~rl_engine.validation.engines.vllm` drives vLLM (with the rl_engine plugin) against it.
Both produce the same report as the reference executor's check.
"""
