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
from collections.abc import Iterator
from pathlib import Path

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
        config = self.model_config
        self._molt_expected = checkpoint_names(config.model, config.hf_config.get_text_config(),
                                               config.revision)
        return rank

    def molt_refit_receive_adapter(self, folder: str, lora: dict) -> None:
        """Receive the LoRA adapter the trainer is broadcasting now into `folder` on this worker's node, as
        the PEFT folder vLLM's LoRA loader reads (`lora`: the spec's model.lora)."""
        tensors = {name: tensor.clone() for name, tensor in refit.receive(self._molt_refit, self.device)}
        if not tensors:
            raise RuntimeError("refit: the trainer's stream held no adapter tensor; refusing an empty "
                               "adapter")
        write_adapter(folder, tensors, lora)

    def molt_refit_receive(self) -> None:
        """Load the weights the trainer is broadcasting now (blocks until its end mark). Raises when the
        stream was empty or lacked a tensor of the engine's checkpoint (`check_complete`)."""
        received: list[str] = []
        self.reload_weights(weights_iterator=_named(refit.receive(self._molt_refit, self.device), received),
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
        check_complete(received, self._molt_expected)


Named = Iterator[tuple[str, torch.Tensor]]


def _named(stream: Named, names: list[str]) -> Named:
    for name, tensor in stream:
        names.append(name)
        yield name, tensor


def checkpoint_names(model: str, text_config, revision: str | None = None) -> set[str]:
    """Tensor names the engine's model loads from the checkpoint it started from (safetensors headers, or
    the index): `model` is a local folder or a hub id, read from the Hugging Face cache where vLLM
    downloaded it (never fetched). Left out: a tied output head, which the trainer does not send, and
    multi-token-prediction layers, which vLLM's main model skips as it loads (DeepSeek-V3's layer
    `num_hidden_layers`, Qwen3-Next's `mtp.*`; the trainer's model has none of them)."""
    from safetensors import safe_open
    from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name

    folder = local_checkpoint(model, revision)
    index, names = folder / "model.safetensors.index.json", set()
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                names.update(f.keys())
    if getattr(text_config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return {n for n in names if not n.startswith("mtp.")
            and get_spec_layer_idx_from_weight_name(text_config, n) is None}


def local_checkpoint(model: str, revision: str | None = None) -> Path:
    """The folder of `model`: itself, or a hub id's snapshot in the Hugging Face cache (local files only).
    Raises when neither exists: without the names, a refit that misses a tensor would go unnoticed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if Path(model).is_dir():
        return Path(model)
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as err:
        raise RuntimeError(f"refit: {model} is neither a folder nor a hub id in the Hugging Face cache "
                           f"({type(err).__name__}), so the engine cannot check that a refit sends every "
                           "tensor of its checkpoint") from err


def check_complete(received: list[str], expected: set[str]) -> None:
    """Refuse a refit that sent nothing, or not every tensor of the checkpoint: vLLM's reload keeps the
    old values of what it did not receive (it only logs), so an engine would sample from a mix of two
    policies, labelled as the new one. The version is not advanced (the caller raises before)."""
    if not received:
        raise RuntimeError("refit: the trainer's stream held no tensor; refusing an empty reload (the "
                           "engine keeps its weights and version)")
    missing = sorted(expected - set(received))
    if missing:
        raise RuntimeError(f"refit: the trainer's stream lacked {len(missing)} of the checkpoint's "
                           f"{len(expected)} tensors (e.g. {', '.join(missing[:3])}); refusing a partial "
                           "reload: the engine's weights now mix two policies, and its version is not "
                           "advanced")


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
