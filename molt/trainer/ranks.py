"""Driver-side handle over the Ray actors of one trainer role (policy, reference or critic).

The group places one `TrainerWorker` per rank (one GPU each on CUDA) on the node the placement plan gives
it (molt/plan/placement.py), has them rendezvous into one torch.distributed group, and turns each call into
the same collective call on every rank: rows of a batch are padded to a multiple of dp_size and split
into equal contiguous shards (the cp and tp ranks of one data shard get the same rows), and rank 0's answer is
returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from molt.plan.models import model_path
from molt.plan.placement import NCCL_ENV, cluster_nodes, gpu_share, node_selector, plan
from molt.spec import AlgoSpec, ParallelSpec, RunSpec
from molt.trainer.batch import pad_rows

ROLES = ("policy", "reference", "critic")
SHUTDOWN_TIMEOUT_S = 30.0   # how long ranks get to leave their process group before they are killed
PLACEMENT_TIMEOUT_S = 600.0   # how long other work may hold the ranks' resources before the run stops


def gather(refs: list[ray.ObjectRef]) -> list[Any]:
    """Every rank's answer. When a rank dies mid-collective its peers fail too (gloo/NCCL "connection
    reset"), and which error `ray.get` meets first depends on rank order: raise the death, the root
    cause that the loop restarts the trainer from, not a survivor's symptom."""
    try:
        return ray.get(refs)
    except RayTaskError as symptom:
        for ref in refs:
            try:
                ray.get(ref)
            except RayActorError as death:
                raise death from symptom
            except RayTaskError:
                pass
        raise


def row_shards(batch: dict[str, torch.Tensor], par: ParallelSpec) -> list[dict[str, torch.Tensor]]:
    """Each rank's rows of `batch`: padded to a multiple of dp_size (inert rows) and split into equal
    contiguous shards, one per data-parallel replica; the cp and tp ranks of a replica get the same rows."""
    padded = pad_rows(batch, par.dp_size)
    per = padded["input_ids"].shape[0] // par.dp_size
    replicas = par.replica_ranks
    return [{k: v[(r // replicas) * per:(r // replicas + 1) * per] for k, v in padded.items()}
            for r in range(par.world_size)]


class TrainerRanks:
    def __init__(self, spec: RunSpec, role: str = "policy") -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r}; valid: {', '.join(ROLES)}")
        self.spec, self.role = spec, role
        self._rows = 0   # the rows of the last update's batch (its shards are padded)
        path = model_path(spec, role)   # resolved here, once: ranks only read the folder
        par = spec.parallel
        bundle = {"CPU": 1, "GPU": gpu_share(spec)} if par.device == "cuda" else {"CPU": 1}
        # Each rank's bundle is pinned to its plan node; a role the spec does not configure (a direct
        # TrainerRanks call) goes where the policy goes.
        slots = plan(spec)
        mine = [s for s in slots if s.role == role] or [s for s in slots if s.role == "policy"]
        ids = [n["NodeID"] for n in cluster_nodes(spec)]
        self._pg = placement_group([bundle] * par.world_size, strategy="PACK",
                                   bundle_label_selector=[node_selector(ids[s.node]) for s in mine])
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            # The plan fits the cluster's totals (checked before Ray starts): what is missing is free now.
            remove_placement_group(self._pg)
            raise RuntimeError(
                f"the {role}'s {par.world_size} trainer rank(s) ({bundle} each, on plan nodes "
                f"{sorted({s.node for s in mine})}) were not placed within {PLACEMENT_TIMEOUT_S:g} s: the "
                "cluster is large enough, but other work holds those resources now (`ray status` shows "
                "what is free)") from None
        # Imported here: the worker's module pulls in transformers and FSDP (≈4.5 s), which the driver
        # then imports after it has asked for the engines, not before (start-up, molt/driver/loop.py).
        from molt.trainer.worker import TrainerWorker

        # "control": `set_engines_idle` is delivered while a step runs in the default group
        actor = ray.remote(concurrency_groups={"control": 1})(TrainerWorker)
        self.workers = [
            actor.options(num_cpus=1, num_gpus=bundle.get("GPU", 0), runtime_env={"env_vars": NCCL_ENV},
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self._pg, placement_group_bundle_index=r))
            .remote(spec, role, r, path)
            for r in range(par.world_size)
        ]
        host, port = ray.get(self.workers[0].address.remote())
        gather([w.setup.remote(host, port) for w in self.workers])

    def _shards(self, batch: dict[str, torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]], int]:
        return row_shards(batch, self.spec.parallel), batch["input_ids"].shape[0]

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        shards, rows = self._shards(batch)
        outs = gather([w.forward.remote(s) for w, s in zip(self.workers, shards, strict=True)])
        return torch.cat(outs[::self.spec.parallel.replica_ranks])[:rows]

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] log π(token t | tokens < t) under the distribution token t was sampled from (the batch's
        temperature / top_p / top_k, else the run's); 0 at t = 0 and on padding."""
        if self.role == "critic":
            raise ValueError("the critic has no logprobs; use values()")
        return self._forward(batch)

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] V(tokens < t) at position t, the baseline of the action at t (critic only); 0 at t = 0 and
        on padding."""
        if self.role != "critic":
            raise ValueError(f"values() needs the critic, this group is the {self.role}")
        return self._forward(batch)

    def update(self, batch: dict[str, torch.Tensor], algo: AlgoSpec | None = None,
               record: bool = False) -> dict[str, float]:
        """train.minibatches x train.epochs optimizer steps over the batch (policy: policy_loss; critic:
        value_loss) with the step's `algo` (None: the spec's). Returns the step's metrics as the run logs
        them: the policy's under train/ (its trainer/engine gap under mismatch/), the critic's under
        critic/. `record`: the ranks keep what the policy loss computed on each token (`token_record`)."""
        if self.role == "reference":
            raise ValueError("the reference model is frozen")
        shards, self._rows = self._shards(batch)
        return gather([w.update.remote(s, algo, record)
                       for w, s in zip(self.workers, shards, strict=True)])[0]

    def token_record(self) -> dict[str, torch.Tensor]:
        """The last `update(record=True)`'s per-token record, [B, T] per field in the batch's rows
        (molt.trainer.token_record: ids, loss mask, logprobs, advantages, weights, decisions, entropy)."""
        outs = gather([w.token_record.remote() for w in self.workers])[::self.spec.parallel.replica_ranks]
        keys = set(outs[0]).intersection(*outs)
        return {k: torch.cat([o[k] for o in outs])[:self._rows] for k in sorted(keys)}

    def accumulate(self, batch: dict[str, torch.Tensor], loss: str, config: dict[str, Any],
                   backward: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """[B, T] logprobs of the batch's `target_ids` and the summed datum loss `loss` (with `config`), its
        gradient added to the accumulated ones with `backward` (TrainerWorker.accumulate); policy only."""
        shards, rows = self._shards(batch)
        outs = gather([w.accumulate.remote(s, loss, config, backward)
                       for w, s in zip(self.workers, shards, strict=True)])
        replicas = self.spec.parallel.tp_size
        return torch.cat([out for out, _ in outs[::replicas]])[:rows], outs[0][1]

    def apply_gradients(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                        max_norm: float) -> float:
        """One AdamW step on the gradients `accumulate` added up; returns their norm before clipping."""
        return self._all("apply_gradients", lr, betas, eps, weight_decay, max_norm)

    def _all(self, method: str, *args: Any) -> Any:
        return gather([getattr(w, method).remote(*args) for w in self.workers])[0]

    def set_engines_idle(self, idle: bool) -> None:
        """Async mode: the engines sample nothing (`idle`) or resume; the ranks change their CPU threads at
        the next block of the model they compute (`molt.plan.placement.cpu_threads`). Not awaited: it must not
        wait for a step."""
        for w in self.workers:
            w.set_engines_idle.remote(idle)

    def host_refit(self, world_size: int) -> tuple[str, int]:
        """Rank 0 listens for a refit group of `world_size` ranks; returns where the engine workers join."""
        return ray.get(self.workers[0].host_refit.remote(world_size))

    def join_refit(self, world_size: int) -> None:
        """Open the refit group on rank 0; blocks until all `world_size - 1` engine workers joined."""
        ray.get(self.workers[0].join_refit.remote(world_size))

    def abort_refit(self) -> None:
        """Abort rank 0's refit group while a transfer to receivers that died still waits in it."""
        ray.get(self.workers[0].abort_refit.remote())

    def send_weights(self) -> int:
        """Broadcast the full weights (checkpoint names, model.dtype) to the engines; returns the bytes sent.
        The engines must be receiving at the same time (`EngineActor.update_weights`)."""
        return self._all("send_weights")

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self._all("save", path, extra)

    def load(self, path: str, weights_only: bool = False) -> dict[str, Any]:
        """Restore a `save`d state; `weights_only`: the weights, with a fresh optimizer."""
        return self._all("load", path, weights_only)

    def export_hf(self, path: str) -> None:
        self._all("export_hf", path)

    def shutdown(self) -> None:
        # A rank may be dead already (the fault that stopped the run), and the others may be stuck in a
        # collective with it: give them a bounded time to stop, then kill them all.
        refs = [w.shutdown.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self._pg)


@dataclass
class Trainers:
    """The run's trainer groups by role: the policy, and the reference and the critic when the spec has
    them (None otherwise; a test may leave out the policy too, as a critic warm-up step does), and the
    token id their batches are padded with (the policy tokenizer's pad token)."""

    policy: TrainerRanks | None = None
    reference: TrainerRanks | None = None
    critic: TrainerRanks | None = None
    pad_id: int = 0

    @classmethod
    def start(cls, spec: RunSpec, pad_id: int) -> Trainers:
        return cls(TrainerRanks(spec, "policy"), TrainerRanks(spec, "reference") if spec.model.reference
                   else None, TrainerRanks(spec, "critic") if spec.model.critic else None, pad_id)

    def roles(self) -> dict[str, TrainerRanks]:
        """The groups the run has, by role (a checkpoint holds one folder per role that trains)."""
        return {role: group for role, group in (("policy", self.policy), ("reference", self.reference),
                                                 ("critic", self.critic)) if group}

    def stop(self) -> None:
        for group in self.roles().values():
            group.shutdown()
