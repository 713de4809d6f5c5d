"""Where models run: the reference executors, the operators of one side of a plan, and the native
(production) control path.

:mod:`~rl_engine.engine.executor` scores sequences (train side) and generates with KV caches and
continuous batching (rollout side); :mod:`~rl_engine.engine.provider` gives a model the operators
of one side of a :class:`~rl_engine.runtime.plan.Plan`; :mod:`~rl_engine.engine.native` is the
native-torch ``P`` path that ``rlk check --plan P/P`` runs as the negative control.
"""

from rl_engine.engine.provider import OpsProvider, ops_for

__all__ = ["OpsProvider", "ops_for"]
