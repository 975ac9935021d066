"""The futures the SDK polls: a request that takes time answers at once with a request id, and
`/retrieve_future` returns its result, or its failure, once it is done."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any

from molt.tinker import Refused

FORGET_AFTER_S = 60.0   # a result stays this long after its first fetch (a poll retried on a lost reply)


class Futures:
    def __init__(self) -> None:
        self.futures: dict[str, asyncio.Future] = {}

    def new(self) -> tuple[str, asyncio.Future]:
        """A request id and the future its work settles (on the running loop)."""
        request_id = uuid.uuid4().hex
        future = self.futures[request_id] = asyncio.get_running_loop().create_future()
        return request_id, future

    def start(self, work: Awaitable[Any]) -> str:
        """Run `work` now, on its own; returns the id its result is fetched by."""
        request_id, future = self.new()

        async def run() -> None:
            try:
                future.set_result(await work)
            except Exception as err:   # noqa: BLE001 - the request's failure, reported through its future
                future.set_exception(err)
        asyncio.get_running_loop().create_task(run())
        return request_id

    async def fetch(self, request_id: str, wait_s: float) -> asyncio.Future | None:
        """The request's future once it is done, or None if it is not within `wait_s` (the client polls
        again)."""
        future = self.futures.get(request_id)
        if future is None:
            raise Refused(f"request {request_id} is unknown (or its result was fetched over "
                          f"{FORGET_AFTER_S:g} s ago)")
        if not future.done():
            await asyncio.wait([future], timeout=wait_s)
            if not future.done():
                return None
        asyncio.get_running_loop().call_later(FORGET_AFTER_S, self.futures.pop, request_id, None)
        return future
