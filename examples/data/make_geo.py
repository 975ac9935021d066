"""Procedural geometry diagrams: a triangle with two labelled angles; the question asks for the third.

`python examples/data/make_geo.py` writes geo/NNNN.png and geo_train.jsonl / geo_eval.jsonl beside this
file (deterministic: seed 0). Each row is a chat message with the diagram as an image part (a path
relative to the JSONL file) and the question as text; the label is the third angle in degrees.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

QUESTION = "Two angles of the triangle are given. What is the third angle in degrees?"
SIZE = 160


def triangle(rng: random.Random) -> tuple[list[tuple[float, float]], list[int]]:
    """Vertices (in pixels, fitted to the canvas) and integer angles (degrees) of a random triangle."""
    a = rng.randint(25, 100)
    b = rng.randint(25, 155 - a)
    # base from (0, 0) to (1, 0); the apex where the rays at angles a and b meet
    ta, tb = math.tan(math.radians(a)), math.tan(math.radians(b))
    x = tb / (ta + tb)
    points = [(0.0, 0.0), (1.0, 0.0), (x, x * ta)]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    scale = (SIZE - 40) / max(max(xs) - min(xs), max(ys) - min(ys))
    fitted = [(20 + (px - min(xs)) * scale, SIZE - 20 - (py - min(ys)) * scale) for px, py in points]
    return fitted, [a, b, 180 - a - b]


def draw(points: list[tuple[float, float]], angles: list[int], hidden: int) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    pen.polygon(points, outline="black", width=2)
    cx, cy = sum(p[0] for p in points) / 3, sum(p[1] for p in points) / 3
    for i, ((px, py), angle) in enumerate(zip(points, angles, strict=True)):
        text = "?" if i == hidden else f"{angle}"
        # labels sit inside the triangle, a third of the way from each vertex to the centroid
        pen.text((px + (cx - px) * 0.35 - 6, py + (cy - py) * 0.35 - 5), text, fill="black")
    return image


def write(out: Path, name: str, count: int, rng: random.Random, first: int) -> None:
    rows = []
    for k in range(first, first + count):
        points, angles = triangle(rng)
        hidden = rng.randrange(3)
        image = f"geo/{k:04d}.png"
        draw(points, angles, hidden).save(out / image, optimize=True)
        content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
        rows.append({"messages": [{"role": "user", "content": content}], "label": str(angles[hidden])})
    (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(__file__).resolve().parent
    (out / "geo").mkdir(exist_ok=True)
    rng = random.Random(args.seed)
    write(out, "geo_train.jsonl", args.train, rng, 0)
    write(out, "geo_eval.jsonl", args.eval, rng, args.train)


if __name__ == "__main__":
    main()
