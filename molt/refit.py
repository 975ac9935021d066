"""The weight refit wire: trainer rank 0 broadcasts full weights to every engine worker.

One torch.distributed process group spans the sender (rank 0: trainer rank 0, which hosts the
rendezvous store) and every worker of every engine (ranks 1..). It is built from a TCPStore directly,
beside the default groups of both sides (the trainer's FSDP group, an engine's tensor-parallel group),
so neither side's own collectives see it. gloo on CPU, NCCL on CUDA; the calls are the same.

The stream is chunked: per payload a small header (names, dtypes, shapes, byte ranges) and then the
tensors' bytes packed into one buffer of at most `rollout.refit_chunk_mb`; a zero-length header ends it.
A tensor larger than that is split across payloads and assembled by the receivers, so beside the
tensors it is made of, each side holds one payload (and a receiver the one tensor being assembled).
Receivers get (name, tensor) pairs in checkpoint names, which is what vLLM's reload consumes.

With `parallel.colocate` the engine shares the trainer's device, where NCCL refuses two ranks of one group
("Duplicate GPU detected"): the group is gloo and carries only headers, and each payload stays where the
sender packed it, shared (`shared=True`): a CUDA IPC handle on cuda (keyed by the GPU's UUID, as vLLM's
`ipc` weight-transfer backend does), a /dev/shm file on the host. Each receiver copies it out on the same
device and acknowledges; then the sender frees it. The host tells the receivers which transport the group
uses through the rendezvous store. Both sides import this module: it belongs to neither `molt.trainer` nor
`molt.rollout`.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a receiver waits for the next piece: the sender gathers each chunk from the FSDP shards first.
TIMEOUT = timedelta(minutes=10)
_ALIGN = 16  # bytes; each tensor starts aligned, so a byte view can be reinterpreted as any dtype


def listen(host: str, world_size: int) -> dist.TCPStore:
    """Rank 0: the refit group's rendezvous store, on a port the OS assigns as it binds (`.port`). A port
    found free and bound later can be taken meanwhile (seen in CI: EADDRINUSE, and a receiver that joined
    another process's port waited TIMEOUT), so the host binds first and hands out the port it holds."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def host_group(store: dist.TCPStore, world_size: int, device: torch.device,
               shared: bool = False) -> dist.ProcessGroup:
    """Rank 0: open the refit group on `store` (from `listen`); returns once all ranks joined. `shared`:
    the receivers share this device (parallel.colocate), payloads go by handle (module docstring)."""
    store.set(_TRANSPORT, "shared" if shared else "broadcast")
    return _group(store, 0, world_size, device, shared)


def open_group(host: str, port: int, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    """A receiver (rank >= 1): join the refit group rank 0 listens for at host:port (`listen`), over the
    transport the host chose (`host_group`)."""
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=TIMEOUT)
    return _group(store, rank, world_size, device, store.get(_TRANSPORT) == b"shared")


_TRANSPORT = "molt-refit-transport"


def _group(store: dist.Store, rank: int, world_size: int, device: torch.device,
           shared: bool) -> dist.ProcessGroup:
    store = dist.PrefixStore("molt-refit", store)
    if device.type == "cuda" and not shared:
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


def close_group(group: dist.ProcessGroup | None) -> None:
    """Abort a refit group that is replaced (the engine set changed) or whose transfer failed. NCCL frees
    its communicator now and fails a collective still waiting in it, instead of keeping one communicator
    per re-formed group and leaving a stuck broadcast to its watchdog, which tears the process down after
    TIMEOUT (torch's default error handling, kept for the groups no one aborts). None: nothing to do."""
    if group is not None:
        group.abort()


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _wire(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where the group's collectives take tensors: the device for NCCL, the host for gloo (also the
    headers-only group of the shared transport on cuda)."""
    return device if group.name() == "nccl" else torch.device("cpu")


def _ack(group: dist.ProcessGroup) -> None:
    """Every rank waits until every receiver has copied the shared payload out (the sender frees it next)."""
    group.allreduce([torch.zeros(1)]).wait()


def _share(payload: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(a handle receivers on the same device open, the storage to keep alive until they acknowledge): a
    CUDA IPC handle with the GPU's UUID, or on the host a /dev/shm file holding the payload."""
    if payload.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(payload)
        uuid_ = str(torch.cuda.get_device_properties(payload.device).uuid)
        return {"cuda": base64.b64encode(pickle.dumps((rebuild, args))).decode(), "gpu": uuid_}, payload
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"molt-refit-{os.getpid()}-{uuid.uuid4().hex}")
    kept = torch.from_file(path, shared=True, size=payload.numel(), dtype=torch.uint8)
    kept.copy_(payload)
    return {"file": path}, kept


def _open(handle: dict, nbytes: int, device: torch.device) -> torch.Tensor:
    """A copy, on `device`, of the payload a `_share` handle names (the sender frees its storage next)."""
    if "file" in handle:
        return torch.from_file(handle["file"], shared=True, size=nbytes, dtype=torch.uint8).to(device,
                                                                                               copy=True)
    here = str(torch.cuda.get_device_properties(device).uuid)
    if handle["gpu"] != here:
        raise RuntimeError(f"refit: parallel.colocate, but the trainer's payload is on GPU {handle['gpu']} "
                           f"and this engine worker on GPU {here}: CUDA IPC needs the same GPU")
    rebuild, args = pickle.loads(base64.b64decode(handle["cuda"]))
    args = list(args)
    args[6] = device.index   # the storage's device, as this process numbers it (vLLM's ipc backend does so)
    return rebuild(*args).clone()


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _payloads(chunks: Iterable[dict[str, torch.Tensor]], cap: int) -> Iterator[list[tuple]]:
    """The tensors of `chunks` as payloads of at most `cap` bytes (and at least one byte range): each entry
    is (name, tensor, its bytes, start, stop), a byte range of one tensor; a tensor larger than what is
    left of a payload continues in the next ones."""
    entries: list[tuple] = []
    used = 0
    for chunk in chunks:
        for name, tensor in chunk.items():
            data = tensor.detach().contiguous().view(-1).view(torch.uint8)
            start = 0
            while True:
                if used >= cap:
                    yield entries
                    entries, used = [], 0
                stop = min(data.numel(), start + cap - used)
                entries.append((name, tensor, data, start, stop))
                used += _padded(stop - start)
                start = stop
                if start >= data.numel():
                    break
    if entries:
        yield entries


def send(group: dist.ProcessGroup, chunks: Iterable[dict[str, torch.Tensor]], device: torch.device,
         chunk_bytes: int, shared: bool = False) -> int:
    """Broadcast the tensors of `chunks` (name -> full tensor) from rank 0 in payloads of at most
    `chunk_bytes` (rollout.refit_chunk_mb; a larger tensor is split across payloads), then the end mark;
    returns the bytes sent. `shared`: the group's receivers share this device (`host_group`)."""
    sent, wire = 0, _wire(group, device)
    for entries in _payloads(chunks, max(chunk_bytes // _ALIGN * _ALIGN, _ALIGN)):
        header: dict = {"entries": [[name, str(t.dtype).removeprefix("torch."), list(t.shape), start, stop]
                                    for name, t, _, start, stop in entries]}
        payload = torch.empty(sum(_padded(stop - start) for *_, start, stop in entries), dtype=torch.uint8,
                              device=device)
        offset = 0
        for _, _, data, start, stop in entries:
            payload[offset:offset + stop - start] = data[start:stop]
            offset += _padded(stop - start)
        kept = None
        if shared:
            header["shared"], kept = _share(payload)
        encoded = json.dumps(header).encode()
        _broadcast(group, torch.tensor([len(encoded), payload.numel()], dtype=torch.int64, device=wire))
        _broadcast(group, torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(wire))
        if shared:
            _ack(group)
            if "file" in header["shared"]:
                os.unlink(header["shared"]["file"])
            del kept
        else:
            _broadcast(group, payload)
        sent += sum(stop - start for *_, start, stop in entries)
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=wire))
    if shared and device.type == "cuda":
        torch.cuda.ipc_collect()   # the receivers' handles of freed payloads
    return sent


def receive(group: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the stream `send` broadcasts, one payload at a time, until its end mark. A
    tensor that fits in one payload is a view into it; a split one is assembled (the one buffer beyond
    the payload a receiver holds) and yielded once its last byte arrived."""
    assembling: torch.Tensor | None = None
    wire = _wire(group, device)
    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=wire)
        _broadcast(group, sizes)
        header_len, payload_len = sizes.tolist()
        if header_len == 0:
            return
        encoded = torch.empty(header_len, dtype=torch.uint8, device=wire)
        _broadcast(group, encoded)
        header = json.loads(encoded.cpu().numpy().tobytes())
        if "shared" in header:
            payload = _open(header["shared"], payload_len, device)
            _ack(group)
        else:
            payload = torch.empty(payload_len, dtype=torch.uint8, device=device)
            _broadcast(group, payload)
        offset = 0
        for name, dtype_name, shape, start, stop in header["entries"]:
            dtype = getattr(torch, dtype_name)
            nbytes, piece = math.prod(shape) * dtype.itemsize, payload[offset:offset + stop - start]
            offset += _padded(stop - start)
            if start == 0 and stop == nbytes:
                yield name, piece.view(dtype).view(shape)
                continue
            if start == 0:
                assembling = torch.empty(nbytes, dtype=torch.uint8, device=device)
            assembling[start:stop] = piece
            if stop == nbytes:
                yield name, assembling.view(dtype).view(shape)
                assembling = None
