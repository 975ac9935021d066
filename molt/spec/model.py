"""The `model` section of the run spec: which weights the policy (and its reference) start from, and
LoRA."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from pydantic import Field, field_validator

from molt.spec.strict import Strict


@dataclass(frozen=True)
class Arch:
    """The keys of `model.arch`: the architecture numbers a memory estimate needs (molt/plan/arch.py reads
    them from a config.json or the tiny model's options), named like tiny-model options (HF config keys in
    molt.plan.arch.HF_KEYS). MLA attention (DeepSeek) when kv_lora_rank > 0; MoE when num_experts > 0."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    weight_bits: int = 0          # a quantized checkpoint's bits per weight (FP8: 8), served so by vLLM
    vision_layers: int = 0
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0


ARCH_KEYS = [f.name for f in fields(Arch)]


class LoRASpec(Strict):
    rank: int = Field(
        0, ge=0, le=512, description="LoRA adapter rank: > 0 trains adapters on the frozen policy and refits "
                                     "only them into the engines; 0 = full fine-tuning")
    alpha: float = Field(16.0, gt=0, description="adapter scale numerator: a layer adds alpha / rank * B @ A")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter's input in training (the engine has none)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["*_proj"], min_length=1,
        description="linear layers that get adapters: module-name patterns ('*' wildcards; '*_proj' = the "
                    "attention and MLP projections of Qwen / Llama models)")
    refit: Literal["adapter", "merged"] = Field(
        "adapter", description="what the engines get: adapter = vLLM's LoRA serving loads each new adapter "
        "(only it is sent; inner linear layers of dense text models only); merged = the adapter folded "
        "into the full weights, sent whole like full fine-tuning (any target, also the output head)")

    def served_as_adapter(self) -> bool:
        """Whether the engines serve adapters (vLLM's LoRA), rather than full weights."""
        return self.rank > 0 and self.refit == "adapter"

class ModelSpec(Strict):
    path: str | None = Field(None, description="Hugging Face folder or hub id; null builds the tiny model")
    tiny: dict[str, int] = Field(
        default_factory=lambda: dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                     vocab_size=320),
        description="molt.inputs.tiny options (sizes, experts, seed; the rest: molt.inputs.tiny's defaults)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype of engines and trainer (master weights stay float32; CPU: "
        "the trainer under CPU autocast); float16 is refused: the trainer has no loss scaling")
    max_model_len: int = Field(256, ge=2, description="context length in tokens: the prompt plus every turn")
    reference: str | None = Field(
        None, description="frozen reference / teacher model (any size, the policy's tokenizer); 'policy' = "
        "a frozen copy of the start; 'tiny' = built offline from reference_tiny")
    reference_tiny: dict[str, int] = Field(
        default_factory=dict, description="tiny-model options of the reference when reference=tiny (e.g. a "
        "larger teacher to distill from)")
    critic: bool = Field(False, description="train a value model beside the policy, for an estimator "
                         "that reads its values (needs_critic: gae, or a plugin's; refused for the others)")
    router_replay: bool = Field(False, description="MoE: replay the engine's routed experts in training")
    freeze_router: bool = Field(False, description="MoE: do not train the router weights")
    freeze_vision: bool = Field(False, description="VLM: train the language model only, not the vision tower")
    trust_remote_code: bool = Field(False, description="run the model repository's own Python code")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="variables of the chat template wherever Molt renders it (agent "
        "prompts and turns, chat sessions, SFT rows); e.g. Qwen3's {enable_thinking: false}")
    lora: LoRASpec = Field(default_factory=LoRASpec, description="LoRA adapters instead of full fine-tuning")
    arch: dict[str, int] = Field(
        default_factory=dict, description="architecture numbers of a hub model for the memory estimate "
        "(molt.spec.model.Arch: hidden_size, num_layers, ...; from its config.json); a local folder's "
        "config.json and the tiny model's options are read instead")

    @field_validator("arch")
    @classmethod
    def _arch_keys(cls, value: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(value) - set(ARCH_KEYS))
        if unknown:
            raise ValueError(f"model.arch.{unknown[0]}: unknown; the keys are {', '.join(ARCH_KEYS)}")
        missing = [f for f in ARCH_KEYS[:7] if value and f not in value]
        if missing:
            raise ValueError(f"model.arch needs {', '.join(missing)} (from the model's config.json)")
        return value
