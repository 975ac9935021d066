"""Where each role's weights come from, resolved once, in the driver: `model.path`, a reference of its own,
or a tiny model that molt/inputs/tiny.py builds offline (so a trainer rank or an engine only reads a
folder)."""

from __future__ import annotations

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
    if not local.exists() and (path.startswith(("/", ".", "~")) or path.count("/") != 1):
        raise FileNotFoundError(f"model.path={path}: no such folder (and not a hub id like 'org/name')")
    if (local / "meta.json").exists() and not (local / "config.json").exists():
        raise FileNotFoundError(f"model.path={path} is a Molt checkpoint, not a Hugging Face folder: export "
                                f"it (python -m molt.export {path}) and use {local / 'hf'}")
    return str(local) if local.exists() else path


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
