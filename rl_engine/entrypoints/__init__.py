"""The ``rlk`` command line (:mod:`rl_engine.entrypoints.cli`); one module per command."""
