"""TRL's GRPOTrainer on Molt's default task, timed per optimizer step. Runs in bench/.venv-trl.

The task is Molt's "repeat the letter": the prompt is one letter a..h as a user message rendered with
the model's chat template, the reward is the fraction of the response budget (max tokens) spent on
that letter's token (examples/agents/repeat.py). Settings mirror Molt's GRPO: group-std-scaled
advantages, one optimizer step per generated batch (num_iterations=1), the global token-mean loss
(TRL's `dapo`), clip 0.2, no KL, AdamW, grad clip 1.0, temperature 1.0 with top-k and top-p off.
TRL generates with transformers' `generate` (its vLLM path fails on vLLM's CPU build, see bench/README.md).

    bench/.venv-trl/bin/python bench/trl_peer.py --model DIR --max-tokens 16 --steps 10 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import LETTERS, summarize


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder (from molt.inputs.tiny)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timings")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8, help="GRPO group size (num_generations)")
    p.add_argument("--max-tokens", type=int, default=16, help="max response tokens")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (CPU autocast), as Molt's bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 3 steps, 1 warm-up step")
    return p.parse_args()


def grpo_config(args: argparse.Namespace, output_dir: str, batch: int) -> Any:
    """TRL's GRPO settings for Molt's peer work: the same batch, sampling, loss and optimizer."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=args.bf16, fp16=False, use_vllm=False, report_to="none",
        max_steps=args.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.samples_per_prompt, max_completion_length=args.max_tokens,
        temperature=1.0, top_k=0, top_p=1.0, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, num_iterations=1, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
        shuffle_dataset=True,
    )


def write_result(args: argparse.Namespace, steps: list[dict], model: Any, setup_s: float,
                 wall_s: float) -> None:
    """The run's JSON at `args.out` (what bench/peer.py reads); prints the summary."""
    import torch
    import transformers
    import trl

    result = {
        "framework": "trl", "model": args.model, "params": sum(p.numel() for p in model.parameters()),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "model")},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "python": sys.version.split()[0]},
        "setup_s": setup_s, "wall_s": wall_s, "steps": steps, "summary": summarize(steps, args.warmup),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"]))


def main() -> None:
    args = parse_args()
    if args.quick:
        args.steps, args.warmup = 3, 1
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = args.steps * args.prompts_per_step
    letters = [LETTERS[i % len(LETTERS)] for i in range(rows)]
    prompts = [[{"role": "user", "content": c}] for c in letters]
    data = Dataset.from_dict({"prompt": prompts, "label": letters})

    per_step: list[dict[str, float]] = []

    def repeat_reward(completion_ids: list[list[int]], label: list[str], **_: object) -> list[float]:
        # Same reward as examples/agents/repeat.py; it is called once per generated batch = per step.
        rewards = [sum(tokenizer.decode([t]) == c for t in ids) / args.max_tokens
                   for ids, c in zip(completion_ids, label, strict=True)]
        tokens = sum(len(ids) for ids in completion_ids)
        per_step.append({"sampled": tokens, "trained": tokens, "reward": sum(rewards) / len(rewards)})
        return rewards

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a: object, **k: object) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, *a: object, **k: object) -> None:
            ends.append(time.perf_counter())

    batch = args.prompts_per_step * args.samples_per_prompt
    with tempfile.TemporaryDirectory() as tmp:
        config = grpo_config(args, tmp, batch)
        trainer = GRPOTrainer(model=args.model, reward_funcs=repeat_reward, args=config, train_dataset=data,
                              processing_class=tokenizer, callbacks=[StepClock()])
        # Seconds in generation (transformers' generate) per step, to set beside Molt's engine time.
        # `_generate` is TRL-internal; with the pinned version it is called once per generated batch.
        generate_s: list[float] = []
        inner = trainer._generate

        def timed_generate(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                generate_s.append(time.perf_counter() - t0)

        trainer._generate = timed_generate
        setup_s = time.perf_counter() - start
        trainer.train()
    steps = [{**rec, "time": b - a, "generate": g}
             for rec, a, b, g in zip(per_step, ends, ends[1:], generate_s, strict=False)]
    write_result(args, steps, trainer.model, setup_s, time.perf_counter() - start)


if __name__ == "__main__":
    main()
