"""Multi-node placement for real: a 2-node Ray cluster started on this machine (`ray start --head` and a
second `ray start` with its own resources), a run attached to it with `ray.address`, the trainer on node 0
and the engine on node 1 as in qwen30b_tools, 2 training steps. The engine also runs speculative decoding
(ngram drafts, prefix caching off, as the spec demands), and the trainer must still reproduce its
logprobs. The fixture stops exactly the processes of the cluster it started (found by its private temp
dir), also when the test fails."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from test_loop import SMALL, read_metrics

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
RAY = str(Path(sys.executable).with_name("ray"))
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(temp_dir: str) -> None:
    """SIGTERM, then SIGKILL, every process whose command line names this cluster's temp dir (GCS,
    raylets, agents, monitors) and everything they started (workers rename themselves `ray::...`)."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    procs = {p.pid: p for root in roots for p in [root, *root.children(recursive=True)]}
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def two_nodes():
    temp_dir = tempfile.mkdtemp(prefix="molt-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    address = f"127.0.0.1:{_free_port()}"
    common = ["--num-cpus=4", "--disable-usage-stats"]
    try:
        subprocess.run([RAY, "start", "--head", f"--port={address.split(':')[1]}", f"--temp-dir={temp_dir}",
                        "--include-dashboard=false", *common], env=ENV, check=True, capture_output=True,
                       timeout=180)
        subprocess.run([RAY, "start", f"--address={address}", '--resources={"molt_test_generate": 1}',
                        *common], env=ENV, check=True, capture_output=True, timeout=180)
        yield address
    finally:
        _stop(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


PROBE = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR")
nodes = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
actors = [(a["ActorClassName"], a["Address"]["NodeID"]) for a in state.actors().values()]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


def test_run_attached_to_two_nodes_places_roles_and_trains(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "molt", *SMALL, "train.steps=2", "train.save_every=0", "train.eval_every=0",
         f"ray.address={two_nodes}", "parallel.nodes=2", "parallel.trainer_nodes=1",
         "rollout.engine.enable_prefix_caching=false", f"hydra.run.dir={run_dir}",
         "+rollout.engine.speculative_config={method: ngram, num_speculative_tokens: 2, "
         "prompt_lookup_max: 2}"],
        env=ENV, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["mismatch/max_abs"] < 1e-4 for m in metrics)  # also after the cross-node refit
    assert "placement: node 0 (" in proc.stdout and "placement: node 1 (" in proc.stdout
    probe = subprocess.run([sys.executable, "-c", PROBE, two_nodes], env=ENV, capture_output=True, text=True,
                           timeout=120, check=True)
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    generate = [n for n, res in seen["nodes"].items() if "molt_test_generate" in res]
    [train] = [n for n in seen["nodes"] if n not in generate]
    where = {(cls, node) for cls, node in seen["actors"] if cls in ("EngineActor", "TrainerWorker")}
    assert where == {("TrainerWorker", train), ("EngineActor", generate[0])}
