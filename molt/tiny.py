"""Build tiny Qwen3 models and a byte-level BPE tokenizer offline.

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
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
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

DEFAULTS: dict[str, Any] = dict(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
    vocab_size=320, max_position_embeddings=2048, num_experts=0, num_experts_per_tok=2,
    moe_intermediate_size=64, tie_word_embeddings=1, seed=0,
)


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


def build_tiny(path: str | os.PathLike, **overrides: Any) -> Path:
    """Write a random-init model + tokenizer to `path` (atomically: a temp dir, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM

    opts = {**DEFAULTS, **overrides}
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown tiny-model option(s) {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    path = Path(path)
    tokenizer = build_tokenizer(opts["vocab_size"])
    config = build_model_config(opts, len(tokenizer))
    torch.manual_seed(opts["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
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
