"""molt.trainer: the policy (and optional critic / reference) on FSDP2 inside Ray actors."""

from molt.trainer.batch import make_batch
from molt.trainer.ranks import TrainerRanks

__all__ = ["TrainerRanks", "make_batch"]
