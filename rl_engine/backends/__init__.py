"""Implementation backends: ``cpu`` (the exact-sum CPU kernels) and ``triton`` (the GPU kernels, shared across devices).

Backends register themselves with :mod:`rl_engine.runtime.registry` when imported; the runtime
imports them lazily, the first time an operator family is dispatched.
"""
