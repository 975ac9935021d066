"""The inspector's page in a real browser: how fast a big step opens, and whether a long rollout scrolls.

    python bench/inspect_page.py                      # both measurements, written to RESULTS.md (inspect)
    python bench/inspect_page.py --quick              # smaller inputs, printed only
    python bench/inspect_page.py --screenshot RUN_DIR OUT.png [--rollout ID] [--channel gap]

Synthetic dumps in the loop's format (random ids of the tiny model's vocabulary, a prompt, two sampled turns
with an observation between, the trainer's side of every trained token): a step of 64 rollouts x 512 tokens
and a step of one 32K-token rollout. `python -m molt.inspect` writes each page; Debian's headless chromium
(Playwright) opens it. Open: from navigation to the page's first rollout drawn (`window.moltReady`, the
page's own clock), over fresh loads. Scroll: the token view scrolled top to bottom, 300 px per frame;
the gaps between animation frames and the long tasks (> 50 ms) the browser reports are what a user feels
as freezing; the token spans in the DOM at the end show that only what is near the screen is drawn.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, table, write_section  # noqa: E402

from molt.driver.compose import compose  # noqa: E402
from molt.driver.inspect import HEADLESS_CHROMIUM_ARGS, build_page  # noqa: E402
from molt.driver.metrics import TRAINER_KEY  # noqa: E402
from molt.spec.config import spec_yaml  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
VOCAB = 320   # the tiny model's


def synthetic_rollout(rng: random.Random, i: int, group: str, length: int) -> dict:
    """One dumped rollout line of `length` tokens: 1/8 prompt, a sampled turn, 1/16 observation, a second
    turn; the trainer's side on every sampled token."""
    prompt, obs = length // 8, length // 16
    turn1 = (length - prompt - obs) // 2
    mask = [0] * prompt + [1] * turn1 + [0] * obs + [1] * (length - prompt - turn1 - obs)
    ids = [rng.randrange(3, VOCAB) for _ in range(length)]
    lp = [-rng.random() * 6 if m else 0.0 for m in mask]
    seg = {"token_ids": ids, "loss_mask": mask, "logprobs": lp, "versions": [3 if m else -1 for m in mask],
           "rollout_id": f"{group}-{i}", "group_id": group, "segment_index": 0, "prompt_len": prompt,
           "finish_reason": "stop", "routed_experts": None, "sampling": [], "images": [],
           "turns": [[0, prompt], [1, prompt + turn1 + obs]]}
    trained = {"segment_index": 0, "input_ids": ids, "loss_mask": mask,
               "logprobs": [x + rng.gauss(0, 1e-6) if m else 0.0 for x, m in zip(lp, mask, strict=True)],
               "advantages": [0.7 if m else 0.0 for m in mask], "weights": [1.0 if m else 0.0 for m in mask],
               "decisions": mask, "entropy": [rng.random() * 5 if m else 0.0 for m in mask]}
    return {"rollout_id": f"{group}-{i}", "group_id": group, "segments": [seg], "reward": rng.random(),
            "score": None, "label": "a", "info": {}, "error": None, "turns": 2, "tool_calls": 1,
            "tool_errors": 0, "answered": True, "turn_rewards": [],
            TRAINER_KEY: {"decision": "kept", "version": 3, "segments": [trained]}}


def synthetic_run(root: Path, rollouts: int, length: int) -> Path:
    spec = compose([])
    root.mkdir(parents=True)
    (root / "spec.yaml").write_text(spec_yaml(spec))
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10,
                                                            "mismatch/max_abs": 1e-6}) + "\n"
                                                for s in range(1, 11)))
    (root / "rollouts").mkdir()
    rng = random.Random(0)
    lines = [synthetic_rollout(rng, i % 8, f"g{i // 8}", length) for i in range(rollouts)]
    (root / "rollouts" / "step_000010.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root


def browser(p, profile: Path, width: int = 1500, height: int = 900):
    return p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM,
                                                args=list(HEADLESS_CHROMIUM_ARGS), headless=True,
                                                viewport={"width": width, "height": height})


def open_times(context, page_file: Path, loads: int) -> list[float]:
    """Seconds from navigation to the first rollout drawn, per fresh load."""
    out = []
    for _ in range(loads):
        page = context.new_page()
        page.goto(page_file.as_uri())
        page.wait_for_function("window.moltReady !== undefined")
        out.append(page.evaluate("window.moltReady") / 1000)
        page.close()
    return out


SCROLL = """async () => {
  const view = document.getElementById("tokens"), gaps = [], long = [];
  new PerformanceObserver((l) => { for (const e of l.getEntries()) long.push(e.duration); })
    .observe({type: "longtask", buffered: false});
  let last = performance.now(), spans = 0;
  const t0 = last;
  while (view.scrollTop + view.clientHeight < view.scrollHeight - 1) {
    view.scrollTop += 300;
    await new Promise((r) => requestAnimationFrame(r));
    const now = performance.now(); gaps.push(now - last); last = now;
    spans = Math.max(spans, view.querySelectorAll(".t").length);
  }
  await new Promise((r) => setTimeout(r, 100));
  return {frames: gaps.length, seconds: (last - t0) / 1000, max_gap_ms: Math.max(...gaps),
          p95_gap_ms: gaps.sort((a, b) => a - b)[Math.floor(gaps.length * 0.95)], long_tasks: long.length,
          longest_task_ms: long.length ? Math.max(...long) : 0, max_spans: spans,
          height_px: view.scrollHeight};
}"""


def measure(quick: bool) -> str:
    from playwright.sync_api import sync_playwright

    rollouts, length, long = (16, 256, 8192) if quick else (64, 512, 32768)
    loads = 2 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_page(synthetic_run(tmp / "warm-up", 2, 16))   # imports and the tokenizer's first load
        t0 = time.perf_counter()
        step_page = build_page(synthetic_run(tmp / "step", rollouts, length))
        build_step = time.perf_counter() - t0
        t0 = time.perf_counter()
        long_page = build_page(synthetic_run(tmp / "long", 1, long))
        build_long = time.perf_counter() - t0
        with sync_playwright() as p:
            context = browser(p, tmp / "profile")
            step_open = open_times(context, step_page, loads)
            long_open = open_times(context, long_page, loads)
            page = context.new_page()
            page.goto(long_page.as_uri())
            page.wait_for_function("window.moltReady !== undefined")
            scroll = page.evaluate(SCROLL)
            context.close()
        sizes = [f"{path.stat().st_size / 2**20:.1f}" for path in (step_page, long_page)]
    rows = [[f"{rollouts} rollouts x {length} tokens", sizes[0], f"{build_step:.2f}",
             f"{statistics.median(step_open):.3f} (max {max(step_open):.3f})", "–", "–", "–"],
            [f"1 rollout x {long} tokens", sizes[1], f"{build_long:.2f}",
             f"{statistics.median(long_open):.3f} (max {max(long_open):.3f})",
             f"{scroll['frames']} frames in {scroll['seconds']:.1f} s: max {scroll['max_gap_ms']:.0f} ms, "
             f"p95 {scroll['p95_gap_ms']:.0f} ms",
             f"{scroll['long_tasks']} (longest {scroll['longest_task_ms']:.0f} ms)",
             f"{scroll['max_spans']} of {long}"]]
    head = ["page (one step)", "MiB", "build_page s (warm)", f"open s, median of {loads} loads",
            "scroll top to bottom, 300 px/frame: frame gaps", "long tasks > 50 ms", "token spans in the DOM"]
    return table(head, rows)


def screenshot(run_dir: Path, out: Path, rollout: str | None, channel: str, step: int | None) -> None:
    """The page of `run_dir` (one step) with `rollout` open, coloured by `channel`, as a PNG."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_file = build_page(run_dir, [step] if step else None, Path(tmp) / "page.html")
        with sync_playwright() as p:
            context = browser(p, Path(tmp) / "profile", 1400, 820)
            page = context.new_page()
            page.goto(page_file.as_uri())
            page.wait_for_function("window.moltReady !== undefined")
            if rollout:
                find = f"D.steps[S.step].rollouts.findIndex((r) => r.id === {json.dumps(rollout)})"
                index = page.evaluate(find)
                page.click(f'.chips button[data-rollout="{index}"]')
            page.click(f'button[data-channel="{channel}"]')
            page.screenshot(path=str(out))
            context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller pages, print only")
    parser.add_argument("--screenshot", nargs=2, metavar=("RUN_DIR", "OUT_PNG"),
                        help="instead: a screenshot of a real run's page")
    parser.add_argument("--rollout", help="with --screenshot: the rollout id to open")
    parser.add_argument("--step", type=int, help="with --screenshot: the step (default: the last dumped)")
    parser.add_argument("--channel", default="gap", help="with --screenshot: the colour channel")
    args = parser.parse_args()
    if args.screenshot:
        screenshot(Path(args.screenshot[0]), Path(args.screenshot[1]), args.rollout, args.channel, args.step)
        return
    body = measure(args.quick)
    print(body)
    if not args.quick:
        write_section("inspect", "## The inspector's page in a real browser\n\n" + header(
            f"- browser: Debian's chromium (headless, {' '.join(HEADLESS_CHROMIUM_ARGS[1:4])} ...) driven by "
            "Playwright\n- command: `python bench/inspect_page.py`") + "\n\n" + body)


if __name__ == "__main__":
    main()
