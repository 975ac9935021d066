"""`python -m molt.inspect RUN_DIR [--step N] [--out FILE]`: one self-contained HTML page of a run's
rollout dumps, read token by token in a browser (offline: no server, no CDN).

The page joins the engine's side of every token (the rollout: id, loss mask, behaviour logprob, version)
with the trainer's side the loop dumps beside it (`logging.dump_trainer`: the trainer's ids and loss mask,
its logprob, the advantage, the importance weight and what the correction did, the entropy), position by
position: the token ids are the join key, nothing is re-tokenized. Ids are decoded by the run's own
tokenizer. The viewer itself is `inspect.html` beside this file; this module only gathers its data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from molt.driver.metrics import TRAINER_KEY
from molt.driver.plot import read_metrics

TEMPLATE = Path(__file__).with_name("inspect.html")
# The step metrics the Steps view shows (a missing one is left blank).
STEP_METRICS = ("reward/mean", "mismatch/max_abs", "adv/zero_std_frac", "filter/kept_frac", "policy/lag_mean",
                "policy/lag_max", "reward/std", "mismatch/mean_abs", "tokens/sampled", "time/step")
# Opening the page in Debian's headless chromium (the browser test, bench/inspect_page.py) on a machine
# without network: no sandbox (root), no GPU, no background traffic; with a fresh --user-data-dir.
HEADLESS_CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync")
MAX_TOKENS = 4_000_000   # tokens embedded in one page by default: the newest steps that fit
WORST = 25               # worst-mismatch tokens listed per step


def dumped_steps(run_dir: Path) -> list[int]:
    paths = (run_dir / "rollouts").glob("step_*.jsonl")
    return sorted(int(p.stem[5:]) for p in paths if p.stem[5:].isdigit())


def run_tokenizer(run_dir: Path, tokenizer: str | None = None) -> tuple[Any, int | None, str]:
    """The run's tokenizer (its spec's policy model, or `tokenizer`), the model's image placeholder id
    (None: not a vision-language model) and the path they came from."""
    from transformers import AutoConfig, AutoTokenizer

    from molt.plan.models import model_path
    from molt.spec import RunSpec

    trust = False
    if tokenizer is None:
        spec_file = run_dir / "spec.yaml"
        if not spec_file.exists():
            raise FileNotFoundError(f"{spec_file}: not a run directory (no spec.yaml); pass --tokenizer")
        try:
            spec = RunSpec.model_validate(yaml.safe_load(spec_file.read_text()))
        except ValueError as err:
            raise ValueError(f"{spec_file} does not validate with this Molt ({str(err).splitlines()[0]}): "
                             "pass --tokenizer PATH (the run's model folder)") from None
        tokenizer, trust = model_path(spec), spec.model.trust_remote_code
    tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust)
    try:
        config = AutoConfig.from_pretrained(tokenizer, trust_remote_code=trust)
        image_token = getattr(config, "image_token_id", None)
    except (OSError, ValueError):   # a tokenizer-only folder
        image_token = None
    return tok, image_token, tokenizer


def _round(values: list[float], digits: int = 4) -> list[float]:
    return [round(v, digits) for v in values]


def _sig(x: float) -> float:
    """`x` to 3 significant digits: a gap of 1e-7 stays visible beside one of 0.3."""
    return 0.0 if x == 0 or not math.isfinite(x) else float(f"{x:.3g}")


def segment_data(seg: dict, trained: dict | None) -> dict:
    """One segment for the page: the engine's arrays, and the trainer's aligned to them (None: not trained
    or not recorded). Values the page never shows for a token are zeroed, so the page stays small."""
    out = {"index": seg["segment_index"], "prompt_len": seg["prompt_len"], "finish": seg["finish_reason"],
           "turns": seg.get("turns") or [], "images": seg.get("images") or [], "ids": seg["token_ids"],
           "mask": seg["loss_mask"], "lp": _round(seg["logprobs"]), "ver": seg["versions"],
           "sampling": seg.get("sampling") or [], "tr": None}
    if trained is None:
        return out
    mask = [int(m) for m in trained["loss_mask"]]
    on = [m or e for m, e in zip(mask, seg["loss_mask"], strict=True)]   # a token either side trained
    gap = [_sig(t - e) if o else 0.0
           for t, e, o in zip(trained["logprobs"], seg["logprobs"], on, strict=True)]
    out["tr"] = {
        "ids_differ": [i for i, (a, b) in enumerate(zip(trained["input_ids"], seg["token_ids"], strict=True))
                       if a != b],
        "mask": mask, "gap": gap,
        "lp": [round(v, 4) if o else 0.0 for v, o in zip(trained["logprobs"], on, strict=True)],
        "adv": [_sig(v) if o else 0.0 for v, o in zip(trained["advantages"], on, strict=True)],
        "w": [_sig(v) if o else 0.0 for v, o in zip(trained["weights"], on, strict=True)],
        "dec": trained["decisions"],
        "ent": None if "entropy" not in trained else
        [round(v, 3) if o else 0.0 for v, o in zip(trained["entropy"], on, strict=True)],
    }
    return out


def rollout_data(record: dict) -> dict:
    trainer = record.get(TRAINER_KEY) or {}
    trained = {s["segment_index"]: s for s in trainer.get("segments", [])}
    return {"id": record["rollout_id"], "group": record["group_id"], "reward": record["reward"],
            "score": record.get("score"), "error": record.get("error"), "turns": record.get("turns", 0),
            "tool_calls": record.get("tool_calls", 0), "turn_rewards": record.get("turn_rewards") or [],
            "label": None if record.get("label") is None else str(record["label"])[:200],
            "decision": trainer.get("decision"), "version": trainer.get("version"),
            "segments": [segment_data(s, trained.get(s["segment_index"])) for s in record["segments"]]}


def worst_tokens(rollouts: list[dict], count: int = WORST) -> list[list]:
    """[rollout index, segment index in the rollout, position, gap] of the largest |trainer − engine|."""
    found = [(abs(g), r, s, t, g) for r, ro in enumerate(rollouts) for s, seg in enumerate(ro["segments"])
             if seg["tr"] for t, g in enumerate(seg["tr"]["gap"]) if g]
    found.sort(reverse=True)
    return [[r, s, t, g] for _, r, s, t, g in found[:count]]


def step_data(path: Path) -> dict:
    with path.open(encoding="utf-8") as f:
        rollouts = [rollout_data(json.loads(line)) for line in f if line.strip()]
    return {"step": int(path.stem[5:]), "rollouts": rollouts, "worst": worst_tokens(rollouts)}


def token_texts(steps: list[dict], decode: Callable[[int], str]) -> dict[int, str]:
    ids = {i for st in steps for r in st["rollouts"] for s in r["segments"] for i in s["ids"]}
    return {i: decode(i) for i in sorted(ids)}


def page_data(run_dir: Path, steps: list[int] | None = None, tokenizer: str | None = None,
              max_tokens: int = MAX_TOKENS) -> dict:
    """Everything the page shows: the run, the step metrics, the embedded steps' rollouts, token texts."""
    dumped = dumped_steps(run_dir)
    wanted = dumped if steps is None else steps
    missing = sorted(set(wanted) - set(dumped))
    if missing:
        raise FileNotFoundError(f"{run_dir / 'rollouts'}: no dump of step(s) {missing} (dumped: "
                                f"{f'{dumped[0]}..{dumped[-1]}' if dumped else 'none'})")
    tok, image_token, source = run_tokenizer(run_dir, tokenizer)
    embedded, total = [], 0
    for step in reversed(wanted):   # the newest steps that fit the budget
        data = step_data(run_dir / "rollouts" / f"step_{step:06d}.jsonl")
        total += sum(len(s["ids"]) for r in data["rollouts"] for s in r["segments"])
        if embedded and total > max_tokens:
            break
        embedded.append(data)
    embedded.reverse()
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else {}
    metrics = {"step": list(rows)} | {k: [rows[s].get(k) for s in rows] for k in STEP_METRICS}
    return {"run": {"dir": str(run_dir), "name": f"{run_dir.parent.name}/{run_dir.name}",
                    "tokenizer": source, "dumped": dumped, "image_token": image_token},
            "metrics": metrics, "steps": embedded,
            "texts": token_texts(embedded, lambda i: tok.decode([i], skip_special_tokens=False))}


def build_page(run_dir: Path, steps: list[int] | None = None, out: Path | None = None,
               tokenizer: str | None = None, max_tokens: int = MAX_TOKENS) -> Path:
    """Write the page (default `RUN_DIR/inspect.html`) and return its path."""
    data = json.dumps(page_data(run_dir, steps, tokenizer, max_tokens), separators=(",", ":"))
    html = TEMPLATE.read_text(encoding="utf-8").replace("/*MOLT_DATA*/null", data.replace("</", "<\\/"))
    out = out or run_dir / "inspect.html"
    out.write_text(html, encoding="utf-8")
    return out


def inspect_command(run_dir: str | Path) -> str:
    """The command that writes `run_dir`'s page: what the end of every run prints."""
    return f"python -m molt.inspect {run_dir}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m molt.inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, action="append",
                        help="a dumped step to embed (repeatable; default: every dumped step that fits)")
    parser.add_argument("--out", type=Path, help="the HTML file to write (default: RUN_DIR/inspect.html)")
    parser.add_argument("--tokenizer", help="decode with this tokenizer (default: the run's model)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help="embed the newest steps up to this many tokens (default %(default)s)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "rollouts").is_dir():
        sys.exit(f"molt.inspect: {args.run_dir / 'rollouts'}: no rollout dumps "
                 "(not a run directory, or logging.dump_rollouts=false)")
    try:
        path = build_page(args.run_dir, args.step, args.out, args.tokenizer, args.max_tokens)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"molt.inspect: {err}")
    print(path.resolve().as_uri())
    return 0
