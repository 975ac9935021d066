"""A request's datums as the trainer's token batch, and which of their tokens the engines sampled.

A datum scores position t of its `model_input` x against `target_tokens` y_t: log p(y_t | x_0..x_t). A
trainer row scores token t against the tokens before it, so datum i becomes the row x_0..x_{T-1}, y_{T-1}
with `target_ids` [pad, y_0..y_{T-1}]: row position t + 1 holds datum position t, for every per-token input
alike. Targets need not be the next input (a prompt position's target is often a placeholder), which is
why the row names them instead of reading the next token.
"""

from __future__ import annotations

import numpy as np
import torch

from molt.algo import DATUM_LOSSES
from molt.tinker import Refused
from molt.tinker.wire import Datum

# wire name of a loss input -> the trainer batch key it fills (molt.algo.datum_losses reads these)
BATCH_KEYS = {"target_tokens": "target_ids", "weights": "weights", "advantages": "advantages",
              "logprobs": "behaviour_logp"}


def check_datums(data: list[Datum], loss: str, vocab: int) -> None:
    """Refuse what `loss` cannot score: a missing or unknown input, a shape that is not one value per
    position, a token outside the vocabulary (each message names the datum and the key)."""
    if not data:
        raise Refused("a forward/forward_backward request without datums")
    needed = {"target_tokens", *DATUM_LOSSES[loss].inputs}
    for i, datum in enumerate(data):
        length = len(datum.tokens)
        if not length:
            raise Refused(f"datum {i}: empty model_input")
        missing = sorted(needed - set(datum.inputs))
        if missing:
            raise Refused(f"datum {i}: loss_fn={loss!r} needs loss_fn_inputs {missing}")
        extra = sorted(set(datum.inputs) - needed)
        if extra:
            raise Refused(f"datum {i}: loss_fn_inputs[{extra[0]!r}] is not served for loss_fn={loss!r} (it "
                          f"reads {sorted(needed)})")
        for key, value in datum.inputs.items():
            if value.shape != (length,):
                raise Refused(f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}; served: "
                              f"one value per model_input position, [{length}]")
        if datum.inputs["target_tokens"].dtype.kind not in "iu":
            raise Refused(f"datum {i}: loss_fn_inputs['target_tokens'] must be integer token ids")
        for key, ids in (("model_input", datum.tokens), ("target_tokens", datum.inputs["target_tokens"])):
            if ids.min() < 0 or ids.max() >= vocab:
                raise Refused(f"datum {i}: {key} holds token ids outside the vocabulary [0, {vocab})")


def trainer_batch(data: list[Datum], pad_id: int, current: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """The padded [B, T + 1] batch of `data` (checked by `check_datums`): input_ids, target_ids,
    attention_mask, loss_mask (1 on every position a datum scores), its loss inputs, and current_mask:
    `current[i]`, the positions of datum i the engines sampled with the weights the trainer holds."""
    width = max(len(d.tokens) for d in data) + 1
    batch = {"input_ids": torch.full((len(data), width), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros(len(data), width, dtype=torch.long),
             "loss_mask": torch.zeros(len(data), width), "current_mask": torch.zeros(len(data), width)}
    for key in {BATCH_KEYS[k] for d in data for k in d.inputs}:
        batch[key] = torch.full((len(data), width), pad_id, dtype=torch.long) if key == "target_ids" \
            else torch.zeros(len(data), width)
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        batch["input_ids"][i, :n] = torch.from_numpy(datum.tokens)
        batch["input_ids"][i, n] = int(datum.inputs["target_tokens"][-1])
        batch["attention_mask"][i, :n + 1] = 1
        batch["loss_mask"][i, 1:n + 1] = 1
        batch["current_mask"][i, 1:n + 1] = torch.from_numpy(current[i].astype(np.float32))
        for key, value in datum.inputs.items():
            batch[BATCH_KEYS[key]][i, 1:n + 1] = torch.from_numpy(value.astype(
                np.int64 if key == "target_tokens" else np.float32))
    return batch


def datum_logprobs(logprobs: torch.Tensor, data: list[Datum]) -> list[np.ndarray]:
    """Each datum's target logprobs [T] out of the batch's [B, T + 1] rows."""
    return [logprobs[i, 1:len(d.tokens) + 1].numpy() for i, d in enumerate(data)]


class SampledRecord:
    """The sequences the engines sampled with the weights they hold now (tokens -> their logprobs), so a
    later forward knows which datum tokens are the engines' own: a run of positions with a nonzero
    sampling logprob whose targets and logprobs are exactly one recorded sample. Cleared at every refit."""

    def __init__(self) -> None:
        self.samples: dict[tuple[int, ...], set[bytes]] = {}

    def clear(self) -> None:
        self.samples.clear()

    def add(self, tokens: list[int], logprobs: list[float]) -> None:
        self.samples.setdefault(tuple(tokens), set()).add(np.asarray(logprobs, np.float32).tobytes())

    def mark(self, datum: Datum) -> np.ndarray:
        """The positions of `datum` the record holds (bool [T]); none without sampling logprobs."""
        q = datum.inputs.get("logprobs")
        out = np.zeros(len(datum.tokens), dtype=bool)
        if q is None or not self.samples:
            return out
        targets, nonzero = datum.inputs["target_tokens"], np.append(q != 0, False)
        start = None
        for t, inside in enumerate(nonzero):
            if inside and start is None:
                start = t
            elif not inside and start is not None:
                key = tuple(int(x) for x in targets[start:t])
                if q[start:t].astype(np.float32).tobytes() in self.samples.get(key, ()):
                    out[start:t] = True
                start = None
        return out
