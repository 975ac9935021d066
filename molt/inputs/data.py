"""Prompt datasets: JSONL or Parquet rows (or a Hugging Face dataset: molt/inputs/data_hub.py), and a seeded,
resumable epoch iterator over them.

A row holds either chat-format messages (`data.messages_key`) or a prompt string (`data.prompt_key`),
plus a label (`data.label_key`, may be null); other keys are the agent's (tool specs, test cases).
Items are the row dicts themselves, as both agent kinds take them (`molt.agents` reads messages and
label with the same keys); their messages may hold images (molt.inputs.vision). Rows are checked once at load
time, so a bad row fails before any engine starts, naming its file and line.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from molt.inputs.data_hub import describe, hub_rows, without_null_fields
from molt.inputs.vision import normalize
from molt.spec import DataSpec, HubDataset, eval_names
from molt.spec.user_modules import candidate_paths


def resolve_path(path: str | Path) -> Path:
    """An absolute path as is; a relative one against the current directory, then the repository root."""
    candidates = candidate_paths(path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    folders = [c for c in candidates if c.is_dir()]
    if folders:
        raise IsADirectoryError(f"dataset '{path}' is a folder ({folders[0]}), not a .jsonl or .parquet file")
    raise FileNotFoundError(f"dataset file not found: '{path}' (looked at {', '.join(map(str, candidates))})")


def _check_row(row: Any, data: DataSpec, base_dir: Path | None = None) -> dict[str, Any]:
    """The checked row; raises ValueError saying what is wrong (the caller adds file and line).

    Image parts of messages (a path relative to `base_dir`, bytes, or a data URL; molt.inputs.vision) become
    {"type": "image", "image": <data URL>}, each decoded once here.

    Messages win over a prompt string when a row has both (as in `molt.agents`). A null messages /
    prompt field is dropped, so a Parquet row (every column present, unused ones
    null) reads the same as the JSONL row that simply lacks the key.
    """
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    if data.label_key not in row:
        raise ValueError(f"missing label key '{data.label_key}' (use null for no label); "
                         f"keys present: {sorted(row)}")
    row = {k: v for k, v in row.items() if not (k in (data.messages_key, data.prompt_key) and v is None)}
    messages = row.get(data.messages_key)
    if messages is not None:
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages)):
            raise ValueError(f"'{data.messages_key}' must be a non-empty list of "
                             "{role: str, content: ...} messages")
        row[data.messages_key] = normalize(messages, base_dir)[0]
        return row
    if isinstance(row.get(data.prompt_key), str):
        return row
    raise ValueError(f"needs '{data.messages_key}' (chat messages) or '{data.prompt_key}' (a string); "
                     f"keys present: {sorted(row)}")


def read_rows(source: str | Path | HubDataset, check: Callable[[Any], dict[str, Any]],
              data: DataSpec) -> list[dict[str, Any]]:
    """Every row of a JSONL or Parquet file, or of a hub dataset, through `check` (which raises ValueError on
    a bad row; the error then names the file and line, or row); a source without rows is an error too."""
    return [row for row, _ in placed_rows(source, check, data)]


def placed_rows(source: str | Path | HubDataset, check: Callable[[Any], dict[str, Any]],
                data: DataSpec) -> list[tuple[dict[str, Any], str]]:
    """`read_rows`, each row with where it is ("FILE:LINE", "FILE: row N", "hub dataset ...: row N")."""
    if isinstance(source, HubDataset):
        return _checked(describe(source), [(f": row {i}", row) for i, row in
                                           enumerate(hub_rows(source, data))], check)
    path = resolve_path(source)
    suffix = path.suffix.lower()
    rows: list[tuple[str, Any]] = []
    messages_key = data.messages_key
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        rows.append((f":{line_no}", json.loads(line)))
                    except ValueError as err:
                        raise ValueError(f"{path}:{line_no}: malformed row: {err}") from None
    elif suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        rows = [(f": row {row_no}", without_null_fields(row, messages_key))
                for row_no, row in enumerate(pq.read_table(path).to_pylist())]
    else:
        raise ValueError(f"{path}: unsupported dataset format '{suffix}' (use .jsonl or .parquet)")
    return _checked(str(path), rows, check)


def _checked(name: str, rows: list[tuple[str, Any]], check: Callable[[Any], dict[str, Any]]
             ) -> list[tuple[dict[str, Any], str]]:
    if not rows:
        raise ValueError(f"{name}: dataset has no rows")
    items = []
    for where, row in rows:
        try:
            items.append((check(row), f"{name}{where}"))
        except ValueError as err:  # json.JSONDecodeError is a ValueError too
            raise ValueError(f"{name}{where}: malformed row: {err}") from None
    return items


class PromptDataset:
    """All rows of one JSONL or Parquet file (or hub dataset), validated, in file order."""

    def __init__(self, source: str | Path | HubDataset, data: DataSpec) -> None:
        source = source if isinstance(source, HubDataset) else resolve_path(source)
        base = None if isinstance(source, HubDataset) else source.parent   # image paths: relative to the file
        placed = placed_rows(source, lambda row: _check_row(row, data, base), data)
        self.items = [row for row, _ in placed]
        self.places = [where for _, where in placed]   # each row's file and line, for messages

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.items)


def load_eval_sets(data: DataSpec) -> dict[str, PromptDataset]:
    """The eval sets of `data.eval`, by name (a file's stem, a hub dataset's name), in config order."""
    return {name: PromptDataset(path, data)
            for name, path in zip(eval_names(data.eval), data.eval, strict=True)}


class PromptIterator:
    """Endless epochs over a dataset; each epoch's order is a function of (seed, epoch) only.

    So the position is just (epoch, index): a resumed run rebuilds the same permutation and continues
    with exactly the item it would have produced next, across epoch boundaries too.
    """

    def __init__(self, dataset: PromptDataset, seed: int = 0, shuffle: bool = True) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        # numpy seeds must be non-negative; mod 2**64 keeps negative run seeds distinct
        return np.random.default_rng([self.seed % 2**64, self.epoch]).permutation(n).tolist()

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation()
        item = self.dataset[self._order[self.index]]
        self.index += 1
        return copy.deepcopy(item)  # an agent that edits its row must not change later epochs

    def take(self, n: int) -> list[dict[str, Any]]:
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        self._order = self._permutation()
