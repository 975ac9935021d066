"""Images in the token-first contract.

An image travels as a data URL (`data:image/png;base64,...`) holding its exact bytes: a dataset row, an
`Env` observation and a chat request all name images this way (or as a file path / raw bytes in a row,
turned into a data URL when the row is loaded). The chat template renders each image as one placeholder
token; the engine expands it to one token per merged patch and reports the expanded ids it read, which
the trajectory keeps (with the images) so the trainer's forward reads exactly the same sequence.
"""

from __future__ import annotations

import base64
import io
import mimetypes
from functools import cache
from pathlib import Path
from typing import Any

import torch

from molt.trajectory import AgentError

# Message content parts that carry an image: our own / Hugging Face's, OpenAI's, Anthropic's.
IMAGE_PART_TYPES = ("image", "image_url")


def data_url(value: Any, base_dir: Path | None = None) -> str:
    """A data URL of an image given as a data URL, raw bytes, or a file path (relative to `base_dir`)."""
    if isinstance(value, str) and value.startswith("data:image/"):
        return value
    if isinstance(value, bytes | bytearray):
        raw, mime = bytes(value), "image/png"
    elif isinstance(value, str | Path):
        path = Path(value).expanduser()
        path = path if path.is_absolute() or base_dir is None else base_dir / path
        if not path.is_file():
            raise ValueError(f"image file not found: '{value}' (looked at {path})")
        raw, mime = path.read_bytes(), mimetypes.guess_type(path.name)[0] or "image/png"
    else:
        raise ValueError(f"an image must be a data URL, bytes or a file path, got {type(value).__name__}")
    url = f"data:{mime};base64,{base64.b64encode(raw).decode()}"
    decode(url)  # fail at load time, not inside an engine
    return url


def image_of(part: dict) -> Any | None:
    """The image a content part carries (None for a text part), in any of the accepted shapes."""
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if kind == "image":
        source = part.get("source")
        if isinstance(source, dict):   # Anthropic: {"type": "base64", "media_type": ..., "data": ...}
            if source.get("type") != "base64":
                raise ValueError(f"image source type '{source.get('type')}' is not supported (use base64)")
            return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        return part.get("image")
    return None


def normalize(messages: list[dict], base_dir: Path | None = None) -> tuple[list[dict], list[str]]:
    """Messages with every image part as {"type": "image", "image": <data URL>} (the shape chat
    templates render as a vision placeholder), and the images' data URLs in order of appearance."""
    images, out = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    url = data_url(image_of(part), base_dir)
                    images.append(url)
                    part = {"type": "image", "image": url}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


def decode(url: str) -> Any:
    """The PIL image of a data URL, in RGB."""
    from PIL import Image

    try:
        raw = base64.b64decode(url.split(",", 1)[1], validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except Exception as err:
        raise AgentError(f"not a readable image data URL ({url[:40]}...): {err}") from None


def is_vision_model(path: str, trust_remote_code: bool = False) -> bool:
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "vision_config",
                   None) is not None


def collapse(ids: list[int], image_token: int) -> list[int]:
    """`ids` with every run of image placeholders cut to one: the form the engine expands itself."""
    return [t for i, t in enumerate(ids) if t != image_token or i == 0 or ids[i - 1] != image_token]


@cache
def processor(path: str, trust_remote_code: bool) -> Any:
    """The model's own processor (its image processor is the one the engine runs on the same bytes)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


def pixel_inputs(proc: Any, images: list[str]) -> dict[str, torch.Tensor]:
    """pixel_values [patches, dim] and image_grid_thw [images, 3] of `images` by processor `proc`."""
    out = proc.image_processor(images=[decode(u) for u in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"]}
