"""Supervised fine-tuning on the RL trainer: `python -m molt.sft +experiment=NAME` (train.objective=sft).

    setup      model path → tokenizer → conversations → examples (molt/driver/sft_data.py) → policy ranks
    each step  train.prompts_per_step examples (seeded, resumable epochs) → sorted by length, dealt to
               the data-parallel ranks → policy.update: token-mean NLL on the assistant tokens
               (molt.algo.sft_loss) through the same micro-batching and global normalization as RL
               → log; eval loss of every data.eval set at step 0 and every train.eval_every;
               checkpoints, HF exports and the best checkpoint exactly as in RL (molt/driver/checkpoints.py)

No engine starts: nothing is sampled.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from molt.driver.checkpoints import (
    carry_best,
    find_checkpoint,
    install_stop_handler,
    new_best,
    save_checkpoint,
)
from molt.driver.metrics import RunLogger
from molt.driver.sft_data import Example, load_conversations, sft_batch, tokenize_rows
from molt.inputs.data import PromptIterator
from molt.plan.models import model_path
from molt.spec import RunSpec, eval_names
from molt.trainer.ranks import TrainerRanks


def train(spec: RunSpec) -> dict[str, float]:
    """Run the supervised fine-tuning described by `spec`; returns the last step's metrics."""
    return asyncio.run(_train(spec))


def load_examples(spec: RunSpec, tokenizer: Any, path: str) -> list[Example]:
    rows = load_conversations(path, spec.data)
    return tokenize_rows(rows, tokenizer, spec.data, spec.model.max_model_len, path,
                         spec.model.chat_template_kwargs)


async def _train(spec: RunSpec) -> dict[str, float]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path(spec),
                                              trust_remote_code=spec.model.trust_remote_code)
    examples = load_examples(spec, tokenizer, spec.data.train_path)
    data = PromptIterator(examples, seed=spec.run.seed, shuffle=spec.data.shuffle)
    eval_sets = {name: load_examples(spec, tokenizer, path)
                 for name, path in zip(eval_names(spec.data.eval), spec.data.eval, strict=True)
                 } if spec.train.eval_every else {}
    pad, ranks = tokenizer.pad_token_id, spec.parallel.dp_size
    checkpoint = find_checkpoint(spec)   # a bad run.resume fails before any actor starts
    policy = TrainerRanks(spec, "policy")
    logger = RunLogger(spec)
    step, metrics = 0, {}
    if checkpoint:
        carry_best(spec, checkpoint)
        extra = policy.load(str(checkpoint / "policy"))
        step = extra["step"]
        data.load_state_dict(extra["data"])
        print(f"molt: resumed from {checkpoint} at step {step}")
    saved, stop = step, install_stop_handler()

    def save(best: float | None = None) -> None:
        nonlocal saved
        save_checkpoint(spec, step, {"policy": policy}, {"step": step, "data": data.state_dict()}, best)
        saved = step

    async def evaluate() -> dict[str, float]:
        rows = spec.train.prompts_per_step
        return await asyncio.to_thread(eval_losses, policy, eval_sets, pad, ranks, rows)

    try:
        if eval_sets and step == 0:
            logger.log(0, await evaluate())
        while step < spec.train.steps and not stop.is_set():
            t0 = time.perf_counter()
            batch = sft_batch(data.take(spec.train.prompts_per_step), pad, ranks)
            metrics = await asyncio.to_thread(policy.update, batch)   # named train/* by the trainer
            step += 1
            metrics.update({"tokens/trained": float(batch["loss_mask"].sum()),
                            "train/pad_frac": 1 - float(batch["attention_mask"].float().mean()),
                            "train/epoch": data.epoch + data.index / len(examples),
                            "time/train": time.perf_counter() - t0})
            if eval_sets and (step % spec.train.eval_every == 0 or step == spec.train.steps):
                metrics.update(await evaluate())
            metrics["time/step"] = time.perf_counter() - t0
            logger.log(step, metrics)
            best = new_best(spec, step, metrics)
            if best is not None or (spec.train.save_every and step % spec.train.save_every == 0):
                save(best)
        if step != saved:
            save()
        if stop.is_set():
            print(f"molt: stopped by signal at step {step}; checkpoint written, resume with "
                  f"run.resume={Path(spec.run.dir)}")
    finally:
        logger.close()
        policy.shutdown()
    return metrics


def eval_losses(policy: TrainerRanks, eval_sets: dict[str, list[Example]], pad_id: int, ranks: int,
                rows_per_call: int) -> dict[str, float]:
    """eval/NAME/loss: the token-mean NLL of each set's assistant tokens under the current weights."""
    out = {}
    for name, examples in eval_sets.items():
        nll, tokens = 0.0, 0.0
        for start in range(0, len(examples), rows_per_call):
            batch = sft_batch(examples[start:start + rows_per_call], pad_id, ranks)
            logp = policy.logprobs(batch)
            nll -= float((logp * batch["loss_mask"]).sum())
            tokens += float(batch["loss_mask"].sum())
        out[f"eval/{name}/loss"] = nll / tokens
    return out
