"""A plain PyTorch SFT loop over the tool traces: how soon a random-init tiny model copies digits.

    python bench/tool_sft_probe.py OUT_DIR [--steps 220] [--lr 3e-3] [--batch 32] [--bare-only]
        [--save 160,180,200,220]

The rows of examples/data/tool_products_sft.jsonl, tokenized and masked by molt.driver.sft_data exactly as
`python -m molt.sft` does; AdamW (no weight decay), linear warm-up over 10 steps, gradient clip 1.0, one
thread, batches drawn at random (seed 0). Every 20 steps it prints the teacher-forced accuracy on the
digit tokens of the batch; at each --save step it writes a Hugging Face export to OUT_DIR/step_N. It is
a probe of the learning dynamics (no FSDP, no Ray, no checkpoints), used in docs/tool_use.md.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from molt.driver.sft_data import tokenize_conversation
from molt.inputs.tiny import tiny_model_path

ROWS = Path(__file__).resolve().parents[1] / "examples" / "data" / "tool_products_sft.jsonl"


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bare-only", action="store_true", help="only the traces without the tools")
    parser.add_argument("--save", default="160,180,200,220", help="steps to export at")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    path = tiny_model_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    rows = [row for row in rows if not (args.bare_only and "tools" in row)]
    examples = [tokenize_conversation(tok, row["messages"], row.get("tools"))[0] for row in rows]
    digits = set(tok.convert_tokens_to_ids([str(d) for d in range(10)] + ["Ġ" + str(d) for d in range(10)]))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    saves, start = {int(s) for s in args.save.split(",") if s}, time.time()
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 10)
        batch = rng.sample(examples, args.batch)
        width = max(len(e.token_ids) for e in batch)
        ids = torch.tensor([e.token_ids + [0] * (width - len(e.token_ids)) for e in batch])
        mask = torch.tensor([e.loss_mask + [0] * (width - len(e.loss_mask)) for e in batch])[:, 1:].float()
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            is_digit = mask * torch.tensor([[t in digits for t in row] for row in ids[:, 1:].tolist()])
            hit = ((logits.argmax(-1) == ids[:, 1:]).float() * is_digit).sum() / is_digit.sum()
            print(f"step {step} loss {loss.item():.3f} digit_acc {hit.item():.2f} "
                  f"({time.time() - start:.0f} s)", flush=True)
        if step in saves:
            model.save_pretrained(args.out / f"step_{step}")
            tok.save_pretrained(args.out / f"step_{step}")


if __name__ == "__main__":
    main()
