"""The base of the package's validated data files (contracts, workloads, tile tables)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown fields (a misspelt key is an error, not a default)
    and is immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
