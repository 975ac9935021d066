"""What the policy's update computed on each token it trained, kept for the rollout dump.

The engine's side of a token (its id, loss mask, behaviour logprob, version) is in the rollout; this is
the trainer's side of the same positions: the ids and loss mask the trainer read, its logprob before the
update (the one compared with the engine's for `mismatch/*`), the advantage, the importance weight the
loss applied and what the correction did to it, and the entropy. Recorded in the first pass over the
batch (every row once), so it costs no extra forward; the ids stay the join key (`logging.dump_trainer`).
"""

from __future__ import annotations

import torch

from molt.algo import importance_weights
from molt.spec import CorrectionSpec

# `decisions`: what the importance correction did to a token (algo.correction)
NOT_TRAINED, KEPT, CLIPPED, MASKED = 0, 1, 2, 3
FIELDS = ("input_ids", "loss_mask", "logprobs", "advantages", "weights", "decisions", "entropy")


class TokenRecord:
    """Rows of [T] per field, appended micro-batch by micro-batch in the shard's row order."""

    def __init__(self, rows: int, length: int) -> None:
        self.shape = (rows, length)   # the shard's
        self.rows: list[dict[str, torch.Tensor]] = []
        self.room = 0   # rows of the current part still to come (inert padding micro-batches come after)

    def part(self, rows: int) -> TokenRecord:
        """The next `rows` rows come (one minibatch); micro-batches past them are padding."""
        self.room = rows
        return self

    def add(self, mb: dict[str, torch.Tensor], old_logp: torch.Tensor, entropy: torch.Tensor | None,
            correction: CorrectionSpec) -> None:
        """One micro-batch: `old_logp` the trainer's logprobs before the update, as the loss read them."""
        take = min(self.room, mb["input_ids"].shape[0])
        self.room -= take
        if not take:
            return
        mask = mb["loss_mask"] > 0
        weights, _ = importance_weights(old_logp, mb["behaviour_logp"], mb["loss_mask"], correction)
        rho = torch.where(mask, (old_logp - mb["behaviour_logp"]).exp(), torch.zeros_like(old_logp))
        decisions = torch.where(weights == 0, MASKED, torch.where(
            (weights != rho) & (correction.level != "off"), CLIPPED, KEPT))
        fields = {"input_ids": mb["input_ids"], "loss_mask": mb["loss_mask"], "logprobs": old_logp,
                  "advantages": mb["advantages"], "weights": weights,
                  "decisions": torch.where(mask, decisions, NOT_TRAINED), "entropy": entropy}
        length = mb["attention_mask"].sum(-1)
        for row in range(take):
            n = int(length[row])
            self.rows.append({k: v[row, :n].detach().float().cpu()
                              for k, v in fields.items() if v is not None})

    def tensors(self) -> dict[str, torch.Tensor]:
        """[rows, length] per field, the shard's shape (0 past each row's tokens); `entropy` only when it
        was computed."""
        out = {}
        for key in FIELDS:
            if not self.rows or any(key not in r for r in self.rows):
                continue
            out[key] = torch.zeros(self.shape)
            for i, r in enumerate(self.rows):
                out[key][i, :len(r[key])] = r[key]
        return out
