"""Helpers of the fault suite: paths and run specs with small budgets."""

from __future__ import annotations

from pathlib import Path

from molt.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]
FAULTY = str(REPO / "examples" / "agents" / "faulty.py")


def small_spec(agent: dict | None = None, **sections) -> RunSpec:
    """The default tiny run with 8-token turns, a 512-token context and `agent` / other sections."""
    data = {"model": {"max_model_len": 512}, "rollout": {"max_tokens": 8, "samples_per_prompt": 4},
            "train": {"micro_batch_size": 8}, "agent": agent or {}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return RunSpec.model_validate(data)
