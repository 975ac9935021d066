"""Build tiny Qwen3 / Qwen2.5-VL models and a byte-level BPE tokenizer offline.

Nothing can be downloaded at run time, so the default experiment, the tests and the benchmarks run on
random-init models that this module writes with `save_pretrained`. The folder is an ordinary Hugging
Face checkpoint: vLLM, transformers and AutoModel load it exactly as they would load a real model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# ChatML with Hermes-style tool calls, so vLLM's stock `hermes` tool parser reads what the model writes.
CHAT_TEMPLATE = (
    # content: a string, or a list of parts (text, and images as vision placeholders for a VLM)
    "{%- macro render_content(content) %}{% if content is string or content is none %}{{ content or '' }}"
    "{% else %}{% for part in content %}{% if part.type == 'text' %}{{ part.text }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n{{ render_content(message.content) }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ render_content(message.content) }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": \"{{ fn.name }}\", \"arguments\": "
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>"
    "{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<think>", "</think>"]
# A VLM's tokenizer adds these after the text vocabulary (so a text model's ids stay as they are).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

DEFAULTS: dict[str, Any] = dict(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
    vocab_size=320, max_position_embeddings=2048, num_experts=0, num_experts_per_tok=2,
    moe_intermediate_size=64, tie_word_embeddings=1, seed=0, vision_layers=0,
)
# The vision tower of a tiny VLM (vision_layers > 0): 14-pixel patches merged 2x2 into one LM token.
VISION = dict(hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, window_size=56, in_channels=3)
# Images are resized to between 4 and 16 merged 28x28 tiles: 4-16 placeholder tokens per image.
IMAGE_PIXELS = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}


def _corpus() -> list[str]:
    # Words the tiny tasks and chat templates use, so merges make them short; deterministic.
    words = ["user", "assistant", "system", "tool", "repeat", "letter", "answer", "the", "calculator",
             "result", "name", "arguments", "What is", "Call", "tools", "expression"]
    letters = [c * k for c in "abcdefghijklmnopqrstuvwxyz" for k in (1, 2, 4)]
    digits = [str(i) for i in range(100)]
    return [" ".join(words)] * 50 + [" ".join(letters)] * 10 + [" ".join(digits)] * 10


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_config(opts: dict[str, Any], vocab_size: int):
    """Qwen3 (dense) or Qwen3-MoE config for the given sizes."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=opts["hidden_size"], num_hidden_layers=opts["num_layers"],
        num_attention_heads=opts["num_heads"], num_key_value_heads=opts["num_kv_heads"],
        head_dim=opts["head_dim"], intermediate_size=opts["intermediate_size"],
        max_position_embeddings=opts["max_position_embeddings"],
        tie_word_embeddings=bool(opts["tie_word_embeddings"]),
        bos_token_id=0, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )
    if opts["num_experts"]:
        return Qwen3MoeConfig(**common, num_experts=opts["num_experts"],
                              num_experts_per_tok=opts["num_experts_per_tok"],
                              moe_intermediate_size=opts["moe_intermediate_size"], norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3Config(**common)


def build_vl_config(opts: dict[str, Any], tokenizer: Any):
    """Qwen2.5-VL config: the Qwen2 language model of `opts` under a `vision_layers`-block vision tower."""
    from transformers import Qwen2_5_VLConfig

    if opts["num_experts"]:
        raise ValueError("tiny model: vision_layers > 0 builds a dense Qwen2.5-VL; set num_experts=0")
    # multimodal rotary sections (temporal, height, width) split the head's rotary half: 1/4, 3/8, 3/8
    half = opts["head_dim"] // 2
    sections = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    vision_start, vision_end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=opts["hidden_size"], num_hidden_layers=opts["num_layers"],
        num_attention_heads=opts["num_heads"], num_key_value_heads=opts["num_kv_heads"],
        intermediate_size=opts["intermediate_size"], max_position_embeddings=opts["max_position_embeddings"],
        rope_scaling={"rope_type": "default", "type": "mrope", "mrope_section": sections},
        bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    if opts["hidden_size"] != opts["num_heads"] * opts["head_dim"]:
        raise ValueError("tiny VLM: Qwen2.5-VL needs hidden_size == num_heads * head_dim")
    vision = dict(VISION, depth=opts["vision_layers"], out_hidden_size=opts["hidden_size"],
                  fullatt_block_indexes=[opts["vision_layers"] - 1])
    # Untied output head: vLLM's transformers backend and the refit treat a VLM's head as its own weight.
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=vision_start,
                            vision_end_token_id=vision_end, image_token_id=image, video_token_id=video,
                            tie_word_embeddings=False, torch_dtype="float32")


def _save_processor(folder: Path, tokenizer: Any) -> None:
    """The VLM's processor (PIL image backend), its class file and the auto-class entry that finds it."""
    import sys

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from molt.inputs import tiny_vl_processor

    images = Qwen2VLImageProcessorPil(size=IMAGE_PIXELS)
    processor = tiny_vl_processor.TinyVLProcessor(images, tokenizer, chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    shutil.copy(sys.modules[tiny_vl_processor.__name__].__file__, folder / "tiny_vl_processor.py")
    config_file = folder / "processor_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config["auto_map"] = {"AutoProcessor": "tiny_vl_processor.TinyVLProcessor"}
    config_file.write_text(json.dumps(config, indent=1))


def build_tiny(path: str | os.PathLike, **overrides: Any) -> Path:
    """Write a random-init model + tokenizer (+ processor for a VLM) to `path` (atomically: a temp dir,
    then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    opts = {**DEFAULTS, **overrides}
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny-model option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    path = Path(path)
    tokenizer = build_tokenizer(opts["vocab_size"])
    vision = opts["vision_layers"] > 0
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    config = build_vl_config(opts, tokenizer) if vision else build_model_config(opts, len(tokenizer))
    torch.manual_seed(opts["seed"])
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if vision:
        _save_processor(tmp, tokenizer)
    (tmp / "molt_tiny.json").write_text(json.dumps(opts, indent=1))
    try:
        tmp.rename(path)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt"))


def tiny_model_path(**overrides: Any) -> Path:
    """Path of the cached tiny model with these options, built on first use."""
    opts = {**DEFAULTS, **overrides}
    digest = hashlib.sha1(json.dumps(opts, sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir() / "models" / f"tiny-{digest}"
    if not (path / "config.json").exists():
        build_tiny(path, **overrides)
    return path
