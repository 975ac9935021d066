"""Is Molt's trainer the gap to a peer? Its policy update against a plain PyTorch step on the same batch.

One trainer rank (`TrainerRanks`, world size 1, `parallel.cpu_threads` threads) runs `update` on a fixed
GRPO batch; this process runs the same step by hand on the same Hugging Face model with as many torch
threads: forward, log-softmax gather, the ratio surrogate with the batch's advantages (token mean), the
gradient clip and AdamW. The two alternate; medians are printed (nothing is written to RESULTS.md).

    python bench/trainer_floor.py --size 30m --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from breakdown import policy_batch
from common import LR
from molt_run import model_path, overrides


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: dict[str, torch.Tensor]) -> None:
    ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:].float()
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ratio = (logp - logp.detach()).exp()   # one update per batch: the old logprobs are this forward's
    (-(ratio * batch["advantages"][:, 1:] * mask).sum() / mask.sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def compare(size: str, threads: int, repeats: int, length: int = 128) -> dict[str, list[float]]:
    """Seconds of Molt's `update` and of `plain_step` on one batch of 4 x 8 rows of 8 + `length` tokens."""
    import ray
    from transformers import AutoModelForCausalLM

    from molt.driver.compose import compose
    from molt.plan.placement import init_ray
    from molt.trainer import TrainerRanks

    spec = compose(overrides(size, length, 1, 4, 8, extra=[f"parallel.cpu_threads={threads}"]))
    batch = policy_batch(32, 8, length)   # the batch breakdown's "trainer alone" times
    if not ray.is_initialized():
        init_ray(spec)
    policy = TrainerRanks(spec, "policy")
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path(size), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR[size])
    steps = {"molt": lambda: policy.update(batch), "plain": lambda: plain_step(model, optimizer, batch)}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    try:
        for name in steps:   # warm-up, untimed
            steps[name]()
        for r in range(repeats):
            for name in (("molt", "plain") if r % 2 == 0 else ("plain", "molt")):
                t0 = time.perf_counter()
                steps[name]()
                seconds[name].append(time.perf_counter() - t0)
    finally:
        policy.shutdown()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="30m", choices=sorted(LR))
    p.add_argument("--threads", type=int, default=2, help="torch threads of the rank and of the plain step")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    seconds = compare(args.size, args.threads, args.repeats)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
    print(f"molt / plain: {statistics.median(seconds['molt']) / statistics.median(seconds['plain']):.3f}")


if __name__ == "__main__":
    main()
