"""SFT data for the tinker-cookbook's `arithmetic` task, in the exact tokens its recipe samples from.

    python examples/data/make_arith_sft.py runs/arith_sft [--rows 20000] [--eval 500] [--seed 0]

writes OUT/base (the tiny model, output head untied, with a ChatML template), OUT/sft.jsonl and
OUT/sft_eval.jsonl: conversations "What is X + Y?" -> "X+Y" (X, Y in 0..100, as the cookbook's
ArithmeticEnv draws them) after the env's one worked example (bench/tinker_arith_agent.py's FEW_SHOT).
`python -m molt.sft model.path=OUT/base data.train_path=OUT/sft.jsonl ...` trains on them (docs/tinker.md).

The recipe renders its prompts with the cookbook's `qwen3_instruct` renderer, not with the model's chat
template: ChatML with a newline after every `<|im_end|>` and after the role. The tiny model's own template
writes no newlines there, so an SFT on it would train the model on prompts the recipe never shows it. The
base folder's template renders the renderer's text exactly (the newline after `<|im_end|>` is context: the
engine stops at `<|im_end|>`), so SFT trains the very tokens the recipe will sample and score.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from tinker_arith_agent import FEW_SHOT  # noqa: E402

from molt.inputs.tiny import tiny_model_path  # noqa: E402

# the cookbook's qwen3_instruct rendering of a conversation without tools or thinking
CHATML = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_base(path: Path) -> None:
    """The tiny untied model with the ChatML template above, as a Hugging Face folder."""
    from transformers import AutoTokenizer

    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(tiny_model_path(tie_word_embeddings=0), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)


def conversation(x: int, y: int) -> dict:
    return {"messages": [*FEW_SHOT, {"role": "user", "content": f"What is {x} + {y}?"},
                         {"role": "assistant", "content": str(x + y)}]}


def write(path: Path, pairs: list[tuple[int, int]]) -> None:
    path.write_text("".join(json.dumps(conversation(x, y)) + "\n" for x, y in pairs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_base(args.out / "base")
    rng = random.Random(args.seed)
    # the eval questions are held out of the training rows: eval/sft_eval/loss is on unseen sums
    held_out = rng.sample([(x, y) for x in range(101) for y in range(101)], args.eval)
    train: list[tuple[int, int]] = []
    excluded = set(held_out)
    while len(train) < args.rows:
        pair = (rng.randint(0, 100), rng.randint(0, 100))
        if pair not in excluded:
            train.append(pair)
    write(args.out / "sft_eval.jsonl", held_out)
    write(args.out / "sft.jsonl", train)
    print(f"wrote {args.out}/base, sft.jsonl ({args.rows} rows), sft_eval.jsonl ({args.eval} rows)")


if __name__ == "__main__":
    main()
