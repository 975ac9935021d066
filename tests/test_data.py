"""Prompt datasets: JSONL and Parquet rows, row validation, path resolution, resumable iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from molt.inputs.data import PromptDataset, PromptIterator, load_eval_sets, resolve_path
from molt.spec import DataSpec
from molt.spec.user_modules import REPO_ROOT

DATA = DataSpec()
ROWS = [
    {"prompt": "repeat a", "label": "a"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
     "label": 4},
    {"prompt": "no label", "label": None},
]


def write_jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def test_jsonl_prompt_and_messages_rows(tmp_path: Path) -> None:
    rows = [*ROWS, {"prompt": "with extras", "messages": None, "label": 1, "tools": ["calc"]}]
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows, ("\n",)), DATA)  # a blank line is ignored
    # rows come back as given (extra keys kept for the agent), minus a null prompt form
    assert list(ds) == [*ROWS, {"prompt": "with extras", "label": 1, "tools": ["calc"]}]


def test_custom_keys(tmp_path: Path) -> None:
    rows = [{"q": "x", "answer": 1}, {"chat": [{"role": "user", "content": "y"}], "answer": 2}]
    data = DataSpec(prompt_key="q", messages_key="chat", label_key="answer")
    assert list(PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows), data)) == rows
    with pytest.raises(ValueError, match="missing label key 'answer'"):
        PromptDataset(write_jsonl(tmp_path / "e.jsonl", ROWS), data)


def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    # In Parquet every row has every column, and every message every struct field: nulls are dropped.
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
            {"role": "user", "content": "hi"}]
    rows = [{"prompt": "p0", "messages": None, "label": "x"},
            {"prompt": None, "messages": msgs, "label": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    expected = [{"prompt": "p0", "label": "x"}, {"messages": msgs, "label": None}]
    assert list(PromptDataset(tmp_path / "d.parquet", DATA)) == expected
    assert list(PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows), DATA)) == expected


@pytest.mark.parametrize("bad, why", [
    ("{not json", "Expecting property name"),
    ('["a list"]', "expected an object"),
    ('{"prompt": "p"}', "missing label key 'label'"),
    ('{"label": 1}', "needs 'messages'"),
    ('{"messages": [{"content": "no role"}], "label": 1}', "non-empty list"),
    ('{"prompt": 3, "label": 1}', "needs 'messages'"),
])
def test_malformed_jsonl_row_names_file_and_line(tmp_path: Path, bad: str, why: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], (bad + "\n",))
    with pytest.raises(ValueError) as err:
        PromptDataset(path, DATA)
    assert f"{path}:3: malformed row" in str(err.value)
    assert why in str(err.value)


def test_malformed_parquet_row_names_row(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok", "label": 1}, {"prompt": None, "label": 2}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: malformed row: needs 'messages'"):
        PromptDataset(tmp_path / "bad.parquet", DATA)


def test_missing_empty_and_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="dataset file not found: 'nope/x.jsonl'"):
        PromptDataset("nope/x.jsonl", DATA)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        PromptDataset(tmp_path / "empty.jsonl", DATA)
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match="unsupported dataset format '.csv'"):
        PromptDataset(tmp_path / "d.csv", DATA)


def test_relative_paths_resolve_cwd_then_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "here.jsonl", ROWS)
    assert resolve_path("here.jsonl") == tmp_path / "here.jsonl"
    # pyproject.toml exists only at the repository root, not in the (temporary) current directory
    assert resolve_path("pyproject.toml") == REPO_ROOT / "pyproject.toml"
    assert (REPO_ROOT / "molt" / "inputs" / "data.py").is_file()


def test_load_eval_sets_are_named_by_file_stem(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm.jsonl", ROWS)
    other = write_jsonl(tmp_path / "other.jsonl", ROWS[:1])
    assert load_eval_sets(DataSpec(eval=[])) == {}
    sets = load_eval_sets(DataSpec(eval=[str(path), str(other)]))
    assert list(sets) == ["gsm", "other"] and [p["label"] for p in sets["gsm"]] == ["a", 4, None]
    with pytest.raises(ValueError, match=r"eval sets named \['gsm'\] more than once"):
        DataSpec(eval=[str(path), str(tmp_path / "sub" / "gsm.jsonl")])


def make_dataset(tmp_path: Path, n: int) -> PromptDataset:
    rows = [{"prompt": str(i), "label": i} for i in range(n)]
    return PromptDataset(write_jsonl(tmp_path / "n.jsonl", rows), DATA)


def test_epochs_are_seeded_permutations(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 10)
    labels = [p["label"] for p in PromptIterator(ds, seed=3).take(30)]
    epochs = [labels[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)   # every item exactly once per epoch
    assert len({tuple(e) for e in epochs}) == 3                 # reshuffled each epoch
    assert labels == [p["label"] for p in PromptIterator(ds, seed=3).take(30)]   # same seed, same order
    assert labels != [p["label"] for p in PromptIterator(ds, seed=4).take(30)]
    assert labels != [p["label"] for p in PromptIterator(ds, seed=-3).take(30)]
    unshuffled = PromptIterator(ds, shuffle=False)
    assert [p["label"] for p in unshuffled.take(12)] == list(range(10)) + [0, 1]
    next(unshuffled)["label"] = "edited by an agent"     # items are copies: the dataset is unchanged
    assert ds[2]["label"] == 2


def test_resume_continues_exactly_across_an_epoch_boundary(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 7)
    reference = PromptIterator(ds, seed=11)
    expected = [p["label"] for p in reference.take(25)]

    first = PromptIterator(ds, seed=11)
    head = [p["label"] for p in first.take(5)]
    state = json.loads(json.dumps(first.state_dict()))    # as a checkpoint stores it
    assert state == {"epoch": 0, "index": 5, "seed": 11}

    resumed = PromptIterator(ds, seed=0)                  # the seed comes from the state
    resumed.load_state_dict(state)
    tail = [p["label"] for p in resumed.take(20)]            # crosses into epochs 1, 2 and 3
    assert head + tail == expected
    assert resumed.state_dict() == {"epoch": 3, "index": 4, "seed": 11} == reference.state_dict()
