"""Reusable compositions shared by model assemblies (see :mod:`rl_engine.layers.native`)."""
