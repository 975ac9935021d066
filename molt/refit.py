"""The weight refit wire: trainer rank 0 broadcasts full weights to every engine worker.

One torch.distributed process group spans the sender (rank 0: trainer rank 0, which hosts the
rendezvous store) and every worker of every engine (ranks 1..). It is built from a TCPStore directly,
beside the default groups of both sides (the trainer's FSDP group, an engine's tensor-parallel group),
so neither side's own collectives see it. gloo on CPU, NCCL on CUDA; the calls are the same.

The stream is chunked: per chunk a small header (names, dtypes, shapes) and then the chunk's tensors
packed into one byte buffer; a zero-length header ends it. Neither side ever holds more than one chunk,
and receivers get (name, tensor) views in checkpoint names, which is what vLLM's reload consumes.
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


def open_group(host: str, port: int, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    """Join the refit group (rank 0 hosts the store at host:port and returns once all ranks joined)."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
    store = dist.PrefixStore("molt-refit", store)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def send(group: dist.ProcessGroup, chunks: Iterable[dict[str, torch.Tensor]], device: torch.device) -> int:
    """Broadcast each chunk (name -> full tensor) from rank 0, then the end mark; returns the bytes sent."""
    sent = 0
    for chunk in chunks:
        if not chunk:
            continue
        header = json.dumps([[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                             for name, t in chunk.items()]).encode()
        sizes = [t.numel() * t.element_size() for t in chunk.values()]
        payload = torch.zeros(sum(_padded(n) for n in sizes), dtype=torch.uint8, device=device)
        offset = 0
        for t, n in zip(chunk.values(), sizes, strict=True):
            payload[offset:offset + n] = t.detach().contiguous().view(-1).view(torch.uint8)
            offset += _padded(n)
        _broadcast(group, torch.tensor([len(header), payload.numel()], dtype=torch.int64, device=device))
        _broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
        _broadcast(group, payload)
        sent += sum(sizes)
    _broadcast(group, torch.zeros(2, dtype=torch.int64, device=device))
    return sent


def receive(group: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the stream `send` broadcasts, one chunk at a time, until its end mark."""
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
        for name, dtype_name, shape in json.loads(header.cpu().numpy().tobytes()):
            dtype = getattr(torch, dtype_name)
            n = math.prod(shape) * dtype.itemsize
            yield name, payload[offset:offset + n].view(dtype).view(shape)
            offset += _padded(n)
