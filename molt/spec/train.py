"""The `train` section of the run spec: steps and batches, the optimizer and its schedule, checkpoints,
evaluation cadence, and the objective (rl or sft)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from molt.spec.strict import Strict


class TrainSpec(Strict):
    steps: int = Field(400, ge=0, description="loop steps: one generated batch each (train.minibatches x "
                       "train.epochs optimizer steps per batch)")
    prompts_per_step: int = Field(8, ge=1, description="prompt groups per step (batch)")
    micro_batch_size: int = Field(64, ge=1, description="most sequences per forward/backward, per rank")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="sequence packing: micro-batches of consecutive rows with at most this many "
        "real tokens per rank, packed into one padding-free row (replaces micro_batch_size; cpu; null = off)")
    logprob_chunk_tokens: int | None = Field(
        None, ge=1, description="the policy/reference logprob pass (output head, temperature, top-k/top-p, "
        "entropy) runs over this many sampled positions at a time, recomputed per chunk in the backward, so "
        "its extra memory is chunk x vocab, not tokens x vocab (null = as many as keep a chunk's fp32 logits "
        "within 128 MiB)")
    lr: float = Field(5e-4, gt=0, description="AdamW learning rate of the policy")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="after warm-up: constant, or cosine / linear decay to 0 at train.steps")
    warmup_steps: int = Field(0, ge=0, description="steps of linear learning-rate warm-up")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this (> 0: torch "
                             "scales gradients by grad_clip / norm, so 0 would zero them and < 0 flip them)")
    critic_lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the critic")
    save_every: int = Field(50, ge=0, description="checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = Field(
        2, ge=1, description="checkpoints kept on disk: the newest N, plus the best one (train.best_metric)")
    eval_every: int = Field(25, ge=0, description="evaluate on the data.eval sets every N steps (0 = never)")
    objective: Literal["rl", "sft"] = Field(
        "rl", description="rl: the agent loop; sft: NLL on assistant tokens (set by python -m molt.sft)")
    export_hf: bool = Field(
        False, description="every checkpoint also writes a Hugging Face folder, <checkpoint>/hf")
    best_metric: str | None = Field(
        None, description="eval metric that picks the best checkpoint (kept), e.g. eval/NAME/pass@1; a "
        "metric alone (pass@1) is the first data.eval set's")
    best_mode: Literal["max", "min"] = Field(
        "max", description="train.best_metric is better when larger (max) or smaller (min)")
    max_trainer_restarts: int = Field(
        3, ge=0, description="times a dead trainer is rebuilt from the last checkpoint before the run stops")
    minibatches: int = Field(1, ge=1, description="optimizer steps per generated batch: its rows split "
                             "into this many chunks (old logprobs computed once before the first)")
    epochs: int = Field(1, ge=1, description="passes over each generated batch (train.minibatches steps "
                        "each)")
    critic_warmup_steps: int = Field(0, ge=0, description="first N batches train only the critic (gae); "
                                     "the policy and the engines stay unchanged")
