"""Implementation backends, one package per platform (``cpu``; ``shared/triton`` for GPUs).

Backends register themselves with :mod:`rl_engine.runtime.registry` when imported; the runtime
imports them lazily, the first time an operator family is dispatched.
"""
