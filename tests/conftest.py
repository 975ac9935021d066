"""Shared fixtures. Expensive things (Ray, the tiny model, vLLM engines) are built once per session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# One thread per process: 2 cores are shared by Ray, vLLM and the trainer ranks (tests/README.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
from molt.plan.placement import LOCAL_RAY_ENV  # noqa: E402

for _key, _value in LOCAL_RAY_ENV.items():   # the local Ray a run starts: no auth, workers at nice 0
    os.environ.setdefault(_key, _value)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")   # hub datasets: a local copy or the cache, never fetched

import pytest  # noqa: E402


def host_kernels() -> str:
    """The host's kernels, in every report: float tolerances meet its dispatch (AVX2 or AVX-512;
    ATEN_CPU_CAPABILITY=avx2 forces the former), the memory test its transparent huge pages."""
    import torch

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    pages = thp.read_text().split("[")[1].split("]")[0] if thp.exists() else "unknown"
    return (f"cpu: torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} torch thread(s), {len(os.sched_getaffinity(0))} cores, transparent "
            f"huge pages {pages}")


def pytest_report_header(config: pytest.Config) -> str:
    return host_kernels()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if config.get_verbosity() < 0:   # -q (CI) prints no header: the line ends the report instead
        terminalreporter.write_line(host_kernels())


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The default tiny dense model (built offline on first use, then cached)."""
    from molt.inputs.tiny import tiny_model_path as build

    return str(build())


@pytest.fixture(scope="session")
def tok(tiny_model_path):
    """The tiny model's tokenizer (byte-level BPE with its chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session; logical CPUs > cores so small actors never starve.

    No prestarted workers: every actor here gets a worker of its own anyway, so Ray's spare ones only
    idled through the session (4 of them, ≈9 CPU-s each, on the cores the tests share)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled",
                                           "TOKENIZERS_PARALLELISM": "false"}},
                 _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_spec(tiny_model_path):
    """The RunSpec the shared `engine` runs with: eager, small KV cache, partial rollouts on."""
    from molt.spec import RunSpec

    return RunSpec.model_validate({
        "model": {"max_model_len": 1024},  # room for two constrained tool calls after a tool schema
        # one OpenMP thread, as test_engine's direct vLLM reference: equal logprobs need equal reductions
        "parallel": {"cpu_threads": 1},
        "rollout": {"max_tokens": 8, "engine": {"kv_cache_gib": 0.25, "enforce_eager": True}},
    })


def asked_for(spec, path: str, index: int = 0):
    """Body of an `*_loading` fixture: an engine actor asked for and not waited on (it loads meanwhile)."""
    import ray

    from molt.rollout.engine import start_engine

    actor = start_engine(spec, path, index)
    yield actor
    ray.kill(actor)


def waited_on(actor, spec):
    """Body of the fixture that hands out an `*_loading` engine: ready, and shut down at the end."""
    import ray

    ray.get(actor.ready.remote(), timeout=spec.rollout.engine.start_timeout_s)
    yield actor
    ray.get(actor.shutdown.remote())


@pytest.fixture(scope="session")
def engine_loading(ray_session, tiny_model_path, engine_spec):
    yield from asked_for(engine_spec, tiny_model_path)


@pytest.fixture(scope="session")
def engine(engine_loading, engine_spec):
    """One vLLM engine actor (molt.rollout.engine.EngineActor) on the tiny model, shared by all tests.

    Tests that refit it must restore the initial weights as version 0 before they return.
    """
    yield from waited_on(engine_loading, engine_spec)


@pytest.fixture(scope="session")
def second_engine_loading(ray_session, tiny_model_path, engine_spec):
    two = engine_spec.model_copy(update={"rollout": engine_spec.rollout.model_copy(update={
        "engine": engine_spec.rollout.engine.model_copy(update={"num_engines": 2})})})
    yield from asked_for(two, tiny_model_path, 1)


@pytest.fixture(scope="session")
def second_engine(second_engine_loading, engine_spec):
    """A second engine like `engine` (engine index 1: its seed is the run seed + 1), for the dispatcher."""
    yield from waited_on(second_engine_loading, engine_spec)


# The session's engines: when the first test that uses one of them starts, every one that a selected test
# uses is asked for, and none is waited on there: a start is mostly imports on one core (tens of seconds),
# so one at a time would leave the other core idle. (Not the trainer: TrainerRanks blocks, and building it
# in a thread races the test's own transformers imports, whose lazy modules are not thread-safe.)
LOAD_TOGETHER = {"engine": "engine_loading", "second_engine": "second_engine_loading",
                 "vlm_engine": "vlm_engine_loading"}
# What one test worker builds for many tests: the files that use any of it run on the same worker.
SHARED = {*LOAD_TOGETHER, "trainer"}
# The longest files (minutes, by `--durations`) start first, right after the shared group, so that the
# suite does not end on one of them while the other worker idles. A file missing here only starts later.
LONG_FILES = ("tests/test_trainer.py", "tests/test_loop.py", "tests/faults/test_trainer_faults.py",
              "tests/test_trainer_moe.py", "tests/test_lora.py")


@pytest.fixture(autouse=True)
def session_engines_load_together(request):
    if LOAD_TOGETHER.keys() & set(request.fixturenames):
        used = {name for item in request.session.items for name in item.fixturenames}
        for name, loader in LOAD_TOGETHER.items():
            if name in used:
                request.getfixturevalue(loader)


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test workers (pytest-xdist, `-n 2 --dist loadgroup` in pyproject.toml) take whole groups: a file is
    one group, so its module fixtures are built once, and every file that uses a `SHARED` fixture joins
    one group, so the session's engines and trainer are built once, on one worker. Groups are handed
    out in collection order: the shared group first, then `LONG_FILES`, then the rest."""
    shared = {item.path for item in items if SHARED & set(item.fixturenames)}
    groups = {item: "shared" if item.path in shared else item.nodeid.split("::")[0] for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    order = ["shared", *LONG_FILES]
    items.sort(key=lambda item: order.index(groups[item]) if groups[item] in order else len(order))


@pytest.fixture(scope="session")
def push_weights(ray_session):
    """`push(engines, state_dict, version, chunk_bytes, shared)`: this test process stands in for trainer
    rank 0.

    It hosts a refit group (`molt.refit`) that the engines join through the Dispatcher, then broadcasts the
    state dict in chunks while every engine receives it through `update_weights(version)`, the path a
    run takes. With `version=None` the workers only load (no pause, cache reset or relabel); with `shared`
    the payloads go by handle (parallel.colocate). Returns each engine's result.
    """
    import asyncio

    import torch

    from molt import refit
    from molt.rollout.dispatch import Dispatcher

    def chunked(state_dict: dict, chunk_bytes: int):
        chunk, size = {}, 0
        for name, tensor in state_dict.items():
            chunk[name] = tensor
            size += tensor.numel() * tensor.element_size()
            if size >= chunk_bytes:
                yield chunk
                chunk, size = {}, 0
        yield chunk

    def push(engines: list, state_dict: dict, version: int | None, chunk_bytes: int = 64 << 10,
             shared: bool = False) -> list:
        dispatcher, cpu = Dispatcher(engines), torch.device("cpu")

        async def connect():
            size = await dispatcher.refit_size()
            store = refit.listen("127.0.0.1", size)
            opened = asyncio.to_thread(refit.host_group, store, size, cpu, shared)
            group, _ = await asyncio.gather(opened, dispatcher.join_refit("127.0.0.1", store.port))
            return group

        group = asyncio.run(connect())
        receiving = [e.update_weights.remote(version) if version is not None
                     else e.collective_rpc.remote("molt_refit_receive") for e in engines]
        refit.send(group, chunked(state_dict, chunk_bytes), cpu, chunk_bytes, shared)
        return ray_session.get(receiving)

    return push


@pytest.fixture(scope="session")
def trainer(ray_session, tiny_model_path, tmp_path_factory):
    """One policy TrainerRanks on the tiny model (one rank) for tests that train a step on their rollouts.

    `trainer.initial` is a checkpoint of its starting weights (those of the shared engine): a test loads
    it before its step, so the trainer/engine gap of the step measures its own rollouts.
    """
    from molt.spec import RunSpec
    from molt.trainer.ranks import TrainerRanks

    group = TrainerRanks(RunSpec.model_validate({"train": {"micro_batch_size": 8}}), "policy")
    group.initial = str(tmp_path_factory.mktemp("trainer") / "initial")
    group.save(group.initial, {})
    yield group
    group.shutdown()


@pytest.fixture(scope="session")
def vlm_spec():
    """The RunSpec of the tiny vision-language model (conf/model/tiny_vl.yaml) that `vlm_engine` serves."""
    import yaml

    from molt.spec import RunSpec
    from molt.spec.user_modules import REPO_ROOT

    model = yaml.safe_load((REPO_ROOT / "conf" / "model" / "tiny_vl.yaml").read_text())
    return RunSpec.model_validate({
        "model": model,
        "rollout": {"max_tokens": 8, "engine": {"kv_cache_gib": 0.25, "enforce_eager": True}},
    })


@pytest.fixture(scope="session")
def vlm_path(vlm_spec) -> str:
    """The tiny Qwen2.5-VL (random init, small vision tower), built offline on first use."""
    from molt.inputs.tiny import tiny_model_path as build

    return str(build(**vlm_spec.model.tiny))


@pytest.fixture(scope="session")
def vlm_engine_loading(ray_session, vlm_path, vlm_spec):
    yield from asked_for(vlm_spec, vlm_path)


@pytest.fixture(scope="session")
def vlm_engine(vlm_engine_loading, vlm_spec):
    """One vLLM engine actor on the tiny VLM, shared by every test that sends images."""
    yield from waited_on(vlm_engine_loading, vlm_spec)
