"""Start-up of `python -m molt.tinker serve`: the served spec, its engines (placed as a run's), the
`Service` over them, and the HTTP server.

    python -m molt.tinker serve [--host 127.0.0.1] [--port 8000] [overrides]

The overrides are a run's (`model=...`, `parallel=...`, `rollout.engine.*`, `+experiment=...`); the
trainer ranks start when a client creates its training model, with the LoRA it asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from molt.spec import RunSpec, SpecError

DEFAULT_DIR = "runs/tinker"   # checkpoints (and metrics.jsonl) of the service, kept across restarts


def served_spec(spec: RunSpec) -> RunSpec:
    """`spec` as the service runs it, or SpecError for a key the service cannot honour.

    The client picks the LoRA rank per training model (`model.lora` here only gives alpha and dropout). A
    datum is scored under the model's own distribution, so the trainer's sampling is the plain one; and a
    refit waits for the samples in flight (no partial rollouts), so every sample comes from one version."""
    if spec.model.lora.rank:
        raise SpecError(f"model.lora.rank={spec.model.lora.rank}: the client picks the rank "
                        "(create_lora_training_client(rank=...)); leave it at 0")
    spec = spec.model_copy(deep=True)
    spec.run.dir = spec.run.dir or DEFAULT_DIR
    spec.logging.progress = False
    spec.rollout.partial_rollout = False
    spec.rollout.temperature, spec.rollout.top_p, spec.rollout.top_k = 1.0, 1.0, -1
    return spec


def start_service(spec: RunSpec, engines: list | None = None):
    """The `Service` of a served spec (Ray is up): its engines (or `engines`, already started from it) and
    the run logger. Blocks until the engines are ready."""
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from molt.driver.fleet import Fleet
    from molt.driver.metrics import RunLogger
    from molt.plan.models import model_path
    from molt.rollout.engine import start_engine
    from molt.tinker.futures import Futures
    from molt.tinker.sampling import Engines
    from molt.tinker.service import Service

    path = model_path(spec)
    if engines is None:
        engines = [start_engine(spec, path, i) for i in range(spec.rollout.engine.num_engines)]
        ray.get([e.ready.remote() for e in engines], timeout=spec.rollout.engine.start_timeout_s)
    trust = spec.model.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    held = Engines(Fleet(spec, path, engines), spec.model.path or path, spec.model.max_model_len, Futures())
    return Service(spec, held, AutoConfig.from_pretrained(path, trust_remote_code=trust),
                   tokenizer.pad_token_id, RunLogger(spec))


@contextmanager
def serving(service, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `service` over HTTP from a thread of this process while the block runs; yields its base URL
    (port 0: one the OS picks). On exit the trainer ranks stop; the engines stay."""
    import uvicorn

    from molt.tinker.app import build_app

    server = uvicorn.Server(uvicorn.Config(build_app(service), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="molt-tinker", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"molt.tinker: the HTTP server did not start on {host}:{port}")
        threading.Event().wait(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        asyncio.run_coroutine_threadsafe(service.close(), service.loop).result(timeout=120)
        server.should_exit = True
        thread.join(timeout=30)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m molt.tinker serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (no authentication: keep "
                        "it on a trusted network)")
    parser.add_argument("--port", type=int, default=8000)
    args, overrides = parser.parse_known_args(argv)
    import os

    import ray
    import uvicorn

    from molt.driver.compose import compose
    from molt.plan.placement import bind, init_ray
    from molt.tinker.app import build_app

    try:
        spec = served_spec(compose(overrides))
    except SpecError as err:
        sys.exit(f"molt.tinker: {err}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_ray(spec)
    service = None
    try:
        bind(spec)
        service = start_service(spec)
        print(f"molt.tinker: serving {service.base_model} at http://{args.host}:{args.port} (tinker SDK "
              f"{tinker_version()}); checkpoints in {service.checkpoints}", flush=True)
        uvicorn.run(build_app(service), host=args.host, port=args.port, log_level="warning")
    finally:   # (Ray's shutdown stops every engine and trainer rank)
        if service is not None:
            service.logger.close()
        ray.shutdown()


def tinker_version() -> str:
    from importlib.metadata import version

    return version("tinker")
