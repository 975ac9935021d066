"""Placement: which node runs every actor, planned before Ray starts and checked before any actor starts.

The plan comes from the spec alone. Trainer roles (the policy, then the reference, then the critic;
`parallel.world_size` = dp_size * cp_size * tp_size ranks of one device each), engines
(`rollout.engine.num_engines`, each `rollout.engine.tp_size` devices on one node) and an LLM judge's
engines (`agent.judge.engine`, placed like engines; none for a judge at `agent.judge.url`) fill
`parallel.nodes` nodes of `parallel.gpus_per_node` GPUs in order; agent workers (`agent.workers`, one CPU
core each, no GPU) are spread evenly over the nodes that generate. With `parallel.trainer_nodes = K` nodes
0..K-1 train and the others generate (a judge's engines too); left null, all roles share every node (trainer
ranks first). On CUDA a plan that does not fit is a spec error, so it fails before Ray starts. On CPU
devices are time-shared cores, so the plan only maps roles to nodes.

Binding, once Ray is up: plan node i is the i-th alive Ray node (with GPUs, on CUDA), the driver's node
first, then the others by address and id. Each node's total resources must hold what the plan puts on it
(`python -m molt.eval`: its engines, judge engines and agent workers, placed as for a run), or the run
stops with the numbers. Actors are pinned with the label Ray gives every node (`ray.io/node-id`):
placement-group bundles for trainer ranks, a label selector for engines. `init_ray` starts Ray here or
attaches to `ray.address`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

    from molt.spec import RunSpec

NODE_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class Slot:
    role: str       # policy | reference | critic | engine | judge | agent (an agent worker)
    index: int      # the rank, or the engine's index
    node: int       # plan node
    gpus: int       # devices it holds on CUDA (0 on CPU)


def trainer_roles(spec: RunSpec) -> list[str]:
    return ["policy"] + ["reference"] * bool(spec.model.reference) + ["critic"] * spec.model.critic


def colocated(spec: RunSpec, role: str) -> bool:
    """Whether `role`'s actors share the trainer's GPU (parallel.colocate: the policy's engine and every
    trainer role); a judge's engines keep GPUs of their own."""
    return spec.parallel.colocate and role != "judge"


def gpu_share(spec: RunSpec) -> float:
    """The fraction of a GPU each actor that holds one asks Ray for: 1, or with parallel.colocate an
    equal share for each trainer role and the engine (on a one-GPU node Ray puts them all on it)."""
    return 1 / (len(trainer_roles(spec)) + 1) if spec.parallel.colocate else 1.0


def engine_groups(spec: RunSpec) -> list[tuple[str, int, int]]:
    """(role, engines, devices per engine) of the policy's engines and a judge's (SFT samples nothing; a
    judge at agent.judge.url runs elsewhere)."""
    if spec.train.objective != "rl":
        return []
    eng, judge = spec.rollout.engine, spec.agent.judge
    groups = [("engine", eng.num_engines, eng.tp_size)]
    if judge.path and not judge.url:
        groups.append(("judge", judge.engine.num_engines, judge.engine.tp_size))
    return groups


def plan(spec: RunSpec) -> list[Slot]:
    """Every actor's plan node; on CUDA raises ValueError with the numbers when the plan does not fit."""
    par = spec.parallel
    cuda = par.device == "cuda"
    roles = trainer_roles(spec)
    words = " + ".join(f"{role} {par.world_size}" for role in roles)   # e.g. "policy 8 + reference 8"
    if cuda:
        _check_totals(spec, words, len(roles) * par.world_size if not par.colocate else par.world_size)
    free = {n: par.gpus_per_node if cuda else float("inf") for n in range(par.nodes)}
    k = par.trainer_nodes
    train_nodes, engine_nodes = (range(par.nodes),) * 2 if k is None else (range(k), range(k, par.nodes))
    slots = []
    for role in roles:
        for rank in range(par.world_size):
            if par.colocate and role != "policy":   # on the policy rank's GPU
                slots.append(Slot(role, rank, 0, 0))
                continue
            node = next((n for n in train_nodes if free[n] >= 1), None)
            if node is None:
                raise ValueError(f"the trainer ({words}) does not fit on nodes {train_nodes[0]}.."
                                 f"{train_nodes[-1]} of {par.gpus_per_node} GPUs")
            free[node] -= 1
            slots.append(Slot(role, rank, node, int(cuda)))
    after_trainer = dict(free)
    for role, count, per_engine in engine_groups(spec):
        for index in range(count):
            if colocated(spec, role):   # the policy rank's GPU (one engine of one GPU: the spec's rule)
                slots.append(Slot(role, index, 0, 0))
                continue
            node = next((n for n in engine_nodes if free[n] >= per_engine), None)
            if node is None:
                left = ", ".join(f"node {n}: {after_trainer[n]:g}" for n in engine_nodes)
                raise ValueError(f"{count} {_engines(role)} x {per_engine} GPUs do not fit on nodes "
                                 f"{engine_nodes[0]}..{engine_nodes[-1]} (GPUs free after the trainer: "
                                 f"{left})")
            free[node] -= per_engine
            slots.append(Slot(role, index, node, per_engine * cuda))
    # Agent workers hold one CPU core each and no GPU, spread evenly over the nodes that generate (in
    # blocks): beside the engines they call, outside every GPU's reservation. `bind` checks the cores.
    workers = spec.agent.workers if spec.train.objective == "rl" else 0
    slots += [Slot("agent", i, engine_nodes[i * len(engine_nodes) // workers], 0) for i in range(workers)]
    return slots


def cpu_threads(spec: RunSpec, role: str, index: int, engines_idle: bool = False) -> int:
    """Torch/OpenMP threads of one CPU process: a trainer rank of `role`, or each worker of engine `index`.

    `parallel.cpu_threads` when set; null: the cores this process may run on, split between the processes
    of its node that compute at the same time. In sync mode generation and training take turns, so the
    stage that runs takes every core (a 30M-parameter step: 15.9 -> 10.6 s on 2 idle cores, bench/RESULTS.md
    `peer`); in async mode the node's engines and one role's ranks run together and split them. This is the
    plan; at run time null also leaves the cores other work keeps busy (molt/plan/cores.py: every parallel
    region would wait for a descheduled thread). `engines_idle`: a trainer rank's threads while
    no rollout generates in async mode (every slot of the pool holds a finished group): the engines' cores
    are lent to the trainer until generation resumes (molt.trainer.worker `set_engines_idle`).
    """
    if spec.parallel.cpu_threads:
        return spec.parallel.cpu_threads
    slots = plan(spec)
    # a role the spec does not plan (a critic built for a test, a judge) counts as alone on node 0
    me = next((s for s in slots if s.role == role and s.index == index), Slot(role, index, 0, 0))
    workers = spec.rollout.engine.tp_size
    engines = workers * sum(s.role == "engine" and s.node == me.node for s in slots)
    trainer_role = "policy" if role == "engine" else role
    ranks = sum(s.role == trainer_role and s.node == me.node for s in slots)
    alone = spec.rollout.mode == "sync" or (engines_idle and role != "engine")
    together = (engines if role == "engine" else ranks) if alone else engines + ranks
    return max(1, len(os.sched_getaffinity(0)) // max(1, together))


def _engines(role: str) -> str:
    return "judge engines" if role == "judge" else "engines"


def _check_totals(spec: RunSpec, words: str, trainer: int) -> None:
    par = spec.parallel
    groups = [(role, count, per) for role, count, per in engine_groups(spec) if not colocated(spec, role)]
    for role, _, per_engine in groups:
        if per_engine > par.gpus_per_node:
            which = "a judge engine" if role == "judge" else "an engine"
            raise ValueError(f"{which} of tp_size*dp_size = {per_engine} GPUs does not fit on one "
                             f"node of parallel.gpus_per_node={par.gpus_per_node} (an engine never spans "
                             "nodes)")
    need, have = trainer + sum(count * per for _, count, per in groups), par.nodes * par.gpus_per_node
    if need > have:
        engines = "".join(f" + {count} {_engines(role)} x {per}" for role, count, per in groups)
        raise ValueError(f"the plan needs {need} GPUs ({words}{engines}) "
                         f"but parallel.nodes x gpus_per_node = {par.nodes} x {par.gpus_per_node} = {have}")


def describe(spec: RunSpec, node_names: list[str] | None = None) -> list[str]:
    """One line per node (what runs there, GPUs used of the node's), then the total. Consecutive nodes
    that hold the same (e.g. 32 trainer nodes) share one line unless `node_names` are given."""
    par = spec.parallel
    cuda = par.device == "cuda"
    slots = plan(spec)
    rows = []
    for node in range(par.nodes):
        here = [s for s in slots if s.node == node]
        shape = tuple((role, len(list(g))) for role, g in groupby(here, key=lambda s: s.role))
        rows.append((node, here, shape))
    lines = []
    for _, run in groupby(rows, key=lambda r: r[2] if node_names is None else r[0]):
        run = list(run)
        first, last = run[0][0], run[-1][0]
        here = [s for r in run for s in r[1]]
        parts = []
        for role, group in groupby(here, key=lambda s: s.role):
            idx = [s.index for s in group]
            noun = {"engine": "engine", "judge": "judge engine", "agent": "agent worker"}.get(role,
                                                                                          f"{role} rank")
            parts.append(noun + (f"s {idx[0]}-{idx[-1]}" if len(idx) > 1 else f" {idx[0]}"))
        each = " each" if len(run) > 1 else ""
        used = f" | {sum(s.gpus for s in run[0][1])}/{par.gpus_per_node} GPUs{each}" if cuda else ""
        name = f" ({node_names[first]})" if node_names else ""
        nodes = f"nodes {first}-{last}" if len(run) > 1 else f"node {first}"
        lines.append(f"{nodes}{name}: {', '.join(parts) or 'idle'}{used}")
    if cuda:
        total = sum(s.gpus for s in slots)
        shared = " (parallel.colocate: the engine and every trainer role share the policy rank's GPU)" \
            if par.colocate else ""
        lines.append(f"total: {total} of {par.nodes} x {par.gpus_per_node} = {par.nodes * par.gpus_per_node} "
                     f"GPUs{shared}")
    else:
        engines = sum(s.role in ("engine", "judge") for s in slots)
        ranks = sum(s.role in ("policy", "reference", "critic") for s in slots)
        lines.append(f"total: {ranks} trainer rank(s) and {engines} engine(s) on {par.nodes} "
                     "node(s) (CPU: cores are shared)")
    workers = sum(s.role == "agent" for s in slots)
    if workers:
        lines.append(f"agent workers: {workers} x 1 CPU core, no GPU (agent.workers; each node's cores are "
                     "checked when Ray is up)")
    return lines


def cluster_nodes(spec: RunSpec) -> list[dict]:
    """The Ray nodes (as `ray.nodes()` entries) that plan nodes 0..nodes-1 run on."""
    import ray

    cuda = spec.parallel.device == "cuda"
    me = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n["Alive"] and (not cuda or n["Resources"].get("GPU", 0) > 0)]
    nodes.sort(key=lambda n: (n["NodeID"] != me, n["NodeManagerAddress"], n["NodeID"]))
    if len(nodes) < spec.parallel.nodes:
        raise RuntimeError(f"parallel.nodes={spec.parallel.nodes} but the Ray cluster has {len(nodes)} alive "
                           f"node(s){' with GPUs' if cuda else ''}")
    return nodes[:spec.parallel.nodes]


# Set in every process that joins an NCCL group (engine actors, trainer ranks): a collective whose peer died
# ends when its group's timeout passes (the watchdog aborts the communicator and ends the process, which the
# run recovers from as a dead actor) instead of hanging; torch's own default, made explicit because
# cluster images and older recipes set 0 (no handling).
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

# Ray CPUs one engine actor reserves (rollout/engine_args.py actor_options asks for them): on CPU a
# tiny fraction, so engines and trainer ranks share cores (threads are cpu_threads' business); on CUDA
# one core for the actor that drives its GPUs.
ENGINE_CPUS = {"cpu": 0.01, "cuda": 1}


def bind(spec: RunSpec, roles: Collection[str] | None = None) -> list[dict]:
    """`cluster_nodes`, after checking that each one's total resources hold what the plan puts on it (its
    `roles` only, when given: `python -m molt.eval` starts no trainer); raises RuntimeError with the numbers
    otherwise. Call it before any actor starts."""
    engine_cpus = ENGINE_CPUS[spec.parallel.device]
    nodes, slots, problems = cluster_nodes(spec), plan(spec), []
    slots = [s for s in slots if roles is None or s.role in roles]
    for i, node in enumerate(nodes):
        here = [s for s in slots if s.node == i]
        need = {"GPU": sum(s.gpus for s in here),
                "CPU": sum(engine_cpus if s.role in ("engine", "judge") else 1 for s in here)}
        for resource, amount in need.items():
            have = node["Resources"].get(resource, 0.0)
            if amount > have + 1e-6:
                where = f"node {i} ({node['NodeManagerAddress']}, {node['NodeID'][:8]})"
                problems.append(f"{where}: the plan puts {amount:g} {resource} there, the node has {have:g}")
    if problems:
        raise RuntimeError("the Ray cluster cannot hold the placement plan:\n  " + "\n  ".join(problems))
    return nodes


def node_selector(node_id: str) -> dict[str, str]:
    """A Ray label selector that pins an actor or bundle to one node."""
    return {NODE_LABEL: node_id}


# A private local cluster: nothing else joins it. Ray starts its workers at nice 15 (`worker_niceness`), so on
# a host where other work keeps the cores busy every trainer rank, engine and agent worker got a few percent
# of a core (the tool example's SFT step: 0.5 s idle, 16 s beside two busy processes). They are the job:
# nice 0.
LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}


def init_ray(spec: RunSpec) -> None:
    """Attach to `ray.address`, or start Ray on this machine.

    Locally on CPU, Ray is told there are more logical CPUs than cores: engines, trainer ranks and the
    driver time-share the cores anyway (one thread each), and a 2-core laptop must still place them.
    """
    import logging

    import ray

    quiet = logging.WARNING   # Ray's "Started a local Ray instance." repeats the plan's `ray:` line
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if spec.ray.address:
        ray.init(address=spec.ray.address, runtime_env={"env_vars": env}, logging_level=quiet)
        return
    for key, value in LOCAL_RAY_ENV.items():   # the user's own setting of either wins
        os.environ.setdefault(key, value)
    env["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
    cpus = spec.ray.num_cpus or (max(16, os.cpu_count() or 1) if spec.parallel.device == "cpu" else None)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
             logging_level=quiet)
