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
Both sides import this module: it belongs to neither `molt.trainer` nor `molt.rollout`.
"""

from __future__ import annotations

import json
import math
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


def host_group(store: dist.TCPStore, world_size: int, device: torch.device) -> dist.ProcessGroup:
    """Rank 0: open the refit group on `store` (from `listen`); returns once all ranks joined."""
    return _group(store, 0, world_size, device)


def open_group(host: str, port: int, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    """A receiver (rank >= 1): join the refit group rank 0 listens for at host:port (`listen`)."""
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=TIMEOUT)
    return _group(store, rank, world_size, device)


def _group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    store = dist.PrefixStore("molt-refit", store)
    if device.type == "cuda":
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
         chunk_bytes: int) -> int:
    """Broadcast the tensors of `chunks` (name -> full tensor) from rank 0 in payloads of at most
    `chunk_bytes` (rollout.refit_chunk_mb; a larger tensor is split across payloads), then the end mark;
    returns the bytes sent."""
    sent = 0
    for entries in _payloads(chunks, max(chunk_bytes // _ALIGN * _ALIGN, _ALIGN)):
        header = json.dumps([[name, str(t.dtype).removeprefix("torch."), list(t.shape), start, stop]
                             for name, t, _, start, stop in entries]).encode()
        payload = torch.empty(sum(_padded(stop - start) for *_, start, stop in entries), dtype=torch.uint8,
                              device=device)
        offset = 0
        for _, _, data, start, stop in entries:
            payload[offset:offset + stop - start] = data[start:stop]
            offset += _padded(stop - start)
        _broadcast(group, torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=device))
        _broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
        _broadcast(group, payload)
        sent += sum(stop - start for *_, start, stop in entries)
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=device))
    return sent


def receive(group: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the stream `send` broadcasts, one payload at a time, until its end mark. A
    tensor that fits in one payload is a view into it; a split one is assembled (the one buffer beyond
    the payload a receiver holds) and yielded once its last byte arrived."""
    assembling: torch.Tensor | None = None
    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        _broadcast(group, sizes)
        header_len, payload_len = sizes.tolist()
        if header_len == 0:
            return
        header = torch.empty(header_len, dtype=torch.uint8, device=device)
        _broadcast(group, header)
        payload = torch.empty(payload_len, dtype=torch.uint8, device=device)
        _broadcast(group, payload)
        offset = 0
        for name, dtype_name, shape, start, stop in json.loads(header.cpu().numpy().tobytes()):
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
