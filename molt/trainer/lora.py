"""LoRA on the policy (`model.lora.rank > 0`): NeMo AutoModel's adapters, and what refit and export read.

`apply_lora` swaps the linear layers that `model.lora.target_modules` names for AutoModel's LinearLoRA
before the model is sharded: the base weight stays where it was and is frozen, `lora_A` / `lora_B` are
the only trainable parameters (so the only ones the optimizer holds), and B starts at 0, so the adapted
model starts as the base model. A refit ships only the adapter, in PEFT's names (what vLLM's LoRA loader
reads); an export folds it into the base weights, W + alpha / rank * B @ A, so the folder stands alone.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from molt.spec import RunSpec

PEFT_PREFIX = "base_model.model."      # PEFT's adapter files name parameters under this prefix
ADAPTER_PARTS = (".lora_A.", ".lora_B.")
# vLLM serves adapters on linear layers only; output head and embeddings would need their own kernels
UNSERVED = ("lm_head", "embed_tokens")


def is_adapter(name: str) -> bool:
    """Whether the parameter `name` belongs to a LoRA adapter (lora_A / lora_B of an adapted layer)."""
    return any(part in name for part in ADAPTER_PARTS)


def peft_config(spec: RunSpec) -> Any:
    """AutoModel's `PeftConfig` for `spec.model.lora` (torch matmuls: the Triton kernels need a GPU)."""
    from nemo_automodel.components._peft.lora import PeftConfig

    lora = spec.model.lora
    return PeftConfig(target_modules=list(lora.target_modules), dim=lora.rank, alpha=lora.alpha,
                      dropout=lora.dropout, dropout_position="pre", use_triton=False)


def apply_lora(model: nn.Module, spec: RunSpec) -> None:
    """Adapters on the layers `model.lora.target_modules` names; everything else frozen."""
    from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules

    apply_lora_to_linear_modules(model, peft_config(spec))
    check_adapted(model, spec)


def check_adapted(model: nn.Module, spec: RunSpec) -> None:
    """The adapted layers exist and are ones the engines can serve: as an adapter (model.lora.refit=adapter)
    or folded into full weights (merged)."""
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    patterns = spec.model.lora.target_modules
    if not adapted:
        raise ValueError(f"model.lora.target_modules={patterns} matched no linear layer of the model "
                         "(patterns match whole module names, e.g. '*_proj' or '*.q_proj')")
    unserved = [name for name in adapted if name.rsplit(".", 1)[-1] in UNSERVED]
    if unserved and spec.model.lora.served_as_adapter():
        raise ValueError(f"model.lora.target_modules={patterns} adapts {unserved[0]}: vLLM serves adapters "
                         "on the model's inner linear layers only; leave the output head and embeddings out "
                         "(or set model.lora.refit=merged)")
    # The output head's weight tied to the input embeddings is one tensor: an adapter on the head alone
    # changes the logits but has nowhere to be folded (the engines tie the two again).
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    head = model.get_output_embeddings()
    if tied and head is not None and hasattr(head, "lora_A"):
        raise ValueError(f"model.lora.target_modules={patterns} adapts the output head, whose weight is "
                         "tied to the input embeddings (tie_word_embeddings): an adapter on it cannot be "
                         "folded into the weights the engines hold; leave lm_head out")
    if any(p.requires_grad for n, p in model.named_parameters() if not is_adapter(n)):
        raise RuntimeError("LoRA: a base parameter is still trainable")
