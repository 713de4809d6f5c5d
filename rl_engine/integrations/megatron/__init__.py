"""Megatron-core (0.16.1) as the training engine: a Qwen3 ``GPTModel`` on rl_engine's layers.

:mod:`.layers` holds the Megatron module slots built on :mod:`rl_engine.distributed` and the
layer spec; :mod:`.model` the ``GPTModel`` adapter :class:`~.model.MegatronQwen3` and the HF
checkpoint conversion. Importing this package does not import megatron-core; its modules do.
See docs/distributed.md.
"""
