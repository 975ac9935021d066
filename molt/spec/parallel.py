"""The `parallel` section of the run spec: where trainer ranks and engines run, the trainer's layout,
and the layouts the trainer cannot run (refused with the reason)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from pydantic import Field, model_validator

from molt.spec.strict import Strict


def _power_of_two(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")

class ParallelSpec(Strict):
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where trainer ranks and engines run: cpu (gloo) or cuda (NCCL)")
    nodes: int = Field(1, ge=1, description="Ray nodes the run uses (molt/plan/placement.py)")
    gpus_per_node: int = Field(8, ge=1, description="cuda: GPUs on each node; the plan must fit nodes x this")
    trainer_nodes: int | None = Field(
        None, description="K: nodes 0..K-1 train, the others generate; null: all roles share every node")
    dp_size: int = Field(1, ge=1, description="data-parallel ranks (FSDP2 shards over them)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks (a power of two)")
    cp_size: int = Field(
        1, ge=1, description="context-parallel ranks: each micro-batch's sequence is split over them "
        "(zig-zag halves; attention all-to-all over heads, so it divides the attention heads)")
    ep_size: int = Field(1, ge=1, description="MoE expert-parallel ranks; divides dp_size (power of 2)")
    offload: Literal["none", "optimizer", "full"] = Field(
        "none", description="host memory: optimizer (AdamW state) or full (parameters, gradients, state)")
    activation_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    gpu_memory_gib: float = Field(
        80.0, gt=0, description="cuda: memory of one GPU; the plan is refused when a role's estimate "
        "(molt/plan/memory.py, shown by run.dry_run=true) exceeds it")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="seconds a trainer rank waits in one collective (gloo, NCCL) before it "
        "fails with an error instead of hanging (a peer that died or called another collective); torch's "
        "default. Rank 0 saving a checkpoint or an export while the others wait must fit in it")
    colocate: bool = Field(
        False, description="one GPU for the trainer and the engine (conf/parallel/gpu1.yaml): the engine "
        "sleeps while the trainer steps, the refit goes over CUDA IPC (cpu: the same schedule, cores shared)")
    engine_sleep_level: Literal[1, 2] = Field(
        1, description="colocate: the engine's vLLM sleep while the trainer steps: 1 keeps its weights in "
        "host memory, 2 drops them (the refit after the step restores them)")
    cpu_threads: int | None = Field(
        None, ge=1, description="cpu: torch threads per trainer rank and engine worker; null: the stage that "
        "runs takes the node's cores (sync: each in turn; async: engines and ranks split them, and the ranks "
        "take them all while no rollout generates), less those other work kept busy over the last second "
        "(molt/plan/cores.py)")

    @property
    def world_size(self) -> int:
        """Trainer ranks per role: the data-parallel replicas times the ranks of each."""
        return self.dp_size * self.replica_ranks

    @property
    def replica_ranks(self) -> int:
        """The ranks of one data-parallel replica, its context- and tensor-parallel ranks: they get the same
        rows (mesh order dp, cp, tp: consecutive ranks)."""
        return self.cp_size * self.tp_size

    @property
    def collective_timeout(self) -> timedelta:
        """`collective_timeout_s` as torch.distributed takes it (the ranks' rendezvous waits as long)."""
        return timedelta(seconds=self.collective_timeout_s)

    @model_validator(mode="after")
    def _sizes(self) -> ParallelSpec:
        for name in ("tp_size", "ep_size"):
            _power_of_two(name, getattr(self, name))
        if self.dp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide dp_size={self.dp_size} (experts shard over "
                             "data-parallel ranks)")
        _check_parallel(self)
        return self

def _check_parallel(par: ParallelSpec) -> None:
    """Refuse the layouts the trainer cannot run, with the reason (docs/parallelism.md)."""
    if par.ep_size > 1 and par.device == "cpu":
        raise ValueError("ep_size > 1 needs parallel.device=cuda: AutoModel shards experts only in its own "
                         "MoE model classes, which call torch.cuda.current_device() when built; the CPU "
                         "trainer loads the Hugging Face classes, on which AutoModel's expert parallel "
                         "raises")
    if par.cp_size > 1 and par.ep_size > 1:
        raise ValueError("cp_size > 1 with ep_size > 1: context parallel runs its attention in the Hugging "
                         "Face model classes, and AutoModel's expert parallel shards only its own MoE "
                         "classes; use ep_size=1 (FSDP2 still shards the experts) or cp_size=1")
    if par.offload == "full" and par.world_size == 1:
        raise ValueError("offload=full needs world_size = dp_size*cp_size*tp_size > 1: with one rank "
                         "AutoModel does not wrap the model in FSDP2, whose CPUOffloadPolicy is what moves "
                         "parameters to the host; use offload=optimizer")
    if par.nodes < 1 or par.gpus_per_node < 1:
        raise ValueError(f"nodes={par.nodes} and gpus_per_node={par.gpus_per_node} must be >= 1")
    if par.colocate and (par.world_size > 1 or par.nodes > 1):
        raise ValueError(f"colocate=true with {par.world_size} trainer rank(s) on {par.nodes} node(s): "
                         "colocation shares one GPU between one trainer rank and one engine (dp_size=tp_size="
                         "nodes=1); on several GPUs each rank would have to refit the engine on its own GPU, "
                         "which the refit does not do")
    if par.trainer_nodes is not None and not 1 <= par.trainer_nodes < par.nodes:
        raise ValueError(f"trainer_nodes={par.trainer_nodes} must leave the engines at least one of the "
                         f"{par.nodes} node(s) (1 <= trainer_nodes < nodes), or be null to share all nodes")
