"""A model's architecture numbers and parameter counts, from the spec alone (no weights loaded).

The numbers come from a local folder's config.json, the tiny model's options (molt/inputs/tiny.py), or
`model.arch` (conf/model/*.yaml, copied from the hub model's public config.json, since a hub model's config
is not on disk before its first download). molt/plan/memory.py sizes every role's device memory from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from molt.spec.model import ARCH_KEYS, Arch

if TYPE_CHECKING:
    from molt.spec import RunSpec


HF_KEYS = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "num_key_value_heads": "num_kv_heads", "n_routed_experts": "num_experts",
           "num_local_experts": "num_experts",
           "n_shared_experts": "num_shared_experts", "first_k_dense_replace": "first_dense_layers",
           "num_nextn_predict_layers": "mtp_layers"}


def arch_from_config(config: dict) -> Arch:
    """`Arch` of a Hugging Face config.json (a VLM's text_config and vision_config included)."""
    text = {**config, **config.get("text_config", {})}
    out = {HF_KEYS.get(k, k): int(v) for k, v in text.items()
           if HF_KEYS.get(k, k) in ARCH_KEYS and isinstance(v, (int, bool)) and v is not None}
    out.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
    out.setdefault("num_kv_heads", out["num_heads"])
    vision = config.get("vision_config") or {}
    if vision:
        out.update(vision_layers=vision.get("depth", 0), vision_hidden_size=vision.get("hidden_size", 0),
                   vision_intermediate_size=vision.get("intermediate_size", 0))
    if (config.get("quantization_config") or {}).get("fmt", "").startswith("e4m3"):
        out["weight_bits"] = 8
    return Arch(**out)


def arch_of(spec: RunSpec, role: str = "policy") -> Arch | None:
    """The architecture of `role`'s model (policy, reference, critic, judge); None when nothing on disk or
    in the spec says (a hub id without `model.arch`)."""
    from molt.inputs.tiny import DEFAULTS, VISION, VISION_TOKENS

    model = spec.model
    if role == "reference" and model.reference == "tiny":
        tiny = {**DEFAULTS, **model.reference_tiny}
    elif role == "reference" and model.reference not in (None, "policy"):
        return _from_folder(model.reference)
    elif role == "judge" and spec.agent.judge.path not in (None, "policy"):
        return _from_folder(spec.agent.judge.path)
    elif model.path is not None:
        return _from_folder(model.path) or (Arch(**model.arch) if model.arch else None)
    else:
        tiny = {**DEFAULTS, **model.tiny}
    if not tiny["num_experts"]:   # the tiny model's MoE options act only with experts (as in its config)
        tiny = {**tiny, "num_experts_per_tok": 0, "moe_intermediate_size": 0}
    vision = {}
    if tiny["vision_layers"]:   # molt.inputs.tiny's VLM: its vision tower, untied, 4 vision tokens more
        vision = dict(vision_hidden_size=VISION["hidden_size"],
                      vision_intermediate_size=VISION["intermediate_size"])
        tiny = {**tiny, "tie_word_embeddings": 0, "vocab_size": tiny["vocab_size"] + len(VISION_TOKENS)}
    return Arch(**{k: v for k, v in tiny.items() if k in ARCH_KEYS}, **vision)


def _from_folder(path: str) -> Arch | None:
    config = Path(path).expanduser() / "config.json"
    return arch_from_config(json.loads(config.read_text())) if config.exists() else None


def _attention_params(a: Arch) -> int:
    h = a.hidden_size
    if a.kv_lora_rank:   # MLA: low-rank queries and a shared compressed key/value, expanded per head
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = h * a.q_lora_rank + a.q_lora_rank * a.num_heads * qk if a.q_lora_rank else h * a.num_heads * qk
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * a.num_heads * (
            a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + a.num_heads * a.v_head_dim * h
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return 2 * h * q + 2 * h * kv


def expert_params(a: Arch) -> int:
    """Routed-expert parameters of one MoE layer (what expert parallelism shards)."""
    return a.num_experts * 3 * a.hidden_size * a.moe_intermediate_size


def moe_layers(a: Arch) -> int:
    return a.num_layers - a.first_dense_layers if a.num_experts else 0


def layer_params(a: Arch, moe: bool) -> int:
    """One decoder layer: attention, MLP (dense, or router + routed + shared experts), two norms."""
    h = a.hidden_size
    mlp = (expert_params(a) + a.num_experts * h + a.num_shared_experts * 3 * h * a.moe_intermediate_size
           if moe else 3 * h * a.intermediate_size)
    return _attention_params(a) + mlp + 2 * h


def vision_params(a: Arch) -> int:
    """A Qwen2.5-VL tower: blocks of attention and a SwiGLU MLP, the patch embedding, the 2x2 merger."""
    vh = a.vision_hidden_size
    merger = (4 * vh) ** 2 + 4 * vh * a.hidden_size
    return a.vision_layers * (4 * vh * vh + 3 * vh * a.vision_intermediate_size) + 1176 * vh + merger \
        if a.vision_layers else 0


def param_count(a: Arch, mtp: bool = False) -> tuple[int, int]:
    """(all parameters, routed-expert parameters); `mtp` adds the multi-token-prediction layers."""
    moe = moe_layers(a) + (a.mtp_layers if mtp else 0)
    dense = a.num_layers - moe_layers(a)
    embed = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    total = (dense * layer_params(a, False) + moe * layer_params(a, bool(a.num_experts))
             + embed + a.hidden_size + vision_params(a))
    return total, moe * expert_params(a)
