"""The models and batches bench/gpu_smoke.py's item checks use, all built offline (no download).

- `fp8_copy`: a dense tiny Qwen3 rewritten as a block-FP8 checkpoint in the layout of Qwen3-FP8 and
  DeepSeek-V3 (`weight` float8_e4m3fn + `weight_scale_inv` per 128 x 128 block), quantized by
  molt/trainer/fp8.py.
- `tiny_deepseek_v3`: a 2-layer DeepSeek-V3 (MLA with the real model's latent sizes, one MoE layer with
  `noaux_tc` routing), whose fp32 `e_score_correction_bias` holds values bf16 cannot represent.
- `image_batch`: a VLM batch whose first half of rows holds an image and second half none, so the second
  trainer rank's micro-batch has no image at all.
Each is cheap enough for the CPU test that checks them (tests/test_bench.py).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from molt.inputs.tiny import build_tokenizer
from molt.trainer.fp8 import SCALE, quantize_blocks

BLOCK = (128, 128)
# the linear layers a Qwen3-FP8 checkpoint stores in FP8 (embedding, norms and head stay bf16)
FP8_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


def fp8_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` as the FP8 checkpoint holds them: the FP8 layers quantized from their bf16 values (as the
    trainer's bf16 weights are quantized at a refit), their scales beside them, the rest in bf16."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        bf16 = tensor.to(torch.bfloat16)
        if name.rsplit(".", 2)[-2] in FP8_LAYERS and name.endswith(".weight"):
            out[name], out[name + SCALE] = quantize_blocks(bf16, BLOCK)
        else:
            out[name] = bf16
    return out


def fp8_copy(src: Path, dst: Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `src` (a dense tiny folder; its tensors, or `weights`) to `dst` as a block-FP8 checkpoint:
    config with the quantization_config vLLM reads, one safetensors file and the index
    molt/trainer/fp8.py reads."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = fp8_tensors(weights if weights is not None else load_weights(src))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in tensors}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def bias_name(weights: dict[str, torch.Tensor]) -> str:
    [name] = [n for n in weights if n.endswith("e_score_correction_bias")]
    return name


def tiny_deepseek_v3(dst: Path, vocab_size: int = 320) -> Path:
    """A random-init DeepSeek-V3 (layer 0 dense, layer 1 MoE: 16 experts in 4 groups, top-2 of the best 2
    groups, one shared expert) saved in fp32 with the molt.inputs.tiny tokenizer. MLA keeps DeepSeek-V3's
    latent sizes (kv_lora_rank 512, rope 64, nope 128, v 128): the GPU attention kernels are built for
    them."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = build_tokenizer(vocab_size)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=256, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"   # vLLM builds the fp32 bias for these
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).float()
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            # fp32 values that bf16 rounds (its 8 mantissa bits cannot hold 1 + k / 4096)
            n = module.e_score_correction_bias.numel()
            module.e_score_correction_bias.copy_(1.0 + torch.arange(1, n + 1) / 4096)
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst


def _png(seed: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (56, 56), (40 * seed % 256, 200, 120))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_batch(path: str, rows: int = 4) -> dict[str, torch.Tensor]:
    """A training batch for the tiny VLM at `path`: rows 0..rows/2-1 hold one image each, the rest none
    (TrainerRanks gives each data-parallel rank a contiguous half, so rank 1 sees no image). Every
    response token is trained with advantage +-0.5 so the step has a gradient."""
    from molt.inputs.vision import data_url, pixel_inputs, processor
    from molt.trainer import make_batch
    from molt.trainer.batch import add_images
    from molt.trajectory import Segment

    proc = processor(path, True)
    tok = proc.tokenizer
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    segments = []
    for i in range(rows):
        images = [data_url(_png(i))] if i < rows // 2 else []
        count = int(pixel_inputs(proc, images)["image_grid_thw"].prod(-1).sum()) // 4 if images else 0
        prompt = [1, *([start, *[proc.image_token_id] * count, end] if images else []), 40 + i, 41, 42]
        response = [50 + i, 51, 52, 53, 2]
        n = len(prompt) + len(response)
        mask = [0] * len(prompt) + [1] * len(response)
        segments.append(Segment(token_ids=prompt + response, loss_mask=mask,
                                logprobs=[-1.0 * m for m in mask], versions=[0] * n,
                                rollout_id=str(i), group_id="g", images=images))
    advantages = [[0.5 - i % 2] * len(s.token_ids) for i, s in enumerate(segments)]
    batch = make_batch(segments, advantages=advantages)
    add_images(batch, segments, proc)
    return batch


def perturbed_copy(path: Path, new: Path, scale: float) -> Path:
    """Copy the model folder `path` to `new` with every floating tensor moved by `scale` x its standard
    deviation of seeded noise (new weights for a refit that an engine started on `path` must take)."""
    shutil.rmtree(new, ignore_errors=True)
    shutil.copytree(path, new)
    generator = torch.Generator().manual_seed(1)
    for file in sorted(new.glob("*.safetensors")):
        part = {k: v + scale * v.float().std() * torch.randn(v.shape, generator=generator)
                if v.is_floating_point() and v.numel() > 1 else v for k, v in load_file(str(file)).items()}
        save_file(part, str(file), metadata={"format": "pt"})
    return new
