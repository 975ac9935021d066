"""Code that runs inside vLLM's worker processes (installed with `worker_extension_cls`).

Weight refit: every worker of every engine joins the refit group (`molt.refit`) once, and on each refit
receives the trainer's chunks straight into the worker's own `reload_weights` (vLLM's layer-wise reload:
on CPU a direct `model.load_weights` corrupts the weights that vLLM repacked for oneDNN). With LoRA
(`model.lora`) the stream is the adapter alone, written as a PEFT folder that the engine then loads as
a new adapter. MoE route capture comes from `RouteCapture`.
"""

from __future__ import annotations

import json
import os
import threading

import torch

from molt import refit
from molt.rollout.engine_args import on_cpu
from molt.rollout.routes import RouteCapture


class MoltWorkerExtension(RouteCapture):
    """Methods vLLM mixes into its worker class; reached with `collective_rpc(name, ...)`."""

    def molt_refit_join(self, host: str, port: int, rank_offset: int, world_size: int) -> int:
        """Join the refit group as `rank_offset` + this worker's index in its engine; returns the rank."""
        par = self.parallel_config
        rank = rank_offset + par.data_parallel_index * par.world_size + par.rank
        refit.close_group(getattr(self, "_molt_refit", None))   # the group of the previous engine set
        self._molt_refit = refit.open_group(host, port, rank, world_size, self.device)
        return rank

    def molt_refit_receive_adapter(self, folder: str, lora: dict) -> None:
        """Receive the LoRA adapter the trainer is broadcasting now into `folder` on this worker's node, as
        the PEFT folder vLLM's LoRA loader reads (`lora`: the spec's model.lora)."""
        tensors = {name: tensor.clone() for name, tensor in refit.receive(self._molt_refit, self.device)}
        write_adapter(folder, tensors, lora)

    def molt_refit_receive(self) -> None:
        """Load the weights the trainer is broadcasting now (blocks until its end mark)."""
        self.reload_weights(weights_iterator=refit.receive(self._molt_refit, self.device),
                            is_checkpoint_format=True)
        model = self.model_runner.get_model()
        if on_cpu() and self.model_config.hf_config.get_text_config().tie_word_embeddings:
            # A tied lm_head receives no checkpoint tensor, so the CPU reload puts its *old* processed
            # (oneDNN-packed) weight back (vLLM 0.32, "ParallelLMHead: Failed to load weights"); tie and
            # process again. Only there: on GPU the head shares the embedding's storage (nothing is
            # repacked), and vLLM's own VLM classes have no `model.lm_head` / `model.model.embed_tokens`.
            head = model.lm_head
            head.weight = model.model.embed_tokens.weight
            head.quant_method.process_weights_after_loading(head)
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and on_cpu():
                # vLLM 0.32 skips the CPU MoE kernel's prepack on a weight *update* and copies the
                # checkpoint-layout experts into the prepacked storage; redo the prepack in place.
                kernel.fused_experts.process_weights_after_loading(module)


def write_adapter(folder: str, tensors: dict[str, torch.Tensor], lora: dict) -> None:
    """adapter_model.safetensors + adapter_config.json in `folder`. Workers of one engine that share a node
    write the same bytes to the same folder: each file is written aside and moved into place."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config = {"peft_type": "LORA", "r": lora["rank"], "lora_alpha": lora["alpha"], "target_modules": modules,
              "lora_dropout": lora["dropout"], "bias": "none", "task_type": "CAUSAL_LM"}
    aside = f".{os.getpid()}.{threading.get_ident()}"
    tensors = {name: tensor.cpu().contiguous() for name, tensor in tensors.items()}
    save_file(tensors, f"{folder}/adapter_model.safetensors{aside}")
    with open(f"{folder}/adapter_config.json{aside}", "w") as f:
        json.dump(config, f)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        os.replace(f"{folder}/{name}{aside}", f"{folder}/{name}")
