"""bench/gpu_smoke.py's named checks of the GPU-only refit and trainer branches (docs/parallelism.md's
GPU-only column), each printing one `CHECK name: PASS|FAIL  <what it measured>` line.

Engine checks run one vLLM engine on GPU 0 (Ray sees one GPU) while this process stands in for trainer
rank 0 on GPU 1 and broadcasts over the NCCL refit group, through the engine's own receive path
(`Dispatcher.join_refit`, `EngineActor.update_weights`). Trainer checks place 2 ranks on the 2 GPUs
(`TrainerRanks`, as a run does). `plan_checks` is their CPU part: the specs compose and are accepted,
the models build and hold what the checks rely on; tests/test_bench.py runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from gpu_smoke_models import bias_name, fp8_copy, fp8_tensors, image_batch, load_weights, tiny_deepseek_v3

GREEDY = {"temperature": 0.0, "max_tokens": 32}
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 8], list(range(3, 163))]   # the last spans several KV blocks
REFIT_GAP = 1e-3       # a refit engine against one started on the same weights (bf16 kernels, same inputs)
CP_GAP = 1e-4          # fp32 cp=2 against cp=1: the same attention kernel on half the heads (a first bound)


def report(name: str, ok: bool, measured: str) -> list[str]:
    """Print the check's line; the failures list for the summary."""
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'}  {measured}", flush=True)
    return [] if ok else [f"{name}: {measured}"]


def sender(spec: Any) -> torch.device:
    """Where this process sends from (or receives on): GPU 1 on cuda. On cpu (the checks' CPU runs in
    tests/test_bench.py) the same code runs on the host over gloo."""
    return torch.device("cuda", 1) if spec.parallel.device == "cuda" else torch.device("cpu")


@contextlib.contextmanager
def cluster(gpus: int) -> Iterator[None]:
    """A private local Ray with `gpus` GPUs: 1 leaves GPU 1 to this process (the sender), 2 gives both to
    trainer ranks (on a machine without GPUs Ray only counts them)."""
    import ray

    if ray.is_initialized():   # the test session's (CPU runs only)
        yield
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")   # a private local cluster, as molt's own
    ray.init(num_gpus=gpus, num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def payload_sizes() -> Iterator[list[int]]:
    """The byte sizes of the uint8 tensors (headers and payloads) broadcast on the refit wire meanwhile."""
    from molt import refit

    sizes: list[int] = []
    broadcast = refit._broadcast

    def recorded(group: Any, tensor: torch.Tensor) -> None:
        if tensor.dtype == torch.uint8:
            sizes.append(tensor.numel())
        broadcast(group, tensor)

    refit._broadcast = recorded
    try:
        yield sizes
    finally:
        refit._broadcast = broadcast


def start(spec: Any, path: Path) -> Any:
    import ray

    from molt.rollout.engine import start_engine

    engine = start_engine(spec, str(path), 0)
    ray.get(engine.ready.remote(), timeout=spec.rollout.engine.start_timeout_s)
    return engine


def stop(engine: Any) -> None:
    """Shut vLLM down (on a GPU: free its memory) before the next engine of the check starts, then the
    actor: a killed actor's process may still hold the memory the next engine's profiling counts."""
    import ray

    ray.get(engine.shutdown.remote(), timeout=120)
    ray.kill(engine)


def refit_engine(engine: Any, tensors: dict[str, torch.Tensor], chunk_bytes: int,
                 device: torch.device) -> Any:
    """Broadcast `tensors` (checkpoint names) from `device` to `engine` as version 1 over a refit group
    formed for it (the engine's workers close the one they were in); returns the group."""
    import ray

    from molt import refit
    from molt.rollout.dispatch import Dispatcher

    dispatcher = Dispatcher([engine])

    async def connect() -> Any:
        size = await dispatcher.refit_size()
        store = refit.listen("127.0.0.1", size)
        opened = asyncio.to_thread(refit.host_group, store, size, device)
        return (await asyncio.gather(opened, dispatcher.join_refit("127.0.0.1", store.port)))[0]

    group = asyncio.run(connect())
    receiving = engine.update_weights.remote(1)
    refit.send(group, [{k: v.to(device) for k, v in tensors.items()}], device, chunk_bytes)
    ray.get(receiving)
    return group


def greedy(engine: Any) -> list[dict]:
    """PROMPTS' greedy generations, one request at a time: batched together, which requests share a step
    depends on timing, and another batch shape can round differently and flip a near-tie (seen on CPU)."""
    import ray

    return [ray.get(engine.generate.remote(p, GREEDY)) for p in PROMPTS]


def gap(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """(same greedy tokens, max |logprob difference| over each generation's tokens up to and including the
    first one that differs: after it the two score different sequences)."""
    same, worst = True, 0.0
    for x, y in zip(a, b, strict=True):
        for p, q, s, t in zip(x["logprobs"], y["logprobs"], x["token_ids"], y["token_ids"], strict=False):
            worst = max(worst, abs(p - q))
            if s != t:
                break
        same = same and x["token_ids"] == y["token_ids"]
    return same, worst


def engine_refit(name: str, spec: Any, path: Path, new: Path, chunk_mb: float) -> list[str]:
    """Item 1 on the engine side (and item 10 for a MoE with router replay): an engine refit over NCCL
    with perturbed weights, in payloads of `chunk_mb` that split its larger tensors, generates (greedy)
    the tokens of an engine started on those weights, logprobs within REFIT_GAP. For a MoE, the routes
    each generation returns after the refit equal a re-scoring of its tokens under the new weights.
    Item 13: that refit goes over a re-formed group: a first one (the starting weights) is aborted on
    both sides (here, and by the engine's workers as they join the next) before the second forms."""
    import ray

    from molt import refit

    weights, dtype = load_weights(new), getattr(torch, spec.model.dtype)
    chunk_bytes = int(chunk_mb * 2**20)
    with cluster(1):
        engine = start(spec, path)
        t0 = time.perf_counter()
        refit.close_group(refit_engine(engine, {k: v.to(dtype) for k, v in load_weights(path).items()},
                                       chunk_bytes, sender(spec)))
        with payload_sizes() as sizes:
            refit_engine(engine, {k: v.to(dtype) for k, v in weights.items()}, chunk_bytes, sender(spec))
        both = time.perf_counter() - t0
        refitted = greedy(engine)
        routes = None
        if spec.model.router_replay:
            rescored = ray.get(engine.capture_routes.remote([p + o["token_ids"] for p, o in
                                                             zip(PROMPTS, refitted, strict=True)]))
            # rows from the last prompt token on: the inputs the sampled tokens were computed from
            pairs = [(o["routed_experts"][len(p) - 1:], r[len(p) - 1:])
                     for p, o, r in zip(PROMPTS, refitted, rescored, strict=True)]
            routes = sum(int((a == b).sum()) for a, b in pairs) / sum(a.size for a, _ in pairs)
        stop(engine)
        fresh = greedy(start(spec, new))
    same, worst = gap(refitted, fresh)
    split = sum(t.numel() * t.element_size() > chunk_bytes for t in (v.to(dtype) for v in weights.values()))
    failed = report(f"item1_engine_refit_{name}", same and worst <= REFIT_GAP and max(sizes) <= chunk_bytes,
                    f"{split} tensors larger than the {chunk_mb:g} MiB chunk, largest payload "
                    f"{max(sizes) / 2**20:.2f} MiB; vs a fresh engine: same greedy tokens {same}, max "
                    f"logprob gap {worst:.2e} (bound {REFIT_GAP:g})")
    failed += report(f"item13_reformed_group_{name}", same and worst <= REFIT_GAP,
                     f"the refit above went over a re-formed group (the first aborted on both sides); "
                     f"both refits with the re-form took {both:.1f} s")
    if routes is not None:
        failed += report(f"item10_routes_after_refit_{name}", routes >= 0.99,
                         f"{routes:.4f} of the generated tokens' route entries equal a re-scoring under the "
                         "new weights (bound 0.99: decode and prefill kernels may break near-ties apart)")
    return failed


def refit_ranges(spec: Any) -> list[str]:
    """Item 1 on the trainer side: 2 FSDP ranks stream their sharded weights to a receiver here (GPU 1,
    beside rank 1, which is not in the refit group) in payloads of at most rollout.refit_chunk_mb; tensors
    larger than that are gathered a range of rows at a time over NCCL. Every tensor arrives bit-equal to
    the checkpoint in model.dtype, and the receiver's peak memory stays one tensor + a few payloads."""
    from molt import refit
    from molt.plan.models import model_path
    from molt.trainer.ranks import TrainerRanks

    device, chunk_bytes = sender(spec), int(spec.rollout.refit_chunk_mb * 2**20)
    cuda = device.type == "cuda"
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    with cluster(2):
        ranks = TrainerRanks(spec)
        host, port = ranks.host_refit(2)

        def receive() -> None:
            try:
                group = refit.open_group(host, port, 1, 2, device)
                got.update((n, t.cpu()) for n, t in refit.receive(group, device))
            except BaseException as err:   # reported below
                errors.append(err)

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        receiver = threading.Thread(target=receive, daemon=True)
        with payload_sizes() as sizes:
            receiver.start()
            ranks.join_refit(2)
            ranks.send_weights()
            receiver.join(timeout=600)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0   # (not measured on the host)
        ranks.shutdown()
    dtype = getattr(torch, spec.model.dtype)
    want = {k: v.to(dtype) for k, v in load_weights(Path(model_path(spec))).items()}
    largest = max(t.numel() * t.element_size() for t in want.values())
    equal = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    payload = max(sizes, default=0)
    ok = not errors and equal and payload <= chunk_bytes and peak <= largest + 4 * chunk_bytes
    return report("item1_trainer_ranges", ok,
                  f"{errors[0] if errors else ''}{len(got)} of {len(want)} tensors bit-equal {equal}; "
                  f"largest tensor {largest / 2**20:.1f} MiB, largest payload {payload / 2**20:.2f} MiB "
                  f"(cap {chunk_bytes / 2**20:g}); receiver peak {peak / 2**20:.1f} MiB (bound: largest "
                  "tensor + 4 payloads)")


def vlm_no_image_rank(spec: Any, timeout_s: float, name: str = "item5_vlm_rank_without_image") -> list[str]:
    """Item 5: a VLM on 2 cuda ranks, whose rank 1 micro-batch holds no image, completes a training step
    within `timeout_s`: with model.freeze_vision the tower is one unit every rank gathers; trained, it is
    sharded per block and rank 1 runs it on a placeholder (molt/trainer/tower.py), or rank 0 would wait in
    gathers rank 1 never joins, until NCCL's 10-minute watchdog."""
    from molt.plan.models import model_path
    from molt.trainer.ranks import TrainerRanks

    batch, result, errors = image_batch(model_path(spec)), {}, []
    with cluster(2):
        ranks = TrainerRanks(spec)

        def step() -> None:
            try:
                result.update(ranks.update(batch))
            except BaseException as err:   # reported below
                errors.append(err)

        t0 = time.perf_counter()
        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(timeout=timeout_s)
        seconds = time.perf_counter() - t0
        if not thread.is_alive():
            ranks.shutdown()
    norm = result.get("train/grad_norm", float("nan"))
    ok = not thread.is_alive() and not errors and math.isfinite(norm) and norm > 0
    what = ("no step within the timeout (a hang)" if thread.is_alive() else
            f"{errors[0]}" if errors else f"loss {result.get('train/loss', float('nan')):.4f}, grad norm "
            f"{norm:.3g}")
    return report(name, ok, f"{what}; {seconds:.1f} s (timeout {timeout_s:g} s)")


def context_parallel_ranks(spec: Any) -> list[str]:
    """Context parallel on cuda: cp_size=2 over the 2 GPUs (each rank half of every row's positions; the
    attention's all-to-alls over NCCL, then sdpa's CUDA kernel on half the heads) against one GPU at cp=1, in
    fp32 on ragged rows: the sampled tokens' logprobs, one update's loss and gradient norm within CP_GAP."""
    from packing import ragged_batch

    from molt.trainer.ranks import TrainerRanks

    batch, out = ragged_batch(8, 17, 300), {}
    with cluster(2):
        for cp in (1, 2):
            ranks = TrainerRanks(spec.model_copy(update={"parallel": spec.parallel.model_copy(
                update={"cp_size": cp})}))
            out[cp] = ranks.logprobs(batch), ranks.update(batch)
            ranks.shutdown()
    sampled = batch["loss_mask"] > 0
    gap = float((out[1][0] - out[2][0])[sampled].abs().max())
    loss, norm = (abs(out[1][1][k] - out[2][1][k]) for k in ("train/loss", "train/grad_norm"))
    ok = max(gap, loss, norm / out[1][1]["train/grad_norm"]) <= CP_GAP
    return report("cp_trainer", ok, f"logprob gap {gap:.2e}, loss gap {loss:.2e}, grad norm {norm:.2e} of "
                  f"{out[1][1]['train/grad_norm']:.3g} (bound {CP_GAP:g})")


def _engine_tensors(worker: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """Runs inside the engine's vLLM worker (collective_rpc with a function): its tensors named `names`."""
    model = worker.model_runner.get_model()
    found = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: found[n].detach().cpu() for n in names if n in found}


def fp32_buffer(spec: Any, path: Path, out: Path) -> list[str]:
    """Item 11: DeepSeek-V3's fp32 `e_score_correction_bias` (new values bf16 cannot hold) refit beside
    perturbed parameters in model.dtype arrives in the engine bit-equal, and the refit engine generates
    what an engine started on the new weights generates (MLA's absorbed projections are derived from
    `kv_b_proj` when weights load: a refit must derive them again)."""
    import ray
    from gpu_smoke_models import perturbed_copy
    from safetensors.torch import save_file

    new = perturbed_copy(path, out / "dsv3_new", scale=0.5)
    weights = load_weights(new)
    bias = bias_name(weights)
    weights[bias] = load_weights(path)[bias] + torch.arange(weights[bias].numel()) / 8192
    save_file(weights, str(new / "model.safetensors"), metadata={"format": "pt"})
    dtype = getattr(torch, spec.model.dtype)
    tensors = {k: v if k == bias else v.to(dtype) for k, v in weights.items()}   # as weights.py sends
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # `_engine_tensors` travels by value
    with cluster(1):
        engine = start(spec, path)
        refit_engine(engine, tensors, int(spec.rollout.refit_chunk_mb * 2**20), sender(spec))
        [held] = ray.get(engine.collective_rpc.remote(_engine_tensors, ([bias],)))
        refitted = greedy(engine)
        stop(engine)
        fresh = greedy(start(spec, new))
    engine_bias = held.get(bias)
    rounding = float((tensors[bias] - tensors[bias].bfloat16().float()).abs().max())
    same, worst = gap(refitted, fresh)
    ok = engine_bias is not None and engine_bias.dtype == torch.float32 and torch.equal(engine_bias,
                                                                                        tensors[bias])
    what = "not found in the engine" if engine_bias is None else (
        f"engine holds {engine_bias.dtype}, max |engine - sent| "
        f"{float((engine_bias.float() - tensors[bias]).abs().max()):.2e}")
    return report("item11_fp32_buffer", ok and same and worst <= REFIT_GAP,
                  f"{bias}: {what} (a bf16 cast would be off by {rounding:.2e}); vs a fresh engine: same "
                  f"greedy tokens {same}, max logprob gap {worst:.2e} (bound {REFIT_GAP:g})")


def fp8_refit(spec: Any, dense: Path, out: Path, max_abs: float) -> list[str]:
    """Item 9: an engine started on a block-FP8 checkpoint takes a refit of bf16 weights quantized by
    molt/trainer/fp8.py (weights and scales). After it, it generates what an engine started on an FP8
    checkpoint of the same quantized weights generates (logprobs within REFIT_GAP), and its logprobs stay
    within `max_abs` of a bf16 forward of the unquantized new weights (the trainer's view)."""
    from gpu_smoke_models import perturbed_copy
    from transformers import AutoModelForCausalLM

    from molt.trainer.fp8 import checkpoint_fp8, quantize_chunk

    new = perturbed_copy(dense, out / "fp8_new_bf16", scale=0.5)
    start_path, fresh_path = Path(spec.model.path), fp8_copy(new, out / "fp8_new")
    weights = {k: v.to(torch.bfloat16) for k, v in load_weights(new).items()}
    with cluster(1):
        engine = start(spec, start_path)
        before = greedy(engine)
        refit_engine(engine, quantize_chunk(weights, checkpoint_fp8(str(start_path))),
                     int(spec.rollout.refit_chunk_mb * 2**20), sender(spec))
        refitted = greedy(engine)
        stop(engine)
        fresh = greedy(start(spec, fresh_path))
    device = sender(spec)
    trainer = AutoModelForCausalLM.from_pretrained(new, dtype=torch.bfloat16).to(device).eval()
    worst = 0.0
    for prompt, o in zip(PROMPTS, refitted, strict=True):
        with torch.no_grad():
            logits = trainer(torch.tensor([prompt + o["token_ids"]], device=device)).logits[0].float()
        rows = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
        sampled = rows.gather(1, torch.tensor(o["token_ids"], device=device)[:, None])[:, 0].cpu()
        worst = max(worst, float((torch.tensor(o["logprobs"]) - sampled).abs().max()))
    same, to_fresh = gap(refitted, fresh)
    _, moved = gap(before, refitted)
    ok = same and to_fresh <= REFIT_GAP and worst <= max_abs
    return report("item9_fp8_refit", ok,
                  f"vs a fresh FP8 engine: same greedy tokens {same}, max logprob gap {to_fresh:.2e} (bound "
                  f"{REFIT_GAP:g}); vs the bf16 weights (transformers): max gap {worst:.3f} (bound "
                  f"{max_abs:g}); the refit moved logprobs by up to {moved:.3f}")


def plan_checks(specs: dict[str, Any], paths: dict[str, Path]) -> list[str]:
    """The CPU part of each item check: what its GPU run relies on, checked here; returns the problems.
    `specs` / `paths`: the composed spec and model folder of each check (gpu_smoke.item_specs)."""
    from molt.trainer.fp8 import FP8, checkpoint_fp8, quantize_chunk
    from molt.trainer.model import automodel_kwargs

    problems = []
    chunk = int(specs["item1"].rollout.refit_chunk_mb * 2**20)
    sizes = [t.numel() * 2 for t in load_weights(paths["item1"]).values()]
    if not sum(s > chunk for s in sizes):
        problems.append(f"item1: no tensor of the model exceeds the {chunk} B chunk")
    grids = image_batch(str(paths["item5"]))["image_grid_thw"]
    if not (grids[:2].prod(-1).sum() > 0 and grids[2:].prod(-1).sum() == 0):
        problems.append("item5: the batch's second half (rank 1) must hold no image, the first half some")
    if "freeze_config" not in automodel_kwargs(specs["item5"], "policy", str(paths["item5"])):
        problems.append("item5: the GPU loader is not asked to freeze the tower before it shards")
    fp8 = checkpoint_fp8(str(paths["item9"]))
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_weights(paths["item9_dense"]).items()}
    sent, stored = quantize_chunk(bf16, fp8), load_weights(paths["item9"])
    if fp8 is None or not fp8[0] or sorted(sent) != sorted(stored) or not all(
            torch.equal(sent[k].view(torch.uint8) if sent[k].dtype == FP8 else sent[k],
                        stored[k].view(torch.uint8) if stored[k].dtype == FP8 else stored[k]) for k in sent):
        problems.append("item9: the refit's quantization differs from the FP8 checkpoint's tensors")
    if sorted(fp8_tensors(bf16)) != sorted(stored):
        problems.append("item9: the FP8 folder's tensors are not fp8_tensors of its weights")
    if not (specs["item10"].model.router_replay and not specs["item10"].rollout.partial_rollout):
        problems.append("item10: the MoE check must run router replay without partial rollouts")
    from molt.trainer.context_parallel import CP_ATTENTION

    loader = automodel_kwargs(specs["cp"], "policy", str(paths["cp"]))
    if specs["cp"].parallel.cp_size != 2 or loader.get("attn_implementation") != CP_ATTENTION:
        problems.append("cp: the GPU loader must load the HF classes with the context-parallel attention")
    weights = load_weights(paths["item11"])
    bias = weights[bias_name(weights)]
    if bias.dtype != torch.float32 or torch.equal(bias, bias.bfloat16().float()):
        problems.append("item11: the DeepSeek-V3 bias must be fp32 values that bf16 rounds")
    return problems


def build_models(out: Path, dense: Path) -> dict[str, Path]:
    """The folders the item checks start from (tiny_deepseek_v3, the FP8 copy of `dense`)."""
    return {"item9": fp8_copy(dense, out / "fp8_start"), "item11": tiny_deepseek_v3(out / "dsv3")}
