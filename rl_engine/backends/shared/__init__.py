"""Implementations whose one source serves several platform families (see ``triton/``)."""
