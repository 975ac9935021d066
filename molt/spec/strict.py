"""The base of every section of the run spec: unknown keys are refused, so a typo fails instead of being
silently ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
