"""Shared by every benchmark: model sizes, per-step summaries, ratio statistics and RESULTS.md sections.

Standard library only: bench/trl_peer.py imports this from TRL's own environment, where Molt is not
installed, and the summaries of both frameworks must be computed by the same code.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "RESULTS.md"
OUT = BENCH / "out"

# Tiny-model options per size. Vocabulary and tokenizer stay the tiny default's, so the task is the same;
# head_dim stays in vLLM's CPU-attention list (32, 64, 80, ...). Parameter counts are printed by peer.py.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "30m": dict(hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=4, head_dim=64,
                intermediate_size=1536),
    "100m": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, head_dim=64,
                 intermediate_size=2048),
}
# Bigger random-init models need a smaller step (FACTS: lr >= 2e-3 collapses even the tiny one).
LR = {"tiny": 5e-4, "30m": 1e-4, "100m": 5e-5}

LETTERS = "abcdefgh"


def summarize(steps: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Per-run numbers from per-step records {time, sampled, trained, reward[, generate]}.

    The first `warmup` steps (lazy compilation, allocator growth) are left out of the timings; the
    throughputs are total tokens over total time of the rest, not a mean of per-step rates.
    """
    timed = steps[warmup:] if len(steps) > warmup else steps[-1:]
    total = sum(s["time"] for s in timed)
    tail = steps[-min(3, len(steps)):]
    extra = {"generate_s": statistics.median(s["generate"] for s in timed)} \
        if all("generate" in s for s in timed) else {}
    return {**extra,
        "steps": len(steps),
        "timed_steps": len(timed),
        "step_s": statistics.median(s["time"] for s in timed),
        "step_s_mean": total / len(timed),
        "sampled_tok_s": sum(s["sampled"] for s in timed) / total,
        "trained_tok_s": sum(s["trained"] for s in timed) / total,
        "reward_first": steps[0]["reward"],
        "reward_last": statistics.fmean(s["reward"] for s in tail),  # mean of the last 3 steps
    }


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def fmt_spread(values: list[float], digits: int = 2) -> str:
    lo, mid, hi = spread(values)
    return f"{mid:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def machine() -> str:
    """One line: CPU model (with its family/model numbers and widest vector unit: hosts that report the same
    name differ 3x in fp32 matmul, and bf16 needs AVX512-BF16), cores, memory, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        info = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first_cpu
                                                               if ":" in line)}
        flags = set(info.get("flags", "").split())
        isa = next((name for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"),
                                            ("avx2", "AVX2")) if flag in flags), "no AVX2")
        family = f"family {info.get('cpu family')} model {info.get('model')}"
        cpu = f"{info.get('model name', cpu)} ({family}, {isa})"
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        mem = float("nan")
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def versions(python: str | os.PathLike = sys.executable,
             packages: tuple[str, ...] = ("torch", "transformers", "vllm", "ray", "trl")) -> str:
    """Installed versions of `packages` in the environment of `python` (a missing one is left out)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for p in sys.argv[1:]:\n"
            "    for dist in (p, p + '-cpu'):\n"
            "        try:\n"
            "            out[p] = m.version(dist); break\n"
            "        except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    found = json.loads(subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True,
                                      check=True).stdout)
    return ", ".join(f"{k} {v}" for k, v in found.items())


def header(extra: str = "") -> str:
    """The machine / versions / date lines every section starts with."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"- date: {now}", f"- machine: {machine()}; load average at start (1/5/15 min): {load}",
             f"- Molt env: {versions()}"]
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def write_section(name: str, body: str) -> None:
    """Replace (or append) the `<!-- bench:name -->` ... `<!-- /bench:name -->` block of RESULTS.md."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\nWritten by bench/*.py.\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS.write_text(text)


def table(head: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def param_count(model_dir: str | os.PathLike) -> int:
    """Parameters stored in a model folder's safetensors files (tied weights counted once)."""
    import struct

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for dim in info["shape"]:
                    n *= dim
                total += n
    return total


def parse_steps(text: str, sizes: list[str]) -> dict[str, int]:
    """`--steps 8` (every size) or `--steps tiny=8,30m=4,100m=3` → {size: steps}."""
    if "=" not in text:
        return {s: int(text) for s in sizes}
    given = {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    missing = [s for s in sizes if s not in given]
    if missing:
        raise SystemExit(f"--steps gives no value for size(s) {missing}")
    return given
