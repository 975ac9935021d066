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
def tok(tiny_model_path):
    """The tiny model's tokenizer (byte-level BPE with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


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


@pytest.fixture(scope="session")
def engine_spec(tiny_model_path):
    """The RunSpec the shared `engine` runs with: eager, small KV cache, partial rollouts on."""
    from molt.spec import RunSpec

    return RunSpec.model_validate({
        "model": {"max_model_len": 512},  # room for a chat prompt with a tool schema (agents tests)
        "rollout": {"max_tokens": 8, "engine": {"kv_cache_gib": 0.25, "enforce_eager": True}},
    })


@pytest.fixture(scope="session")
def engine(ray_session, tiny_model_path, engine_spec):
    """One vLLM engine actor (molt.rollout.engine.EngineActor) on the tiny model, shared by all tests.

    Tests that refit it must restore the initial weights as version 0 before they return.
    """
    from molt.rollout.engine import start_engines

    [actor] = start_engines(engine_spec, tiny_model_path)
    # One request first: the engine's first forward is slow (kernel set-up), and tests with agent
    # timeouts should not pay for it.
    ray_session.get(actor.generate.remote([1, 2, 3], {"max_tokens": 2}))
    yield actor
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)
