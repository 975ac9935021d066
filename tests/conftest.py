"""Shared fixtures. Expensive things (Ray, the tiny model, vLLM engines) are built once per session."""

from __future__ import annotations

import os

# One thread per process: 2 cores are shared by Ray, vLLM and the trainer ranks (see README).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The default tiny dense model (built offline on first use, then cached)."""
    from molt.tiny import tiny_model_path as build

    return str(build())


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session; logical CPUs > cores so small actors never starve."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
                                           "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
