"""Full weights out of the sharded model, streamed in chunks, in Hugging Face checkpoint names.

Parameters are gathered one at a time (a collective every rank joins in the same order) and only rank 0
keeps them, so rank 0 never holds more than one chunk beyond its shard. Names are converted back to the
checkpoint's layout (transformers' reverse weight conversion, e.g. fused MoE experts → per-expert
tensors; AutoModel's own model classes through their state-dict adapter); a tied output head is
skipped exactly as `save_pretrained` skips it, since the engine ties it back on load. LoRA adapters are
folded into their layers' weights, or streamed alone (`adapter_chunks`, molt/trainer/lora.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from molt.trainer.lora import PEFT_PREFIX, is_adapter


def _logical(name: str) -> str:
    # With activation checkpointing AutoModel wraps each layer in torch's checkpoint_wrapper (world size
    # > 1), which shows in `named_parameters` / `named_modules` but not in state-dict or checkpoint names:
    # strip it as torch's and AutoModel's own state-dict code do, or the engines get unknown names.
    return name.replace(_CHECKPOINT_PREFIX, "")


def _full(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        # NCCL gathers only device tensors; offloaded shards live on the host
        return tensor.to(device).full_tensor()
    return tensor


def _chunks(named: Iterator[tuple[str, torch.Tensor]], chunk_bytes: int, dtype: torch.dtype,
            device: torch.device, out: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Full tensors of `named` gathered in order (every rank), kept on rank 0 in dicts of ~`chunk_bytes`
    (the other ranks yield nothing but must run the generator to its end: they join every gather)."""
    rank0 = dist.get_rank() == 0
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named:
        full = _full(tensor.detach(), device)
        if rank0:
            chunk[name] = full.to(dtype=dtype, device=out)
            size += chunk[name].numel() * chunk[name].element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = {}, 0
    if chunk:
        yield chunk


def _merged(model: nn.Module, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers; a LoRA layer's weight with its adapter folded in (and the
    adapter itself left out), so the names and tensors are those of a model without adapters."""
    adapted = {_logical(name): module for name, module in model.named_modules() if hasattr(module, "lora_A")}
    # shared (tied) parameters appear once, under the first name; state-dict names carry no wrapper
    named = [(_logical(n), p) for n, p in model.named_parameters()]
    persistent = model.state_dict(keep_vars=True).keys()
    named += [(_logical(n), b) for n, b in model.named_buffers() if _logical(n) in persistent]
    for name, tensor in named:
        owner, _, leaf = name.rpartition(".")
        if is_adapter(name):
            continue
        if owner in adapted and leaf == "weight":
            layer = adapted[owner]
            delta = _full(layer.lora_B.weight.detach(), device) @ _full(layer.lora_A.weight.detach(), device)
            tensor = _full(tensor.detach(), device) + layer.scale * delta.to(tensor.dtype)
        yield name, tensor


def hf_chunks(model: nn.Module, chunk_bytes: int, dtype: torch.dtype, device: torch.device,
              out: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Yield dicts of full tensors on `out` of about `chunk_bytes` each (rank 0; see `_chunks`), LoRA
    adapters merged into their layers."""
    from transformers.core_model_loading import revert_weight_conversion

    adapter = getattr(model, "state_dict_adapter", None)
    for chunk in _chunks(_merged(model, device), chunk_bytes, dtype, device, out):
        yield adapter.to_hf(chunk) if adapter else revert_weight_conversion(model, chunk)


def adapter_chunks(model: nn.Module, chunk_bytes: int, dtype: torch.dtype, device: torch.device,
                   out: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """`hf_chunks` of the LoRA adapter alone, in PEFT names (`base_model.model.<parameter name>`)."""
    named = ((PEFT_PREFIX + _logical(n), p) for n, p in model.named_parameters() if is_adapter(n))
    yield from _chunks(named, chunk_bytes, dtype, device, out)


def export_hf(model: nn.Module, source: str, path: str, dtype: torch.dtype, device: torch.device,
              trust_remote_code: bool) -> None:
    """Write a Hugging Face folder (config, tokenizer, sharded safetensors + index) atomically; the tokenizer
    of `source` loads with `trust_remote_code` (model.trust_remote_code), as the trainer loaded the model."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    rank0 = dist.get_rank() == 0
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    index: dict[str, str] = {}
    for k, chunk in enumerate(hf_chunks(model, 1 << 30, dtype, device, torch.device("cpu"))):
        if rank0:
            file = f"model-{k:05d}.safetensors"
            tensors = {n: t.contiguous() for n, t in chunk.items()}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            index.update({n: file for n in chunk})
    if rank0:
        config = getattr(model, "config", None)
        config.dtype = dtype
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        if os.path.exists(os.path.join(source, "generation_config.json")):
            shutil.copy(os.path.join(source, "generation_config.json"), tmp)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
