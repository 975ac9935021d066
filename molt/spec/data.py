"""The `data` section of the run spec: training and eval sets (files or Hugging Face datasets), and the
names their metrics carry."""

from __future__ import annotations

from pathlib import PurePath
from typing import Literal

from pydantic import Field, field_validator, model_validator

from molt.spec.strict import Strict


class HubDataset(Strict):
    """A Hugging Face dataset in place of a data file (molt/inputs/data_hub.py: datasets.load_dataset)."""
    hub: str = Field(description="hub id (openai/gsm8k), or a local folder in the hub's layout")
    config: str | None = Field(None, description="the dataset's configuration (subset), e.g. main")
    split: str = Field("train", description="split, e.g. train, test, train[:1000]")
    fields: dict[Literal["prompt", "messages", "label", "images"], str] = Field(
        default_factory=dict, description="Molt field <- the dataset's column (images: an image or a list of "
                                          "them, put before the prompt's text in one user message)")
    transform: str | None = Field(None, description="PATH.py:function or module:function turning a dataset "
                                                    "row into a Molt row (instead of fields)")
    name: str | None = Field(None, description="eval set name (metrics eval/NAME/...); null = the hub id's "
                                               "last part")

    def __str__(self) -> str:   # how the dry-run plan names it
        return f"{self.hub}" + (f" ({self.config})" if self.config else "") + f" [{self.split}]"

    @model_validator(mode="after")
    def _one_mapping(self) -> HubDataset:
        if self.fields and self.transform:
            raise ValueError(f"{self.hub}: set fields or transform, not both (a transform maps whole rows)")
        if self.transform and ":" not in self.transform:
            raise ValueError(f"transform={self.transform!r}: name the function, e.g. "
                             "examples/agents/math_verify.py:gsm8k_row")
        if "images" in self.fields and "prompt" not in self.fields:
            raise ValueError(f"{self.hub}: fields.images needs fields.prompt (the text beside the images)")
        return self

class DataSpec(Strict):
    train_path: str | HubDataset = Field("examples/data/repeat_train.jsonl",
                                         description="training prompts: a jsonl/parquet file or {hub: ...}")
    eval: list[str | HubDataset] = Field(
        default_factory=lambda: ["examples/data/repeat_eval.jsonl"],
        description="eval sets: files (named by file stem) or {hub: ...} (named by name); [] for none")
    prompt_key: str = Field("prompt", description="column holding a prompt string")
    messages_key: str = Field("messages", description="column holding chat messages (wins over prompt_key)")
    label_key: str = Field("label", description="column handed to the agent as the label")
    shuffle: bool = Field(True, description="shuffle the prompts each epoch (seeded by run.seed)")

    @field_validator("eval")
    @classmethod
    def _unique_names(cls, value: list[str | HubDataset]) -> list[str | HubDataset]:
        names = eval_names(value)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # a name is a metric prefix: two sets under one name would overwrite each other's metrics
            raise ValueError(f"eval sets named {twice} more than once (a set is named by its file stem, "
                             "a hub dataset by its name): rename a file or set name")
        return value

def eval_names(sources: list[str | HubDataset]) -> list[str]:
    """The name of each eval set: its file's stem, or a hub dataset's name (metrics are eval/NAME/...)."""
    return [PurePath(s).stem if isinstance(s, str) else s.name or s.hub.rstrip("/").split("/")[-1]
            for s in sources]

def pass_ks(n: int) -> list[int]:
    """The k of each eval/NAME/pass@k an evaluation with rollout.eval.n = n logs: powers of two up to n,
    and n."""
    return sorted({1 << i for i in range(n.bit_length())} | {n})
