"""Full weights out of the sharded model, streamed in chunks, in Hugging Face checkpoint names.

Parameters are gathered one at a time (a collective every rank joins in the same order) and only rank 0
keeps them, so rank 0 never holds more than one chunk beyond its shard. Names are converted back to the
checkpoint's layout (transformers' reverse weight conversion, e.g. fused MoE experts → per-expert
tensors; AutoModel's own model classes through their state-dict adapter); a tied output head is
skipped exactly as `save_pretrained` skips it, since the engine ties it back on load.
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
from torch.distributed.tensor import DTensor


def _full(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        # NCCL gathers only device tensors; offloaded shards live on the host
        return tensor.to(device).full_tensor()
    return tensor


def hf_chunks(model: nn.Module, chunk_bytes: int, dtype: torch.dtype, device: torch.device,
              out: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Yield dicts of full tensors on `out` (on rank 0; empty dicts elsewhere) of about `chunk_bytes` each."""
    from transformers.core_model_loading import revert_weight_conversion

    rank0 = dist.get_rank() == 0
    named = list(model.named_parameters())  # shared (tied) parameters appear once, under the first name
    persistent = model.state_dict(keep_vars=True).keys()
    named += [(n, b) for n, b in model.named_buffers() if n in persistent]
    adapter = getattr(model, "state_dict_adapter", None)
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for i, (name, tensor) in enumerate(named):
        full = _full(tensor.detach(), device)
        if rank0:
            chunk[name] = full.to(dtype=dtype, device=out)
            size += chunk[name].numel() * chunk[name].element_size()
        if size >= chunk_bytes or (i == len(named) - 1):
            if rank0:
                chunk = adapter.to_hf(chunk) if adapter else revert_weight_conversion(model, chunk)
            yield chunk
            chunk, size = {}, 0


def export_hf(model: nn.Module, source: str, path: str, dtype: torch.dtype, device: torch.device) -> None:
    """Write a Hugging Face folder (config, tokenizer, sharded safetensors + index) atomically."""
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
        AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
        if os.path.exists(os.path.join(source, "generation_config.json")):
            shutil.copy(os.path.join(source, "generation_config.json"), tmp)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
