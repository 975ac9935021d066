"""The refit wire (`molt.refit`) on its own: one sender, two receivers, a real gloo group (threads)."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest
import torch

from molt import refit


def _stream(refits: list[list[dict]], chunk_bytes: int, reform: bool = False,
            shared: bool = False) -> tuple[list[list], list[int]]:
    """Send each refit's chunks from rank 0 to ranks 1 and 2 of one gloo group (threads); returns what
    each receiver got (name, tensor), and the bytes each refit sent. With `reform`, every rank closes its
    group after each refit and joins a new one (as when the engine set changes); with `shared`, payloads
    go by handle (parallel.colocate: /dev/shm files here, CUDA IPC on a GPU)."""
    stores = [refit.listen("127.0.0.1", 3) for _ in (refits if reform else refits[:1])]
    cpu = torch.device("cpu")
    got: list[list] = [[], []]
    sent: list[int] = []
    errors: list[BaseException] = []

    def receiver(rank: int) -> None:
        group = None
        for k, _ in enumerate(refits):
            if k == 0 or reform:
                refit.close_group(group)
                group = refit.open_group("127.0.0.1", stores[k].port, rank, 3, cpu)
            for name, tensor in refit.receive(group, cpu):
                got[rank - 1].append((name, tensor.clone()))

    def sender() -> None:
        group = None
        for k, chunks in enumerate(refits):
            if k == 0 or reform:
                refit.close_group(group)
                group = refit.host_group(stores[k], 3, cpu, shared)
            sent.append(refit.send(group, chunks, cpu, chunk_bytes, shared))

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as err:  # surfaced below; a broken stream would otherwise hang its peers
            errors.append(err)

    # daemon threads: if the stream breaks, a peer blocks in gloo, and the test must still end
    threads = [threading.Thread(target=guarded, args=a, daemon=True, name=a[0].__name__) for a in
               ((receiver, 1), (receiver, 2), (sender,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return got, sent


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"molt-refit-{os.getpid()}-*")}


@pytest.mark.parametrize("shared", [False, True], ids=["broadcast", "shared"])
def test_stream_arrives_whole_in_order_and_in_chunks(shared):
    """Both transports: broadcast payloads, and (parallel.colocate) payloads shared by handle, each
    receiver copying them out before the sender frees them (no /dev/shm file is left behind)."""
    g = torch.Generator().manual_seed(0)
    state = {   # mixed dtypes and odd byte sizes (alignment), a transposed view, a scalar, shared storage
        "a.weight": torch.randn(3, 5, generator=g),
        "a.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "b.mask": torch.tensor([True, False, True]),
        "b.weight": torch.randn(4, 6, generator=g).t(),
        "c.index": torch.arange(5, dtype=torch.int64),
        "d.scale": torch.tensor(2.5),
    }
    state["e.tied"] = state["a.weight"]
    chunks = [dict(list(state.items())[:2]), dict(list(state.items())[2:5]), dict(list(state.items())[5:])]
    got, sent = _stream([chunks, [{"z": torch.ones(2)}]], 1 << 10, shared=shared)   # then a second refit
    assert not _shm_files()
    assert sent[0] == sum(t.numel() * t.element_size() for t in state.values())
    for received in got:
        assert [n for n, _ in received] == [*state, "z"]
        for (name, tensor), want in zip(received, [*state.values(), torch.ones(2)], strict=True):
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name


def test_a_tensor_larger_than_a_chunk_streams_in_bounded_payloads(monkeypatch):
    """A refit chunk is capped at rollout.refit_chunk_mb even inside one tensor: a 1 MiB tensor between
    small ones, with 40 KiB chunks, goes out in payloads of at most 40 KiB and every receiver assembles
    it bit-equal (and the tensors around it, a bf16 and an odd-sized one, too)."""
    g = torch.Generator().manual_seed(1)
    state = {"small": torch.randn(7, generator=g).to(torch.bfloat16),
             "big": torch.randn(512, 513, generator=g),                      # 1 MiB + odd columns
             "after": torch.randn(3, 3, generator=g)}
    chunk_bytes = 40 << 10
    payloads: list[int] = []
    broadcast = refit._broadcast

    def recorded(group, tensor):
        if tensor.dtype == torch.uint8 and threading.current_thread().name == "sender":
            payloads.append(tensor.numel())
        broadcast(group, tensor)

    monkeypatch.setattr(refit, "_broadcast", recorded)
    got, sent = _stream([[state]], chunk_bytes)
    assert sent == [sum(t.numel() * t.element_size() for t in state.values())]
    big = state["big"].numel() * 4
    assert max(payloads) <= chunk_bytes and sum(payloads) >= big, payloads
    assert len([p for p in payloads if p > 1024]) >= big // chunk_bytes   # the big one really was split
    for received in got:
        assert [n for n, _ in received] == list(state)
        for (name, tensor), want in zip(received, state.values(), strict=True):
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name


@pytest.mark.parametrize("shared", [False, True], ids=["broadcast", "shared"])
def test_a_re_formed_group_closes_the_one_it_replaces(shared):
    """When the engine set changes, every rank closes (aborts) its refit group before it joins the new one:
    on NCCL that frees the communicator that would otherwise leak at each re-form. On gloo, three refits
    through three groups, each closed before the next forms, arrive whole."""
    refits = [[{"w": torch.full((3, 4), float(k))}] for k in range(3)]
    got, sent = _stream(refits, 1 << 20, reform=True, shared=shared)
    assert sent == [48] * 3
    for received in got:
        assert [float(t[0, 0]) for _, t in received] == [0.0, 1.0, 2.0]


def test_hosts_hold_the_port_they_hand_out(tiny_model_path):
    """The refit group's host (`refit.listen`) and trainer rank 0's rendezvous (`TrainerWorker.address`)
    are bound to their port when they hand it out: a port found free and bound later was taken meanwhile
    in CI (EADDRINUSE, then an engine waiting on another process's port for 10 minutes)."""
    from molt.spec import RunSpec
    from molt.trainer.worker import TrainerWorker

    spec = RunSpec.model_validate({"model": {"path": tiny_model_path}})
    worker = TrainerWorker(spec, "policy", 0, tiny_model_path)
    store = refit.listen("127.0.0.1", 2)
    for port in (store.port, worker.address()[1]):
        with socket.socket() as s, pytest.raises(OSError, match="in use"):
            s.bind(("", port))


def test_trainer_stream_carries_every_tensor_of_the_model(tiny_model_path):
    """A trainer rank's refit (`send_weights`, chunks of `rollout.refit_chunk_mb`) on a model many chunks
    long delivers every tensor of the checkpoint once, equal to it, and passes the engine's completeness
    check (a chunker that drops its last partial chunk, or any tensor, fails here, not only in a loop)."""
    from safetensors.torch import load_file
    from trainerlib import one_rank
    from transformers import AutoConfig

    from molt.rollout.worker_extension import check_complete, checkpoint_names
    from molt.spec import RunSpec

    chunk_mb = 0.05
    spec = RunSpec.model_validate({"model": {"path": tiny_model_path},
                                   "rollout": {"refit_chunk_mb": chunk_mb}})
    checkpoint = load_file(f"{tiny_model_path}/model.safetensors")
    size = sum(t.numel() * t.element_size() for t in checkpoint.values())
    assert size > 10 * chunk_mb * 2**20            # spans many chunks (the last one partial)
    cpu, got, errors = torch.device("cpu"), [], []

    def receiver(host: str, port: int) -> None:
        try:
            group = refit.open_group(host, port, 1, 2, cpu)
            got.extend((name, tensor.clone()) for name, tensor in refit.receive(group, cpu))
        except BaseException as err:  # surfaced below
            errors.append(err)

    with one_rank(spec) as rank:
        thread = threading.Thread(target=receiver, args=rank.host_refit(2), daemon=True)
        thread.start()
        rank.join_refit(2)
        sent = rank.send_weights()
    thread.join(timeout=60)
    assert not errors and not thread.is_alive(), errors
    names = [name for name, _ in got]
    assert len(names) == len(set(names)) and set(names) == set(checkpoint)
    for name, tensor in got:
        assert tensor.dtype == checkpoint[name].dtype and torch.equal(tensor, checkpoint[name]), name
    assert sent == size
    expected = checkpoint_names(tiny_model_path, AutoConfig.from_pretrained(tiny_model_path))
    check_complete(names, expected)
    with pytest.raises(RuntimeError, match="lacked 1 of"):
        check_complete(names[:-1], expected)


def test_the_engine_expects_what_its_model_loads_read_from_the_hub_cache(tiny_model_path, tmp_path,
                                                                          monkeypatch):
    """The completeness check's names for a hub id come from its snapshot in the Hugging Face cache (local
    files only): an empty set would let any refit through. A DeepSeek-V3 checkpoint's multi-token-prediction
    layer (layer `num_hidden_layers`, vLLM's main model skips it, the trainer's model has none) and
    Qwen3-Next's `mtp.*` are not expected, or every refit of such a model would be refused. A hub id that is
    not cached is refused with the reason."""
    import huggingface_hub
    from safetensors import safe_open
    from transformers import AutoConfig

    from molt.rollout.worker_extension import check_complete, checkpoint_names

    config = AutoConfig.from_pretrained(tiny_model_path)
    with safe_open(f"{tiny_model_path}/model.safetensors", "pt") as f:
        sent = sorted(set(f.keys()) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    last = config.num_hidden_layers
    mtp = [f"model.layers.{last}.{k}" for k in ("enorm.weight", "eh_proj.weight", "shared_head.norm.weight")]
    commit = "0" * 40
    repo = tmp_path / "models--org--tiny-mtp"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text((Path(tiny_model_path) / "config.json").read_text())
    weight_map = dict.fromkeys([*sent, *mtp, "mtp.fc.weight"], "model.safetensors")
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    config.num_nextn_predict_layers = 1
    expected = checkpoint_names("org/tiny-mtp", config)
    assert expected == set(sent)
    check_complete(sent, expected)
    with pytest.raises(RuntimeError, match="lacked 1 of"):
        check_complete(sent[1:], expected)
    with pytest.raises(RuntimeError, match="org/not-cached is neither a folder nor a hub id in the Hugging"):
        checkpoint_names("org/not-cached", config)


RECEIVER = """
import sys, time, torch
from molt import refit
group = refit.open_group("127.0.0.1", int(sys.argv[1]), 1, 2, torch.device("cpu"))
stream = refit.receive(group, torch.device("cpu"))
if sys.argv[2] == "stall":
    next(stream)
    print("stalled", flush=True)
    time.sleep(600)                      # a receiver that stops reading mid-stream, until it is killed
print(sum(t.numel() for _, t in stream) + 0, flush=True)
"""


def test_a_broadcast_in_flight_ends_when_its_receiver_dies_and_a_new_group_streams(tmp_path):
    """The refit's abort path on gloo (the fleet's, when engines die mid-transfer): the sender is blocked in
    a broadcast to a receiver that stopped reading; killing the receiver (the fleet drops and kills a
    stuck engine) ends the broadcast with an error at once instead of after molt.refit.TIMEOUT (gloo's
    `abort` does not unblock a waiting broadcast, which is why the trainer aborts only NCCL groups);
    closing the broken group returns, and a group re-formed with a new receiver streams whole. The
    NCCL abort of a waiting broadcast needs two GPUs (bench/gpu_smoke.py, item 13)."""
    import subprocess
    import sys
    import time

    cpu = torch.device("cpu")
    big = {"w": torch.randn(64, 2**16)}   # 16 MiB in 1 MiB payloads: far beyond the sockets' buffers

    def receiver(port: int, mode: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), mode], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    store = refit.listen("127.0.0.1", 2)
    stuck = receiver(store.port, "stall")
    group = refit.host_group(store, 2, cpu)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            refit.send(group, [big], cpu, 1 << 20)
        except BaseException as err:   # the broken stream
            errors.append(err)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    assert stuck.stdout.readline().strip() == "stalled"
    time.sleep(1.0)
    assert sender.is_alive()          # in flight: blocked on the receiver that stopped reading
    stuck.kill()
    stuck.wait(30)
    sender.join(timeout=60)
    assert not sender.is_alive() and errors, "the broadcast still waits for a dead receiver"
    refit.close_group(group)
    store = refit.listen("127.0.0.1", 2)
    fresh = receiver(store.port, "whole")
    group = refit.host_group(store, 2, cpu)
    assert refit.send(group, [big], cpu, 1 << 20) == big["w"].numel() * 4
    assert int(fresh.communicate(timeout=120)[0].split()[-1]) == big["w"].numel()
    refit.close_group(group)
