"""Where each role's weights come from, resolved once, in the driver: `model.path`, a reference of its own,
or a tiny model that molt/inputs/tiny.py builds offline (so a trainer rank or an engine only reads a
folder)."""

from __future__ import annotations

import json
from pathlib import Path

from molt.inputs.tiny import tiny_model_path
from molt.spec import RunSpec


def model_path(spec: RunSpec, role: str = "policy") -> str:
    """The checkpoint `role` starts from: the reference may name its own (or a tiny model), every other
    role the policy's; model.path, if local, must be a Hugging Face folder."""
    if role == "reference" and spec.model.reference == "tiny":
        return str(tiny_model_path(**spec.model.reference_tiny))
    if role == "reference" and spec.model.reference not in (None, "policy"):
        return spec.model.reference
    path = spec.model.path
    if path is None:
        return str(tiny_model_path(**spec.model.tiny))
    local = Path(path).expanduser()
    if not local.exists() and not is_hub_id(path):
        raise FileNotFoundError(f"model.path={path}: no such folder (and not a hub id like 'org/name')")
    if (local / "meta.json").exists() and not (local / "config.json").exists():
        raise FileNotFoundError(f"model.path={path} is a Molt checkpoint, not a Hugging Face folder: export "
                                f"it (python -m molt.export {path}) and use {local / 'hf'}")
    return str(local) if local.exists() else path


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hugging Face hub id ('org/name'): a path that starts with /, . or ~, or has
    another number of slashes, is a filesystem path, never a hub id."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1


def is_vlm(spec: RunSpec) -> bool:
    """Whether the policy is a vision-language model, as far as this machine can tell without a download: a
    tiny model with a vision tower, or a checkpoint whose config.json (a local folder, or the hub's cached
    copy) has a vision_config. A hub model not downloaded yet is refused by the trainer when it loads."""
    model = spec.model
    if model.path is None:
        return model.tiny.get("vision_layers", 0) > 0
    config = Path(model.path).expanduser() / "config.json"
    if not config.exists():
        if not is_hub_id(model.path):
            return False
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model.path, "config.json")
        if not isinstance(cached, str):
            return False
        config = Path(cached)
    return "vision_config" in json.loads(config.read_text(encoding="utf-8"))


def check_same_tokenizer(spec: RunSpec) -> None:
    """A reference of its own (a teacher of another size) must read token ids as the policy does: its
    logprobs are taken of the policy's sampled ids, so another vocabulary would compare unrelated tokens."""
    from transformers import AutoTokenizer

    policy, reference = model_path(spec, "policy"), model_path(spec, "reference")
    if policy == reference:
        return
    trust = spec.model.trust_remote_code
    if (AutoTokenizer.from_pretrained(policy, trust_remote_code=trust).get_vocab()
            != AutoTokenizer.from_pretrained(reference, trust_remote_code=trust).get_vocab()):
        raise ValueError(f"model.reference={spec.model.reference} ({reference}) has another tokenizer than "
                         f"the policy ({policy}); a reference or teacher must share the policy's vocabulary")
