"""Full weights out of the sharded model, streamed in chunks, in Hugging Face checkpoint names.

Parameters are gathered one at a time (a collective every rank joins in the same order) and only rank 0
keeps them, so rank 0 never holds more than one chunk beyond its shard. Names are converted back to the
checkpoint's layout (transformers' reverse weight conversion, e.g. fused MoE experts → per-expert
tensors; AutoModel's own model classes through their state-dict adapter); a tied output head is
skipped exactly as `save_pretrained` skips it, since the engine ties it back on load. LoRA adapters are
folded into their layers' weights, or streamed alone (`adapter_chunks`, molt/trainer/lora.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from molt.spec import RunSpec
from molt.trainer.fp8 import quantize_chunk
from molt.trainer.lora import PEFT_PREFIX, is_adapter
from molt.trainer.model import DTYPES


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


def _rows(tensor: torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Rows start..stop-1 (dim 0) of the full tensor, gathered without gathering the rest (every rank).

    A rank contributes the part of those rows its shard holds, zeros elsewhere, and the pieces are summed
    over the mesh dimensions that shard dim 0 (exact: each row is non-zero on one rank only); the other
    placements gather as usual. Peak memory per rank is about two copies of the piece.
    """
    if not isinstance(tensor, DTensor):
        return tensor[start:stop]
    local, mesh, placements = tensor.to_local(), tensor.device_mesh, tensor.placements
    shape = (stop - start, *tensor.shape[1:])
    if any(type(p) is Shard and p.dim == 0 for p in placements):
        local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        lo, hi = max(start, offset[0]), min(stop, offset[0] + local_shape[0])
        piece = torch.zeros((stop - start, *local.shape[1:]), dtype=local.dtype, device=device)
        if lo < hi:
            piece[lo - start:hi - start] = local[lo - offset[0]:hi - offset[0]]
        placements = [Partial() if type(p) is Shard and p.dim == 0 else p for p in placements]
    else:   # dim 0 is whole on every rank: every rank slices the same rows
        piece = local[start:stop].to(device)
    stride = torch.empty(shape, device="meta").stride()
    piece = DTensor.from_local(piece, mesh, placements, run_check=False, shape=shape, stride=stride)
    return piece.full_tensor()


def _row_wise(tensor: torch.Tensor) -> bool:
    # a placement that shards dim 0 in strides (FSDP over TP on one dim) has no contiguous rows per rank
    return tensor.dim() >= 2 and (not isinstance(tensor, DTensor) or all(
        type(p) is Shard or getattr(p, "dim", None) != 0 for p in tensor.placements))


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _convert(model: nn.Module, chunk: dict[str, torch.Tensor], first_expert: int | None = None
             ) -> dict[str, torch.Tensor]:
    """`chunk` in checkpoint names and layout (the model's reverse weight conversion). With `first_expert`,
    `chunk` is one tensor holding experts first_expert.. along dim 0 of a grouped-experts parameter: it is
    converted as the parameter of a model with that many experts, then numbered from `first_expert`."""
    from transformers.core_model_loading import revert_weight_conversion

    adapter = getattr(model, "state_dict_adapter", None)
    if adapter is not None and first_expert is not None:
        # AutoModel's adapter checks dim 0 against the model's expert count: give it the piece's
        [piece] = chunk.values()
        adapter = copy.copy(adapter)
        adapter.moe_config = dataclasses.replace(adapter.moe_config, n_routed_experts=piece.shape[0])
    out = adapter.to_hf(chunk) if adapter is not None else revert_weight_conversion(model, chunk)
    if first_expert is None:
        return out
    def shifted(m: re.Match) -> str:
        return f".experts.{int(m[1]) + first_expert}."
    return {_EXPERT.sub(shifted, k, count=1): v for k, v in out.items()}


def _per_expert(model: nn.Module, name: str, shape: torch.Size) -> bool:
    """Whether the checkpoint holds parameter `name` as one tensor per index of its dim 0 (grouped MoE
    experts): then a range of that dim converts on its own. Probed on a meta tensor (no memory)."""
    out = _convert(model, {name: torch.empty(shape, device="meta")})
    ids = [_EXPERT.search(k) for k in out]
    return len(out) > 1 and all(ids) and {int(m[1]) for m in ids} == set(range(shape[0]))


def _chunks(named: Iterator[tuple[str, torch.Tensor, torch.dtype]], chunk_bytes: int, device: torch.device,
            out: torch.device, model: nn.Module | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Full tensors of `named` (name, tensor, dtype to send) gathered in order (every rank), kept on rank 0
    in converted dicts of ~`chunk_bytes` (the other ranks yield nothing but must run the generator to its
    end: they join every gather). With `model`, names and layout are the checkpoint's (`_convert`).

    A tensor larger than `chunk_bytes` is gathered and cast a range of rows at a time: a grouped-experts
    parameter (30 GB in fp32 for one DeepSeek-V3 layer) is converted and yielded per range of experts, so
    no rank ever holds it whole; any other is assembled on rank 0 in the dtype it is sent in.
    """
    rank0 = dist.get_rank() == 0
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor, dtype in named:
        tensor = tensor.detach()
        row_bytes = math.prod(tensor.shape[1:]) * dtype.itemsize
        if tensor.numel() * dtype.itemsize <= chunk_bytes or not _row_wise(tensor) or len(tensor) == 1:
            full = _full(tensor, device)
            if rank0:
                chunk[name] = full.to(dtype=dtype, device=out)
                size += chunk[name].numel() * chunk[name].element_size()
        else:
            step = max(1, chunk_bytes // row_bytes)
            if model is not None and _per_expert(model, name, tensor.shape):
                for start in range(0, len(tensor), step):
                    piece = _rows(tensor, start, min(start + step, len(tensor)), device)
                    if rank0:
                        yield _convert(model, {name: piece.to(dtype=dtype, device=out)}, first_expert=start)
                    del piece
                continue
            whole = torch.empty(tensor.shape, dtype=dtype, device=out) if rank0 else None
            for start in range(0, len(tensor), step):
                piece = _rows(tensor, start, min(start + step, len(tensor)), device)
                if rank0:
                    whole[start:start + len(piece)] = piece
                del piece
            if rank0:
                chunk[name] = whole
                size += whole.numel() * whole.element_size()
        if size >= chunk_bytes:
            yield _convert(model, chunk) if model is not None else chunk
            chunk, size = {}, 0
    if chunk:
        yield _convert(model, chunk) if model is not None else chunk


def _merged(model: nn.Module, device: torch.device, dtype: torch.dtype
            ) -> Iterator[tuple[str, torch.Tensor, torch.dtype]]:
    """Parameters and persistent buffers, with the dtype each is sent in; a LoRA layer's weight with its
    adapter folded in (and the adapter itself left out), so the names and tensors are those of a model
    without adapters.

    Parameters go in `dtype` (model.dtype: the engine's weights). A buffer keeps its own dtype: the ones
    a checkpoint carries are statistics kept in fp32 on both sides (DeepSeek-V3's
    `e_score_correction_bias` decides top-k routing), and an engine that keeps one in a lower precision
    rounds it as it loads, as a cast here would.
    """
    adapted = {_logical(name): module for name, module in model.named_modules() if hasattr(module, "lora_A")}
    # shared (tied) parameters appear once, under the first name; state-dict names carry no wrapper
    named = [(_logical(n), p, dtype if p.is_floating_point() else p.dtype)
             for n, p in model.named_parameters()]
    persistent = model.state_dict(keep_vars=True).keys()
    named += [(_logical(n), b, b.dtype) for n, b in model.named_buffers() if _logical(n) in persistent]
    for name, tensor, out_dtype in named:
        owner, _, leaf = name.rpartition(".")
        if is_adapter(name):
            continue
        if owner in adapted and leaf == "weight":
            layer = adapted[owner]
            delta = _full(layer.lora_B.weight.detach(), device) @ _full(layer.lora_A.weight.detach(), device)
            tensor = _full(tensor.detach(), device) + layer.scale * delta.to(tensor.dtype)
        yield name, tensor, out_dtype


def hf_chunks(model: nn.Module, chunk_bytes: int, dtype: torch.dtype, device: torch.device,
              out: torch.device, fp8: tuple[set[str], tuple[int, int]] | None = None
              ) -> Iterator[dict[str, torch.Tensor]]:
    """Yield dicts of full tensors on `out` of about `chunk_bytes` each (rank 0; see `_chunks`), LoRA
    adapters merged into their layers; with `fp8` (`molt.trainer.fp8.checkpoint_fp8` of a block-FP8
    checkpoint) the tensors it names quantized as the checkpoint holds them, with their scales."""
    for chunk in _chunks(_merged(model, device, dtype), chunk_bytes, device, out, model):
        yield quantize_chunk(chunk, fp8)


def refit_chunks(model: nn.Module, spec: RunSpec, chunk_bytes: int, device: torch.device,
                 fp8: tuple[set[str], tuple[int, int]] | None) -> Iterator[dict[str, torch.Tensor]]:
    """What a refit streams (`hf_chunks` in model.dtype on `device`); with LoRA served as an adapter only
    the adapter changes: the engines keep the base weights and load a new adapter."""
    dtype = DTYPES[spec.model.dtype]
    if spec.model.lora.served_as_adapter():
        return adapter_chunks(model, chunk_bytes, dtype, device, device)
    return hf_chunks(model, chunk_bytes, dtype, device, device, fp8)


def adapter_chunks(model: nn.Module, chunk_bytes: int, dtype: torch.dtype, device: torch.device,
                   out: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """`hf_chunks` of the LoRA adapter alone, in PEFT names (`base_model.model.<parameter name>`)."""
    named = ((PEFT_PREFIX + _logical(n), p, dtype) for n, p in model.named_parameters() if is_adapter(n))
    yield from _chunks(named, chunk_bytes, device, out)


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
        export_config(model.config, dtype).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(tmp)
        if os.path.exists(os.path.join(source, "generation_config.json")):
            shutil.copy(os.path.join(source, "generation_config.json"), tmp)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()


def export_config(config, dtype: torch.dtype):
    """The model's config as the exported tensors need it: in `dtype`, without a quantization config. The
    exporter writes `dtype` tensors under plain names; a block-FP8 checkpoint's `quantization_config`
    (which AutoModel's GPU loader keeps on the model it dequantized) would make vLLM and transformers
    read them as FP8 layers that lack their scales."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        if hasattr(part, "quantization_config"):
            del part.quantization_config
    return config
