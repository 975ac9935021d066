"""GPU weight transport: vLLM's own NCCL weight transfer, trainer rank 0 broadcasting to every engine.

Selected when `parallel.device` is cuda. Every trainer rank builds one `NcclRefit` at start-up (rank 0
opens the NCCL group with all engine workers; the others only join the FSDP gathers) and calls
`send(version)` after each optimizer step. vLLM's trainer engine does the rest: it tells the engines
the parameter list, broadcasts the full tensors (gathered from FSDP shards one at a time) and has the
workers load them through the layerwise reload path. The engines pause, reset their prefix cache and
switch version exactly as in the CPU path (`EngineActor._pause` / `_commit`).

Not exercised by the test suite (it needs CUDA); parameter names must be the checkpoint's (true for
transformers models loaded as-is; AutoModel classes with fused experts need a converting source).
"""

from __future__ import annotations

from typing import Any

import ray
import torch


class _EngineClient:
    """vLLM's `VLLMWeightSyncClient` protocol over molt engine actors; each call fans out to all."""

    def __init__(self, engines: list[Any], workers_per_engine: int) -> None:
        self.engines = engines
        self.per_engine = workers_per_engine
        self.version = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        # vLLM numbers one engine's workers from rank_offset; each engine gets its own range.
        ray.get([e.nccl_init.remote({**init_info, "rank_offset": 1 + i * self.per_engine})
                 for i, e in enumerate(self.engines)])

    def start_weight_update(self) -> None:
        ray.get([e.nccl_start.remote() for e in self.engines])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        ray.get([e.nccl_receive.remote(update_info) for e in self.engines])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        ray.get([e.nccl_finish.remote(self.version) for e in self.engines])


class NcclRefit:
    def __init__(self, engines: list[Any], model: torch.nn.Module, rank: int, master_address: str,
                 master_port: int, workers_per_engine: int) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        self.client = _EngineClient(engines, workers_per_engine)
        info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=1 + len(engines) * workers_per_engine, rank=rank)
        self.transfer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self.client,
                                                                     source=ModuleSource(model))

    def send(self, version: int) -> None:
        """Called on every trainer rank after a step; engines label later tokens `version`."""
        self.client.version = version
        self.transfer.send_weights()
