"""The first command on a one-GPU machine: the trainer side of Molt's CUDA branches, in under 8 minutes.

    python bench/gpu_one.py [--out DIR]       # on the GPU machine (docs/install.md#a-one-gpu-machine)
    python bench/gpu_one.py --plan            # the same checks on the host, small model (CI runs this)

ASSUMPTIONS (checked first; it stops with exit code 2 and says which one failed):
- one CUDA GPU with bf16 and >= 40 GiB (an H100 or H200), torch with CUDA, an NVIDIA driver that torch's
  CUDA needs (>= 580 for CUDA 13 builds), transformers 5.x, numpy. No vLLM, no Ray, no network: every model
  is random-init, built here. This checkout on PYTHONPATH with hydra-core, omegaconf, pydantic, antlr4 (and
  optionally nemo-automodel) installed into a target folder (docs/install.md says how).
- The check on the host (--plan) runs the same functions with device=cpu, gloo for NCCL and /dev/shm for
  CUDA IPC, on a 2-layer model with a 1,024-token vocabulary; tests/test_bench.py runs it.

WHAT IT CHECKS; each check prints one `CHECK name: PASS|FAIL|SKIP  <what it measured>` line, and the
summary goes to --out/summary.json (exit 1 when one fails). The model is Qwen3-0.6B's shape (28 layers,
hidden 1024, the real 151,936-token vocabulary, tied head), random-init, fp32 master weights, bf16 compute:
- fsdp2_step: the model under FSDP2 (torch's fully_shard over a one-rank NCCL mesh, bf16 parameters, fp32
  reductions; AutoModel's parallelizer returns a one-rank model unsharded, reported) trains one AdamW step
  like the unsharded model under bf16 autocast (a one-GPU run's path): loss within 1e-2.
- memory_vs_plan: the measured peak of a training step of the one-GPU path (Molt's chunked logprobs, 8 rows
  of 1,024 tokens) beside the dry run's trainer estimate (molt/plan/memory.py, parallel=gpu1): within 15%.
- chunked_logprobs: the trainer's chunked logprobs (and their gradient) equal whole ones under bf16
  autocast, at temperature 0.7 with top-k and top-p.
- fp8_refit_packing: molt/trainer/fp8.py's block quantization of CUDA tensors equals the host's bit for bit,
  and FP8 tensors with their scales cross the refit wire (two threads, a gloo group, CUDA payloads) intact.
- fp32_buffer_cast: the refit stream (molt/trainer/weights.py) of a model on the GPU sends parameters in
  bf16 and a persistent fp32 buffer (DeepSeek-V3's e_score_correction_bias) in fp32, bit-equal.
- nccl_group_abort: a one-rank NCCL refit group streams, is aborted (`molt.refit.close_group`), and a new
  one forms and streams.
- ipc_refit: the colocated refit (parallel.colocate): a second process on this GPU receives a stream over
  the shared transport (CUDA IPC handles, UUID-checked), every tensor bit-equal.
- topk_topp_mirror: the trainer's top-k/top-p (`vllm_truncation`) on CUDA keeps the tokens vLLM's GPU sampler
  (its Triton kernel) keeps, where vLLM imports; without vLLM (this machine's image) SKIP, and the mirror on
  CUDA is compared with itself on the host.
It also prints the step's throughput per GPU and stage (molt/driver/throughput.py: logprobs, training).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def map_conf() -> None:
    """The checkout's conf/ as the package molt.conf, as the editable install maps it (pyproject.toml's
    package-dir): on the GPU machine Molt runs from the checkout on PYTHONPATH, not installed."""
    import importlib.util

    import molt

    if importlib.util.find_spec("molt.conf") is None:
        spec = importlib.util.spec_from_file_location("molt.conf", REPO / "conf" / "__init__.py",
                                                      submodule_search_locations=[str(REPO / "conf")])
        molt.conf = sys.modules["molt.conf"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(molt.conf)


# Qwen3-0.6B's shape with its vocabulary (the GPU run) and a small one (--plan on the host)
SHAPES = {"gpu": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=3072, vocab_size=151936),
          "plan": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, intermediate_size=128, vocab_size=1024)}
ROWS, PROMPT = 8, 8      # rows of a micro-batch; prompt tokens of each (the rest are trained)
LENGTH = {"gpu": 1024, "plan": 64}
SAMPLING = dict(temperature=0.7, top_p=0.9, top_k=50)
MIN_GIB, DRIVER = 40, {13: 580, 12: 525}   # CUDA major -> the least driver its torch needs


def report(results: dict, name: str, ok: bool | None, measured: str, start: float) -> None:
    """One check's line (ok None: skipped, with the reason) and its summary entry."""
    verdict = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    print(f"CHECK {name}: {verdict}  {measured}", flush=True)
    seconds = round(time.perf_counter() - start, 2)
    results[name] = {"verdict": verdict, "measured": measured, "seconds": seconds}


# -- preflight ---------------------------------------------------------------------------------------------
def driver_problem(torch_cuda: str | None, driver: str | None) -> str | None:
    """Why this torch's CUDA cannot run on this driver (None: it can, or the driver is unknown)."""
    if not torch_cuda or not driver:
        return None
    need = DRIVER.get(int(torch_cuda.split(".")[0]))
    if need and int(driver.split(".")[0]) < need:
        return (f"torch {torch.__version__} is built for CUDA {torch_cuda}, which needs an NVIDIA driver >= "
                f"{need}; this machine's is {driver} (nvidia-smi): update the driver, or install a torch "
                "built for an older CUDA")
    return None


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None when there is no nvidia-smi to ask."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


def preflight() -> str | None:
    """What of the assumptions above does not hold here (None: all hold)."""
    if not torch.version.cuda:
        return f"torch {torch.__version__} has no CUDA"
    problem = driver_problem(torch.version.cuda, driver_version())
    if problem:
        return problem
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU (torch.cuda.is_available() is False; see nvidia-smi)"
    if not torch.cuda.is_bf16_supported():
        return "the GPU has no bf16 (Ampere or newer needed)"
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return None if total >= MIN_GIB else f"the GPU has {total:.0f} GiB, the check needs >= {MIN_GIB}"


# -- the model and its step -------------------------------------------------------------------------------
def build(shape: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The random-init Qwen3 of `shape` in fp32 on `device` (tied head, as Qwen3-0.6B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    with torch.device(device):
        return Qwen3ForCausalLM(config).float()


def batch(shape: str, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab, length = SHAPES[shape]["vocab_size"], LENGTH[shape]
    ids = torch.randint(0, vocab, (ROWS, length), generator=g)
    mask = torch.ones(ROWS, length)
    mask[:, :PROMPT] = 0
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "loss_mask": mask.to(device), "advantages": torch.randn(ROWS, 1, generator=g).to(device)}


def logprobs(model: torch.nn.Module, b: dict, chunked: bool, chunk: int) -> torch.Tensor:
    """The trainer's logprobs of the sampled tokens (molt/trainer/model.py), chunked or whole, under the
    bf16 autocast a one-GPU rank computes in."""
    from molt.trainer.model import chunked_token_logprobs, head_input, token_logprobs

    head = model.get_output_embeddings()
    select = b["attention_mask"] * b["loss_mask"]
    with torch.autocast(b["input_ids"].device.type, torch.bfloat16):
        if not chunked:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
            return token_logprobs(logits, b["input_ids"], select, **SAMPLING)[0]
        with head_input(head) as hidden:
            model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        return chunked_token_logprobs(hidden[0], head, b["input_ids"], select, SAMPLING["temperature"],
                                      SAMPLING["top_p"], SAMPLING["top_k"], False, chunk)[0]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, b: dict, chunk: int) -> float:
    """One policy-gradient step as a rank runs it: chunked logprobs (chunk 0: whole), a token-mean loss,
    clip, AdamW."""
    logp = logprobs(model, b, chunk > 0, chunk)
    loss = -(logp * b["advantages"] * b["loss_mask"]).sum() / b["loss_mask"].sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def plan_spec(shape: str, device: str) -> Any:
    """The spec a one-GPU run of this model and micro-batch composes (parallel=gpu1 on cuda)."""
    from molt.driver.compose import compose

    s, length = SHAPES[shape], LENGTH[shape]
    arch = (f"{{hidden_size: {s['hidden_size']}, num_layers: {s['num_hidden_layers']}, num_heads: "
            f"{s['num_attention_heads']}, num_kv_heads: {s['num_key_value_heads']}, head_dim: "
            f"{s['head_dim']}, intermediate_size: {s['intermediate_size']}, vocab_size: {s['vocab_size']}, "
            "tie_word_embeddings: 1}")
    return compose(["parallel=gpu1", f"parallel.device={device}", "model.path=org/qwen3-shaped",
                    f"+model.arch={arch}", "model.dtype=bfloat16", f"model.max_model_len={length + 1}",
                    f"agent.max_total_tokens={length}", f"rollout.max_tokens={length - PROMPT}",
                    "train.prompts_per_step=2", f"rollout.samples_per_prompt={ROWS // 2}",
                    f"train.micro_batch_size={ROWS}", "rollout.engine.gpu_memory_utilization=0.5"])


# -- the checks ------------------------------------------------------------------------------------------
def fsdp2_step(results: dict, shape: str, device: torch.device) -> None:
    """FSDP2 on a one-rank mesh (bf16 parameters, fp32 reductions) against the unsharded autocast step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    start = time.perf_counter()
    b = {k: v[:2] for k, v in batch(shape, device).items()}   # whole logits: 2 rows keep them small
    losses = []
    for sharded in (False, True):
        model = build(shape, device)
        if sharded:
            mesh = init_device_mesh(device.type, (1,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          output_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        # whole logprobs: the root unit's tied head is resharded after the forward (Molt's sharded ranks
        # score in chunks through AutoModel's wrapping, checked on 2 CPU ranks in tests/test_trainer.py)
        losses.append([train_step(model, optimizer, b, 0) for _ in range(2)])
        del model, optimizer
    parallelizer = automodel_parallelizer(shape, device)
    gap = max(abs(a - c) for a, c in zip(*losses, strict=True))
    report(results, "fsdp2_step", gap <= 1e-2, f"losses of 2 steps unsharded {losses[0]}, FSDP2 {losses[1]}"
           f" (max gap {gap:.2e}, bound 1e-2); {parallelizer}", start)


def automodel_parallelizer(shape: str, device: torch.device) -> str:
    """AutoModel's `parallelize_model` on molt/trainer/model.py's one-rank setup, if it imports."""
    try:
        from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

        from molt.trainer.model import distributed_setup
    except ImportError as err:
        return f"AutoModel's parallelizer not installed here ({err.name})"
    model = build(shape, device)
    out = parallelize_model(model, distributed_setup(plan_spec(shape, device.type)).mesh_context)
    return f"AutoModel's parallelizer at world size 1 returns the module {'un' * (out is model)}sharded"


def memory_vs_plan(results: dict, shape: str, device: torch.device) -> dict:
    """The peak of a steady-state training step (the second) against the plan's trainer estimate."""
    from molt.driver.throughput import throughput
    from molt.plan.arch import arch_of
    from molt.plan.memory import GIB, chunk_tokens, trainer_estimate

    start = time.perf_counter()
    spec = plan_spec(shape, device.type)
    estimate = trainer_estimate(spec, "policy", arch_of(spec))
    print(f"PLAN {estimate.line()}", flush=True)
    chunk = chunk_tokens(spec, SHAPES[shape]["vocab_size"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        context = total - free - torch.cuda.memory_reserved(device)   # this process's CUDA context
    model, b = build(shape, device), batch(shape, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train_step(model, optimizer, b, chunk)   # AdamW's state exists from the first step on
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        logprobs(model, b, True, chunk)
    t1 = time.perf_counter()
    train_step(model, optimizer, b, chunk)
    if cuda:
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    tokens = float(b["attention_mask"].sum())
    rates = throughput(spec, {"tokens/total": tokens, "time/wait_batch": 0.0, "time/logprobs": t1 - t0,
                              "time/train": t2 - t1, "time/step": t2 - t0})
    print("THROUGHPUT tokens/s/GPU: " + ", ".join(f"{k.split('/')[1].removesuffix('_tokens_per_s_per_gpu')} "
                                                 f"{v:.0f}" for k, v in rates.items()), flush=True)
    if not cuda:
        report(results, "memory_vs_plan", None, f"estimate {estimate.total / GIB:.3f} GiB; the peak is "
               "measured on a GPU (the host's is bench/memory_plan.py's)", start)
        return rates
    allocated, reserved = (f(device) / GIB for f in (torch.cuda.max_memory_allocated,
                                                     torch.cuda.max_memory_reserved))
    peak = reserved + context / GIB
    ratio = estimate.total / GIB / peak
    report(results, "memory_vs_plan", 0.85 <= ratio <= 1.15,
           f"measured {peak:.2f} GiB (the allocator's reserved peak {reserved:.2f}, allocated "
           f"{allocated:.2f}; CUDA context {context / GIB:.2f}) vs estimate {estimate.total / GIB:.2f} GiB: "
           f"estimate/measured {ratio:.3f} (bound 0.85-1.15)", start)
    results["memory_vs_plan"]["parts_gib"] = {k: round(v / GIB, 3) for k, v in estimate.parts.items()}
    return rates


def chunked_logprobs(results: dict, shape: str, device: torch.device) -> None:
    start, b = time.perf_counter(), batch(shape, device)
    model = build(shape, device)
    tol = 5e-3   # bf16: GEMMs over other row counts may accumulate in another order
    got = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        logp = logprobs(model, b, chunked, 192)
        (logp * b["loss_mask"]).sum().backward()
        got.append((logp.detach(), model.model.embed_tokens.weight.grad.clone()))
    gap = float(((got[0][0] - got[1][0]) * b["loss_mask"]).abs().max())
    grad = float((got[0][1] - got[1][1]).norm() / got[0][1].norm())
    report(results, "chunked_logprobs", gap <= tol and grad <= 4 * tol,
           f"192-position chunks vs whole, {int(b['loss_mask'].sum())} tokens, temperature 0.7, top-k 50, "
           f"top-p 0.9: max |logprob gap| {gap:.2e} (bound {tol:g}), the head's gradient relative "
           f"{grad:.2e} (bound {4 * tol:g})", start)


def fp8_refit_packing(results: dict, device: torch.device) -> None:
    """Block FP8 of device tensors equals the host's; FP8 tensors and scales cross the wire intact."""
    from molt.trainer.fp8 import FP8, quantize_chunk

    start, g = time.perf_counter(), torch.Generator().manual_seed(2)
    host = {"q.weight": (torch.randn(300, 260, generator=g) * torch.logspace(-3, 2, 260)).bfloat16(),
            "norm.weight": torch.randn(260, generator=g).bfloat16()}
    fp8 = ({"q.weight"}, (128, 128))
    want = quantize_chunk(host, fp8)
    sent = quantize_chunk({k: v.to(device) for k, v in host.items()}, fp8)
    same = sorted(sent) == sorted(want) and all(
        torch.equal(sent[k].cpu().view(torch.uint8) if sent[k].dtype == FP8 else sent[k].cpu(),
                    want[k].view(torch.uint8) if want[k].dtype == FP8 else want[k]) for k in want)
    got = stream(sent, device)
    intact = [n for n, _ in got] == list(sent) and all(t.dtype == sent[n].dtype and torch.equal(
        t.view(torch.uint8), sent[n].cpu().view(torch.uint8)) for n, t in got)
    names = ", ".join(f"{n} {t.dtype}" for n, t in sent.items())
    report(results, "fp8_refit_packing", same and intact, f"quantized on {device.type} = on the host bit for "
           f"bit: {same}; across the wire in 16 KiB payloads ({names}) intact: {intact}", start)


def stream(tensors: dict[str, torch.Tensor], device: torch.device, chunk_bytes: int = 16 << 10) -> list:
    """What a receiver thread gets of `tensors` sent over a 2-rank gloo refit group on `device`."""
    from molt import refit

    store, got, errors = refit.listen("127.0.0.1", 2), [], []

    def receive() -> None:
        try:
            group = refit.open_group("127.0.0.1", store.port, 1, 2, device)
            got.extend((n, t.clone().cpu()) for n, t in refit.receive(group, device))
        except BaseException as err:   # reported below
            errors.append(err)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    group = refit.host_group(store, 2, torch.device("cpu"))   # gloo carries CUDA tensors too
    refit.send(group, [tensors], device, chunk_bytes)
    thread.join(60)
    if errors or thread.is_alive():
        raise RuntimeError(f"the receiver failed: {errors or 'still waiting'}")
    return got


def fp32_buffer_cast(results: dict, device: torch.device) -> None:
    """The refit stream of a model on `device`: parameters in bf16, a persistent fp32 buffer kept fp32."""
    from molt.trainer.weights import hf_chunks

    start = time.perf_counter()
    model = build("plan", device)
    bias = (1.0 + torch.arange(1, 17) / 4096).to(device)   # fp32 values bf16 cannot hold
    model.model.layers[0].mlp.register_buffer("e_score_correction_bias", bias)
    chunks = hf_chunks(model, 1 << 16, torch.bfloat16, device, device)
    out = {n: t for chunk in chunks for n, t in chunk.items()}
    name = "model.layers.0.mlp.e_score_correction_bias"
    params = [t for n, t in out.items() if n != name]
    ok = out[name].dtype == torch.float32 and torch.equal(out[name], bias) and all(
        t.dtype == torch.bfloat16 and t.device.type == device.type for t in params)
    report(results, "fp32_buffer_cast", ok, f"{len(params)} parameters sent as {params[0].dtype} on "
           f"{params[0].device.type}; the buffer as {out[name].dtype}, bit-equal "
           f"{torch.equal(out[name], bias)}", start)


def nccl_group_abort(results: dict, device: torch.device) -> None:
    """A one-rank refit group (NCCL on cuda, gloo here) streams, is aborted, and a new one forms."""
    from molt import refit

    start, sent = time.perf_counter(), []
    tensors = {"w": torch.randn(512, 512, device=device)}
    for _ in range(2):
        group = refit.host_group(refit.listen("127.0.0.1", 1), 1, device)
        sent.append(refit.send(group, [tensors], device, 1 << 16))
        t0 = time.perf_counter()
        refit.close_group(group)
        aborted = time.perf_counter() - t0
    report(results, "nccl_group_abort", sent == [512 * 512 * 4] * 2,
           f"{group.name()} group of one rank: streamed {sent} bytes, aborted in {aborted:.2f} s, and again "
           "through a new group", start)


RECEIVER = """
import sys, torch
from molt import refit
device = torch.device(sys.argv[3])
group = refit.open_group("127.0.0.1", int(sys.argv[1]), 1, 2, device)
g = torch.Generator().manual_seed(int(sys.argv[2]))
want = {"a": torch.randn(1000, 300, generator=g), "b": torch.randn(77, generator=g).bfloat16()}
got = {n: t.cpu() for n, t in refit.receive(group, device)}
print(sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), flush=True)
"""


def ipc_refit(results: dict, device: torch.device) -> None:
    """The colocated refit: another process on this device receives over the shared transport."""
    from molt import refit

    start, g = time.perf_counter(), torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(1000, 300, generator=g).to(device),
               "b": torch.randn(77, generator=g).bfloat16().to(device)}
    store = refit.listen("127.0.0.1", 2)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(store.port), "3", str(device)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
    group = refit.host_group(store, 2, device, shared=True)
    sent = refit.send(group, [tensors], device, 256 << 10, shared=True)
    out = child.communicate(timeout=300)[0].strip()
    how = "CUDA IPC handles" if device.type == "cuda" else "/dev/shm files"
    report(results, "ipc_refit", child.returncode == 0 and out == "True",
           f"{sent} bytes in 256 KiB payloads by {how} to a second process: received bit-equal {out}", start)


def topk_topp_mirror(results: dict, shape: str, device: torch.device) -> None:
    """The trainer's truncation against vLLM's GPU sampler where vLLM imports; else on `device` against
    itself on the host."""
    from molt.trainer.model import vllm_truncation

    start, g = time.perf_counter(), torch.Generator().manual_seed(4)
    vocab = SHAPES[shape]["vocab_size"]
    logits = torch.randn(64, vocab, generator=g) * 4
    logits[::4, :20] = logits[::4, :1]   # ties at the boundary in every fourth row
    k = torch.randint(1, 200, (64,), generator=g)
    k[::3] = vocab
    p = torch.rand(64, generator=g) * 0.6 + 0.4
    mine = vllm_truncation(logits.to(device), k.to(device), p.to(device)).cpu()
    host = vllm_truncation(logits, k, p)
    same = int((mine != host).any(-1).sum())
    why = "vLLM's GPU sampler kernel (Triton) runs on a GPU"
    if device.type == "cuda":
        try:
            from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton
        except ImportError as err:
            why = f"vLLM does not import here ({err.name}; pending a machine with `install.sh gpu`)"
        else:
            why = ""
    if why:
        report(results, "topk_topp_mirror", None, f"{why}: the mirror on {device.type} differs from the "
               f"host's in {same} of 64 rows", start)
        return
    theirs = apply_top_k_top_p_triton(logits.to(device).clone(), k.to(device).int(), p.to(device)).cpu()
    differ = int((mine != (theirs == -torch.inf)).any(-1).sum())
    report(results, "topk_topp_mirror", differ == 0, f"rows whose kept set differs from vLLM's Triton "
           f"kernel: {differ} of 64 ({vocab} tokens, ties in 16 rows); the mirror on {device.type} vs the "
           f"host: {same}", start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_one")
    parser.add_argument("--plan", action="store_true", help="the checks on the host: small model, no GPU")
    args = parser.parse_args(argv)
    map_conf()
    if not args.plan:
        problem = preflight()
        if problem:
            print(f"gpu_one: an assumption does not hold: {problem}", file=sys.stderr)
            return 2
    shape, device = ("plan", torch.device("cpu")) if args.plan else ("gpu", torch.device("cuda", 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        fsdp2_step(results, shape, device)
        rates = memory_vs_plan(results, shape, device)
        chunked_logprobs(results, shape, device)
        fp8_refit_packing(results, device)
        fp32_buffer_cast(results, device)
        nccl_group_abort(results, device)
        ipc_refit(results, device)
        topk_topp_mirror(results, shape, device)
    finally:
        dist.destroy_process_group()
    failed = [n for n, r in results.items() if r["verdict"] == "FAIL"]
    summary = {"host": "plan" if args.plan else torch.cuda.get_device_name(device),
               "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
               "seconds": round(time.perf_counter() - start, 1), "checks": results, "throughput": rates}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"gpu_one: {len(results)} checks in {summary['seconds']} s, "
          + (f"{len(failed)} failed: {', '.join(failed)}" if failed else "none failed")
          + f"; summary in {args.out / 'summary.json'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
