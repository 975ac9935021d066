"""BFCL's multi-turn suite as Molt rows with `tools`, from the files the `bfcl-eval` package ships.

    python examples/data/make_bfcl.py OUT_DIR [--categories base,long_context,miss_func,miss_param]
                                              [--eval N] [--train N] [--classes A,B] [--tools all|called]
                                              [--seed S]

writes OUT_DIR/bfcl_multi_turn_CATEGORY_train.jsonl and ..._eval.jsonl per category (eval metrics
eval/bfcl_multi_turn_CATEGORY_eval/...). BFCL's four multi-turn categories hold 200 entries each, and
entry i of every category is a variant of entry i of base (the same question with a long context, a
function or a parameter missing), so the N entries held out for eval (seeded) are the same indices in
every category and no eval question is trained on in any form; --train caps the training rows, and
--classes keeps only the entries whose API classes are all among those named (e.g. TradingBot), and
--tools called offers only the functions an entry's ground truth calls instead of all its classes' (BFCL
offers all: 9 to 40 functions, 12-30k tokens of the tiny model's character-level tokenizer; the CPU twin's
rows are written this way to stay near 2k).

A row: `messages` (the first user turn), `tools` (the functions of the entry's API classes: BFCL's
function docs as OpenAI function schemas, converted as BFCL converts them for OpenAI's API: `dict` ->
`object`, `float` -> `number` with its note, `tuple` -> `array`, `any` -> `string`), `label` (the
ground-truth calls of each user turn, as BFCL writes them) and `bfcl` (the later user turns, the classes,
their initial state, and whether the classes load BFCL's long-context state). examples/agents/bfcl.py runs
them. miss_func: the functions BFCL holds out until a later turn are left out of `tools`, and that turn's
user message shows them as JSON before BFCL's own words ("I have updated some more functions you can
choose from. What about now?"), as BFCL's prompting-mode handlers do; its function-calling handlers
instead add them to the request's tool list, which would re-render the prompt's tool block mid-episode.

Not converted: BFCL's agentic categories. web_search needs the network (SerpAPI and the pages it
fetches); memory needs its prerequisite conversations and, for its vector backend, an embedding model
download and faiss. Neither is part of BFCL's multi-turn score.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from importlib.resources import files
from pathlib import Path
from typing import Any

from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

CATEGORIES = ("base", "long_context", "miss_func", "miss_param")
DATA = files("bfcl_eval") / "data"


def _properties(properties: dict[str, Any]) -> dict[str, Any]:
    """BFCL's parameter types as OpenAPI's, nested arrays and objects too (BFCL's `_cast_to_openai_type`)."""
    for prop in properties.values():
        kind = prop.get("type", "string")
        if kind == "float":
            prop["format"] = "float"
            prop["description"] = prop.get("description", "") + " This is a float type value."
        prop["type"] = GORILLA_TO_OPENAPI.get(kind, "string")
        if "properties" in prop:
            prop["properties"] = _properties(prop["properties"])
        elif isinstance(prop.get("items"), dict) and "type" in prop["items"]:
            prop["items"]["type"] = GORILLA_TO_OPENAPI[prop["items"]["type"]]
            inner = prop["items"]
            if isinstance(inner.get("items"), dict) and "type" in inner["items"]:
                inner["items"]["type"] = GORILLA_TO_OPENAPI[inner["items"]["type"]]
            elif "properties" in inner:
                inner["properties"] = _properties(inner["properties"])
    return properties


def openai_tool(doc: dict[str, Any]) -> dict[str, Any]:
    """One BFCL function doc as an OpenAI function schema."""
    fn = copy.deepcopy(doc)
    fn["parameters"]["type"] = "object"
    fn["parameters"]["properties"] = _properties(fn["parameters"].get("properties", {}))
    return {"type": "function", "function": fn}


def _jsonl(path: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows(category: str, offered: str = "all") -> list[dict[str, Any]]:
    """Every entry of one multi-turn category as a row, in BFCL's order; `offered`: "all" the functions of
    its classes (BFCL's choice), or "called" only those its ground truth calls."""
    entries = _jsonl(DATA / f"BFCL_v4_multi_turn_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(DATA / "possible_answer" /
                                                           f"BFCL_v4_multi_turn_{category}.json")}
    docs = {name: _jsonl(DATA / "multi_turn_func_doc" / file) for name, file in
            MULTI_TURN_FUNC_DOC_FILE_MAPPING.items()}
    out = []
    for entry in entries:
        functions = [doc for name in entry["involved_classes"] for doc in docs[name]]
        if offered == "called":
            called = {text.split("(", 1)[0] for turn in answers[entry["id"]] for text in turn}
            functions = [doc for doc in functions if doc["name"] in called]
        held = {int(turn): names for turn, names in entry.get("missed_function", {}).items()}
        hidden = {n for names in held.values() for n in names}
        turns = [list(t) for t in entry["question"]]
        for turn, names in held.items():   # BFCL's holdout turns carry no user message of their own
            shown = [openai_tool(d) for d in functions if d["name"] in names]
            turns[turn] = [{"role": "user", "content": json.dumps(shown) + "\n" +
                            DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}]
        out.append({"id": entry["id"], "messages": turns[0],
                    "tools": [openai_tool(d) for d in functions if d["name"] not in hidden],
                    "label": answers[entry["id"]],
                    "bfcl": {"turns": turns[1:], "involved_classes": entry["involved_classes"],
                             "initial_config": entry["initial_config"],
                             "long_context": category == "long_context"}})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--eval", type=int, default=50, help="entries held out for eval, per category")
    parser.add_argument("--train", type=int, default=None, help="at most this many training rows a category")
    parser.add_argument("--classes", default=None, help="only entries whose API classes are all among these")
    parser.add_argument("--tools", choices=["all", "called"], default="all",
                        help="all functions of an entry's classes (BFCL), or only those its truth calls")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    categories = args.categories.split(",")
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        parser.error(f"unknown categories {unknown}; BFCL's multi-turn ones are {', '.join(CATEGORIES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    classes = set(args.classes.split(",")) if args.classes else None
    for category in categories:
        every = rows(category, args.tools)
        # entry i of every category has the same classes, so the kept and held-out indices agree across them
        kept = [i for i, r in enumerate(every)
                if classes is None or set(r["bfcl"]["involved_classes"]) <= classes]
        held = set(random.Random(args.seed).sample(kept, args.eval))
        splits = {"train": [every[i] for i in kept if i not in held][:args.train],
                  "eval": [every[i] for i in kept if i in held]}
        for split, chosen in splits.items():
            path = args.out / f"bfcl_multi_turn_{category}_{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
            print(f"{path}: {len(chosen)} rows")


if __name__ == "__main__":
    main()
