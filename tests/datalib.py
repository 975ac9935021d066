"""Local copies of Hugging Face datasets in the hub's layout (parquet shards named `SPLIT-00000-of-00001`
under the config's folder, or `data/`), with the columns of the real datasets the shipped recipes name, so
`datasets.load_dataset` reads them exactly as it reads a downloaded hub repository, without a download."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from molt.spec import HubDataset, RunSpec


def png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="PNG")
    return out.getvalue()


def write_hub_layout(root: Path, splits: dict[str, list[dict[str, Any]]], config: str | None = None,
                     image_column: str | None = None) -> Path:
    """`root` holding one parquet shard per split, in `config/` (with a README declaring every config
    written so far, as GSM8K's does) or `data/`; `image_column` is stored as datasets' list-of-images
    feature."""
    import datasets

    folder = root / (config or "data")
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        table = datasets.Dataset.from_list(rows)
        if image_column:
            table = table.cast_column(image_column, datasets.List(datasets.Image()))
        table.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    if config:
        lines = ["---", "configs:"]
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "data"):
            lines += [f"- config_name: {folder.name}", "  data_files:"]
            for shard in sorted(folder.glob("*.parquet")):
                lines += [f"  - split: {shard.name.split('-')[0]}", f"    path: {folder.name}/{shard.name}"]
        (root / "README.md").write_text("\n".join([*lines, "---", ""]))
    return root


# The columns of the hub datasets the shipped recipes name (as their hub pages show them), two rows each.
RECIPE_DATASETS: dict[str, dict[str, Any]] = {
    "DigitalLearningGmbH/MATH-lighteval": {"rows": [
        {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra",
         "solution": "It is $\\boxed{2}$."},
        {"problem": "Half of 1?", "level": "Level 1", "type": "Algebra", "solution": "$\\boxed{\\frac12}$"}]},
    "HuggingFaceH4/MATH-500": {"rows": [
        {"problem": "What is $2+2$?", "solution": "$\\boxed{4}$", "answer": "4", "subject": "Algebra",
         "level": 1, "unique_id": "test/algebra/1.json"}]},
    "openai/gsm8k": {"config": "main", "rows": [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"}]},
    "hiyouga/geometry3k": {"image_column": "images", "rows": [
        {"images": [png((255, 0, 0))], "problem": "<image>Find x.", "answer": "2\\sqrt{3}"}]},
}


def with_local_hub(spec: RunSpec, root: Path) -> RunSpec:
    """`spec` with each hub dataset of `data` replaced by a local copy in the hub's layout
    (RECIPE_DATASETS)."""
    def local(source: str | HubDataset) -> str | HubDataset:
        if isinstance(source, str):
            return source
        known = RECIPE_DATASETS[source.hub]
        split = source.split.split("[")[0]
        folder = write_hub_layout(root / source.hub.replace("/", "__"), {split: known["rows"]},
                                  known.get("config"), known.get("image_column"))
        return source.model_copy(update={"hub": str(folder)})

    data = spec.data.model_copy(update={"train_path": local(spec.data.train_path),
                                        "eval": [local(s) for s in spec.data.eval]})
    return spec.model_copy(update={"data": data})
