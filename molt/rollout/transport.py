"""CPU weight transport: Ray object store → shared-memory safetensors files → the worker's reload path.

The trainer puts its full state dict (HF names, possibly in several chunks) into the object store;
the engine actor writes each chunk to a file in /dev/shm and asks its workers to reload from those
files. The files live only for the duration of the call.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import torch


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _unshared(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings); copy the later ones.
    seen: set[int] = set()
    out = {}
    for name, t in chunk.items():
        t = t.detach().contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


async def load_chunks(llm: Any, chunk_refs: list) -> None:
    """Resolve `chunk_refs` (each a dict name → tensor) and reload the engine's weights from them."""
    from safetensors.torch import save_file

    chunks = await asyncio.gather(*chunk_refs)
    fd, base = tempfile.mkstemp(prefix="molt-refit-", dir=_shm_dir())
    os.close(fd)
    paths = [f"{base}-{i}.safetensors" for i in range(len(chunks))]
    try:
        for path, chunk in zip(paths, chunks, strict=True):
            save_file(_unshared(chunk), path)
        await llm.collective_rpc("molt_reload_files", args=(paths,))
    finally:
        for path in [base, *paths]:
            if os.path.exists(path):
                os.remove(path)
