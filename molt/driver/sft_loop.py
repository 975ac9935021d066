"""Supervised fine-tuning on the RL trainer: `python -m molt.sft +experiment=NAME` (train.objective=sft).

    setup      the conversations, tokenized once before anything starts (molt.driver.compose.prepare;
               molt/driver/sft_data.py) → policy ranks
    each step  train.prompts_per_step examples (seeded, resumable epochs) → sorted by length, dealt to
               the data-parallel ranks → policy.update: token-mean NLL on the assistant tokens
               (molt.algo.sft_loss) through the same micro-batching and global normalization as RL
    around it  the RL loop's skeleton (molt.driver.run.train_steps): eval loss of every data.eval set at
               step 0 and every train.eval_every, logging, checkpoints, HF exports, the best checkpoint,
               SIGINT / SIGTERM

No engine starts: nothing is sampled.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ray.exceptions import RayActorError

from molt.driver.checkpoints import carry_best, load_checkpoint, save_checkpoint
from molt.driver.compose import Inputs, prepare
from molt.driver.metrics import RunLogger
from molt.driver.run import train_steps
from molt.driver.sft_data import Example, sft_batch
from molt.inputs.data import PromptIterator
from molt.spec import RunSpec
from molt.trainer.ranks import TrainerRanks


def train(spec: RunSpec, inputs: Inputs | None = None) -> dict[str, float]:
    """Run the supervised fine-tuning described by `spec` from its `inputs` (built here when not given);
    returns the last step's metrics."""
    inputs = (inputs or prepare(spec)).or_raise()

    async def main() -> dict[str, float]:
        run = SFTRun(spec, inputs)
        try:
            run.begin(inputs.checkpoint)
            return await train_steps(run, sft_step)
        finally:
            run.stop()

    return asyncio.run(main())


class SFTRun:
    """The policy's ranks, the logger and the position in the conversations (molt.driver.run.Steps)."""

    def __init__(self, spec: RunSpec, inputs: Inputs) -> None:
        self.spec, self.examples = spec, inputs.train
        self.eval_sets = inputs.eval_sets if spec.train.eval_every else {}
        self.pad = inputs.tokenizer.pad_token_id
        self.data = PromptIterator(self.examples, seed=spec.run.seed, shuffle=spec.data.shuffle)
        self.policy = TrainerRanks(spec, "policy")
        self.logger = RunLogger(spec)
        self.step = self.saved = 0

    def begin(self, checkpoint: Path | None) -> None:
        """Continue from `checkpoint` (run.resume's), if any."""
        if checkpoint:
            carry_best(self.spec, checkpoint)
            meta = load_checkpoint(checkpoint, {"policy": self.policy})
            self.step = self.saved = meta["step"]
            self.data.load_state_dict(meta["data"])
            print(f"molt: resumed from {checkpoint} at step {self.step}")

    async def evaluate(self) -> dict[str, float]:
        return await asyncio.to_thread(eval_losses, self.policy, self.eval_sets, self.pad,
                                       self.spec.parallel.dp_size, self.spec.train.prompts_per_step)

    async def save(self, best: float | None = None) -> None:
        meta = {"step": self.step, "data": self.data.state_dict()}
        save_checkpoint(self.spec, self.step, {"policy": self.policy}, meta, best)
        self.saved = self.step

    async def recover(self, err: RayActorError) -> bool:
        return False   # a dead rank stops SFT: resume it with run.resume=auto

    def stop(self) -> None:
        self.logger.close()
        self.policy.shutdown()


async def sft_step(run: SFTRun) -> dict[str, float]:
    """One optimizer step on train.prompts_per_step conversations."""
    t0 = time.perf_counter()
    batch = sft_batch(run.data.take(run.spec.train.prompts_per_step), run.pad, run.spec.parallel.dp_size)
    metrics = await asyncio.to_thread(run.policy.update, batch)   # named train/* by the trainer
    run.step += 1
    return metrics | {"tokens/trained": float(batch["loss_mask"].sum()),
                      "train/pad_frac": 1 - float(batch["attention_mask"].float().mean()),
                      "train/epoch": run.data.epoch + run.data.index / len(run.examples),
                      "time/train": time.perf_counter() - t0, "time/step": time.perf_counter() - t0}


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
