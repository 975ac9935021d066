"""A Hugging Face dataset as Molt rows: `data.train_path` / `data.eval` given as {hub, config, split, fields |
transform} (molt.spec.HubDataset), loaded with `datasets.load_dataset`, so its cache and its offline mode
(HF_DATASETS_OFFLINE=1, HF_HOME) apply. The rows then pass the same checks as a file's rows (data.py).

`fields` maps Molt's fields to the dataset's columns; other columns stay in the row for the agent. `images`
(a column holding one image or a list) becomes one user message: the images, then the prompt's text with
the hub's `<image>` placeholders removed (the chat template places each image itself). Images stay the
bytes the dataset stores (read without decoding), so a row carries exactly the dataset's image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from molt.spec import DataSpec, HubDataset

IMAGE_PLACEHOLDER = "<image>"


def without_null_fields(row: Any, messages_key: str) -> Any:
    """An Arrow row (Parquet, a hub dataset) with the null fields of its messages dropped: a struct column
    gives every message every field."""
    messages = row.get(messages_key) if isinstance(row, dict) else None
    if isinstance(messages, list):
        row[messages_key] = [{k: v for k, v in m.items() if v is not None or k == "content"}
                             if isinstance(m, dict) else m for m in messages]
    return row


def describe(source: HubDataset) -> str:
    """How errors name the source: hub id, config and split."""
    config = f" ({source.config})" if source.config else ""
    return f"hub dataset '{source.hub}'{config}[{source.split}]"


def hub_rows(source: HubDataset, data: DataSpec) -> list[dict[str, Any]]:
    """The rows of `source` in Molt's shape (not yet checked: molt.inputs.data.read_rows checks them)."""
    import datasets

    where = describe(source)
    try:
        table = datasets.load_dataset(source.hub, source.config, split=source.split)
    except Exception as err:   # no network and no cache, a wrong id, config or split: say which and how
        raise ValueError(f"{where} could not be loaded with datasets.load_dataset: {type(err).__name__}: "
                         f"{err} "
                         "(without network it must be in datasets' cache: load it once with network, "
                         "then set HF_DATASETS_OFFLINE=1)") from None
    # arrow rows: image columns as the stored {"bytes", "path"}, not decoded PIL images
    rows = table.with_format("arrow")[:].to_pylist()
    if source.transform:
        convert, out = _transform(source.transform), []
        for i, row in enumerate(rows):
            try:
                out.append(convert(row))
            except Exception as err:   # user code: name the row and the function
                raise ValueError(f"{where}: row {i}: transform={source.transform!r} raised "
                                 f"{type(err).__name__}: {err}") from err
        return [without_null_fields(row, data.messages_key) for row in out]
    missing = sorted(set(source.fields.values()) - set(table.column_names))
    if missing:
        raise ValueError(f"{where}: fields name columns {missing} it does not have; its columns: "
                         f"{table.column_names}")
    return [without_null_fields(_mapped(row, source.fields, data), data.messages_key) for row in rows]


def _mapped(row: dict[str, Any], fields: dict[str, str], data: DataSpec) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in fields.values()}
    keys = {"prompt": data.prompt_key, "messages": data.messages_key, "label": data.label_key}
    for field, column in fields.items():
        if field != "images":
            out[keys[field]] = row[column]
    if "images" in fields:
        images = row[fields["images"]]
        images = images if isinstance(images, list) else [images]
        text = str(out.pop(data.prompt_key)).replace(IMAGE_PLACEHOLDER, "").strip()
        parts = [{"type": "image", "image": _image(image)} for image in images]
        out[data.messages_key] = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    return out


def _image(value: Any) -> Any:
    """A stored image ({"bytes", "path"}) as its bytes, else as given (a path or a data URL)."""
    if isinstance(value, dict):
        return value.get("bytes") or value.get("path")
    return value


def _transform(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    from molt.spec.user_modules import import_user_module

    module_name, _, function = name.rpartition(":")
    try:
        return getattr(import_user_module(module_name, "molt_data"), function)
    except Exception as err:   # user code: its import error is the user's to see
        raise ImportError(f"transform={name!r} could not be loaded: {type(err).__name__}: {err}") from err
