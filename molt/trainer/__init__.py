"""molt.trainer: the policy (and optional critic / reference) on FSDP2 inside Ray actors."""

from molt.trainer.batch import make_batch

__all__ = ["TrainerRanks", "make_batch"]


def __getattr__(name: str):
    # Ray comes with the ranks: imported on first use, so the trainer's tensor code (model, weights, fp8,
    # the refit wire) imports where Ray is absent (bench/gpu_one.py on a GPU machine without it)
    if name == "TrainerRanks":
        from molt.trainer.ranks import TrainerRanks

        return TrainerRanks
    raise AttributeError(f"module 'molt.trainer' has no attribute {name!r}")
