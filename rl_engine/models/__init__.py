"""Model specs and assemblies built only from ``rl_engine.ops`` entry points."""
