"""Block-FP8 checkpoints (DeepSeek-V3's format) on the refit wire.

An engine loaded from an FP8 checkpoint holds each quantized linear layer as `weight` (float8_e4m3fn) and
`weight_scale_inv` (fp32, one per 128 x 128 block; weight ≈ fp8 x scale_inv). A refit in bf16 under the
plain names would leave those scales as they were, or uninitialized, and the engine would sample from
garbage without an error. So the trainer quantizes every tensor the checkpoint stores in FP8 the same
way, block by block, and sends both (molt/trainer/weights.py). Other quantized checkpoints are refused:
the refit has no way to reproduce their format.
"""

from __future__ import annotations

import json

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448
SCALE = "_scale_inv"


def checkpoint_fp8(path: str) -> tuple[set[str], tuple[int, int]] | None:
    """(names of the tensors the checkpoint at `path` stores in block FP8, the block shape), or None for an
    unquantized checkpoint. Raises for a quantization the refit cannot reproduce."""
    from transformers.utils import cached_file  # a local folder, or a hub id's cached files

    config_file = cached_file(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not quant:
        return None
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise ValueError(f"{config_file}: quantization_config {quant} is not supported: a refit sends the "
                         "trainer's weights in the checkpoint's format, and only block FP8 (quant_method "
                         "fp8 with weight_block_size, DeepSeek-V3's) is implemented; use an unquantized "
                         "checkpoint")
    with open(cached_file(path, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    return {n.removesuffix(SCALE) for n in names if n.endswith(SCALE)}, (int(block[0]), int(block[1]))


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight in float8_e4m3fn, scale_inv [ceil(rows / b0), ceil(cols / b1)] fp32) of a 2-D `weight`: each
    block's scale maps its largest magnitude to FP8's largest, so weight ≈ fp8 x scale_inv per block."""
    rows, cols = weight.shape
    b0, b1 = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % b1, 0, -rows % b0))   # zeros: amax unchanged
    blocks = padded.view(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(padded.shape)[:rows, :cols].contiguous(), scale


def quantize_chunk(chunk: dict[str, torch.Tensor], fp8: tuple[set[str], tuple[int, int]] | None
                   ) -> dict[str, torch.Tensor]:
    """`chunk` (checkpoint names) with each tensor the checkpoint stores in FP8 replaced by its quantized
    weight and `<name>_scale_inv`."""
    if fp8 is None:
        return chunk
    names, block = fp8
    out: dict[str, torch.Tensor] = {}
    for name, tensor in chunk.items():
        if name in names:
            out[name], out[name + SCALE] = quantize_blocks(tensor, block)
        else:
            out[name] = tensor
    return out
