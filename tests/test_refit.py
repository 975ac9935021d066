"""The refit wire (`molt.refit`) on its own: one sender, two receivers, a real gloo group (threads)."""

from __future__ import annotations

import socket
import threading

import torch

from molt import refit


def test_stream_arrives_whole_in_order_and_in_chunks():
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cpu = torch.device("cpu")
    got: list[list] = [[], []]
    sent: list[int] = []
    errors: list[BaseException] = []

    def receiver(rank: int) -> None:
        group = refit.open_group("127.0.0.1", port, rank, 3, cpu)
        for name, tensor in refit.receive(group, cpu):
            got[rank - 1].append((name, tensor.clone()))
        for name, tensor in refit.receive(group, cpu):   # a second refit over the same group
            got[rank - 1].append((name, tensor.clone()))

    def sender() -> None:
        group = refit.open_group("127.0.0.1", port, 0, 3, cpu)
        sent.append(refit.send(group, chunks, cpu))
        refit.send(group, [{"z": torch.ones(2)}], cpu)

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as err:  # surfaced below; a broken stream would otherwise hang its peers
            errors.append(err)

    # daemon threads: if the stream breaks, a peer blocks in gloo, and the test must still end
    threads = [threading.Thread(target=guarded, args=a, daemon=True) for a in
               ((receiver, 1), (receiver, 2), (sender,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert sent == [sum(t.numel() * t.element_size() for t in state.values())]
    for received in got:
        assert [n for n, _ in received] == [*state, "z"]
        for (name, tensor), want in zip(received, [*state.values(), torch.ones(2)], strict=True):
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
