"""Segments → the padded tensor batch every trainer call takes.

Rows are right-padded to the longest segment. Per-token fields keep the token-first alignment of
`Segment`: position t describes token t (its loss mask, its behaviour logprob, its advantage), and a
recomputed logprob at t is log π(token t | tokens < t).
"""

from __future__ import annotations

from typing import Any

import torch

from molt.inputs.vision import pixel_inputs
from molt.spec import GREEDY_BELOW
from molt.trajectory import NO_VERSION, Segment

# Per-token sampling parameters a segment records; tokens the engine did not sample get these neutral
# values (their logprobs are never used), so the trainer only truncates where a sampled token needs it.
RECORDED_SAMPLING = ("temperature", "top_p", "top_k")
NEUTRAL_SAMPLING = (1.0, 1.0, 0.0)


def _pad(rows: list[list], length: int, dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
    out = torch.full((len(rows), length), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def make_batch(segments: list[Segment], pad_id: int = 0,
               **per_token: list[list[float]]) -> dict[str, torch.Tensor]:
    """Pad segments into input_ids / attention_mask / loss_mask / behaviour_logp [B, T] (+ routed_experts,
    temperature / top_p / top_k).

    `per_token` adds float fields with one value per token of each segment, e.g. advantages=...,
    returns=..., old_values=..., ref_logp=... . `routed_experts` [B, T, layers, top_k] is added when
    every segment carries it (padding rows route to experts 0..k-1; their loss mask is 0). When the
    segments record their sampling parameters, `temperature`, `top_p`, `top_k` [B, T] say what each
    sampled token was drawn with (neutral values elsewhere); segments that do not are scored at the run's.
    """
    if not segments:
        raise ValueError("make_batch needs at least one segment")
    length = max(len(s.token_ids) for s in segments)
    batch = {
        "input_ids": _pad([s.token_ids for s in segments], length, torch.long, pad_id),
        "attention_mask": _pad([[1] * len(s.token_ids) for s in segments], length, torch.long),
        "loss_mask": _pad([s.loss_mask for s in segments], length, torch.float32),
        "behaviour_logp": _pad([s.logprobs for s in segments], length, torch.float32),
    }
    for key, rows in per_token.items():
        for s, row in zip(segments, rows, strict=True):
            if len(row) != len(s.token_ids):
                raise ValueError(f"{key}: {len(row)} values for a {len(s.token_ids)}-token segment "
                                 f"({s.rollout_id}/{s.segment_index})")
        batch[key] = _pad(rows, length, torch.float32)
    if all(s.routed_experts is not None for s in segments):
        layers, top_k = len(segments[0].routed_experts[0]), len(segments[0].routed_experts[0][0])
        routes = torch.arange(top_k).expand(len(segments), length, layers, top_k).clone()
        for i, s in enumerate(segments):
            routes[i, : len(s.token_ids)] = torch.tensor(s.routed_experts)
        batch["routed_experts"] = routes
    if any(s.sampling for s in segments):
        if not all(s.sampling for s in segments):
            raise ValueError("make_batch: some segments record their sampling parameters and some do not")
        batch.update(zip(RECORDED_SAMPLING, torch.stack([_sampling_rows(s, length) for s in segments], 1),
                         strict=True))
    return batch


def _sampling_rows(segment: Segment, length: int) -> torch.Tensor:
    """[3, length]: temperature, top_p, top_k of every sampled token of `segment` (its turns' spans)."""
    neutral = torch.tensor(NEUTRAL_SAMPLING)[:, None].expand(3, length)
    out = neutral.clone()
    ends = [span[0] for span in segment.sampling[1:]] + [len(segment.token_ids)]
    for (start, *values), end in zip(segment.sampling, ends, strict=True):
        out[:, int(start):end] = torch.tensor(values, dtype=torch.float32)[:, None]
    sampled = torch.zeros(length, dtype=torch.bool)
    sampled[: len(segment.loss_mask)] = torch.tensor(segment.loss_mask) > 0
    return torch.where(sampled, out, neutral)


def add_images(batch: dict[str, torch.Tensor], segments: list[Segment], proc: Any) -> None:
    """Add each row's images as `pixel_values` [B, patches, dim] and `image_grid_thw` [B, images, 3]
    (zero-padded: a zero grid is no image), and take image placeholders out of the loss.

    `proc` is the model's processor (molt.inputs.vision.processor). A row's placeholder count must be what its
    images expand to, or the trainer would not read what the engine read.
    """
    image_token, merge = proc.image_token_id, proc.image_processor.merge_size ** 2
    rows = [pixel_inputs(proc, s.images) if s.images else None for s in segments]
    for s, row in zip(segments, rows, strict=True):
        expected = 0 if row is None else int(row["image_grid_thw"].prod(-1).sum()) // merge
        found = s.token_ids.count(image_token)
        if found != expected:
            raise ValueError(f"segment {s.rollout_id}/{s.segment_index}: {found} image placeholder tokens, "
                             f"but its {len(s.images)} image(s) expand to {expected}")
    patches = max((len(r["pixel_values"]) for r in rows if r is not None), default=0)
    images = max(len(s.images) for s in segments)
    dim = next(r["pixel_values"].shape[-1] for r in rows if r is not None)
    batch["pixel_values"] = torch.zeros(len(rows), patches, dim)
    batch["image_grid_thw"] = torch.zeros(len(rows), images, 3, dtype=torch.long)
    for i, row in enumerate(rows):
        if row is not None:
            batch["pixel_values"][i, :len(row["pixel_values"])] = row["pixel_values"]
            batch["image_grid_thw"][i, :len(row["image_grid_thw"])] = row["image_grid_thw"]
    batch["loss_mask"][batch["input_ids"] == image_token] = 0.0


def image_inputs(mb: dict[str, torch.Tensor], image_token: int) -> dict[str, torch.Tensor]:
    """A micro-batch's images as a Qwen-VL forward takes them: patches and grids of all rows, in row
    order, and the token-type ids that mark image placeholders (for the multimodal rotary positions)."""
    grids = mb["image_grid_thw"]
    present = grids.prod(-1) > 0
    if not present.any():   # text-only rows (or padding rows) in an image batch
        return {}
    counts = grids.prod(-1).sum(-1)
    pixels = torch.cat([mb["pixel_values"][i, :int(n)] for i, n in enumerate(counts)])
    return {"pixel_values": pixels, "image_grid_thw": grids[present],
            "mm_token_type_ids": (mb["input_ids"] == image_token).int()}


def model_inputs(row: dict[str, torch.Tensor], replay: bool,
                 image_token: int | None) -> dict[str, torch.Tensor]:
    """The model's inputs for a micro-batch `row`: a padded one's ids and attention mask, or a packed one's
    ids, position ids that restart per sequence and the sequence bounds (the packing's attention takes them
    instead of a mask); the engine's routes when they are replayed, and images."""
    packed = "position_ids" in row
    keys = ("input_ids", "position_ids", "cu_seq_lens_q") if packed else ("input_ids", "attention_mask")
    if replay:
        keys += ("routed_experts",)
    images = image_inputs(row, image_token) if "image_grid_thw" in row else {}
    return {k: row[k] for k in keys if k in row} | images


def next_token_fields(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each position of a micro-batch `row` predicts, [B, T] aligned with it (the last position predicts
    nothing): the next token (`targets`: the next input, unless the batch names others in `target_ids`, as
    molt.tinker's do), whether that token is scored (`scored`: real, with a prefix in its sequence; the
    first token of a packed sequence has none) and sampled (`select`), and the distribution the engine drew
    it from (RECORDED_SAMPLING, when the segments record it)."""
    scored = (row["position_ids"] > 0).long() if "position_ids" in row else row["attention_mask"]
    fields = {"targets": row.get("target_ids", row["input_ids"]), "scored": scored,
              "select": scored * (row["loss_mask"] > 0) if "loss_mask" in row else scored}
    fields |= {k: row[k] for k in RECORDED_SAMPLING if k in row}
    return {k: torch.nn.functional.pad(v[:, 1:], (0, 1)) for k, v in fields.items()}


def inert_rows(batch: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """`count` rows shaped like `batch`'s that contribute nothing: one attended pad token, loss mask 0."""
    out = {}
    for key, value in batch.items():
        filler = torch.zeros((count, *value.shape[1:]), dtype=value.dtype, device=value.device)
        if key == "attention_mask":
            filler[:, 0] = 1
        if key == "routed_experts":
            filler[:] = torch.arange(value.shape[-1])
        out[key] = filler
    return out


def pad_rows(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """Append inert rows (`inert_rows`) so the row count divides `multiple`.

    Every rank must run the same number of forwards (FSDP all-gathers are collective), so a batch is
    split into equal row shards; the filler rows contribute nothing to losses or normalizers.
    """
    extra = -batch["input_ids"].shape[0] % multiple
    if not extra:
        return batch
    filler = inert_rows(batch, extra)
    return {key: torch.cat([value, filler[key]]) for key, value in batch.items()}


def check_token_first(batch: dict[str, torch.Tensor], segments: list[Segment]) -> None:
    """Invariant 1: every trained token was sampled by the engine and carries its logprob and version.

    Checked on the padded batch tensors (rows = segments), so it stays cheap at long contexts."""
    sampled = batch["loss_mask"] > 0
    checks = [(sampled & ((batch["versions"] == NO_VERSION) | ~batch["behaviour_logp"].isfinite()),
               "has no engine version/logprob")]
    if "temperature" in batch:
        checks.append((sampled & (batch["temperature"] < GREEDY_BELOW), "was decoded greedily"))
    for bad, why in checks:
        if bad.any():
            row, t = bad.nonzero()[0].tolist()
            s = segments[row]
            raise RuntimeError(f"rollout {s.rollout_id} segment {s.segment_index} token {t} is in the loss "
                               f"but {why}: refusing to train on it")
