"""The base of every section of the run spec: unknown keys are refused, so a typo fails instead of being
silently ignored."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def did_you_mean(name: str, names: Iterable[str], prefix: str = "") -> str:
    """The hint ` (did you mean 'PREFIXnearest'?)` for the valid name nearest to a wrong one, or "" when
    none is near: one wording for unknown keys and unknown registered names."""
    near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean '{prefix}{near[0]}'?)" if near else ""
