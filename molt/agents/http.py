"""The loopback server's HTTP connections: how long a client may take, and how much it may send.

uvicorn waits for a request line and headers forever, so a client that trickles them (slowloris) would
hold its connection for good: here a request head or body that is not complete within READ_TIMEOUT_S of
its start is dropped (408 for a body), a body over MAX_BODY_BYTES is refused (413), and a connection idle
for IDLE_TIMEOUT_S is closed. The chat handling (sessions, wires, sampling) is molt/agents/server.py's.
"""

from __future__ import annotations

import asyncio
import select
from typing import Any

import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY_BYTES = 4 << 20
READ_TIMEOUT_S = 30.0   # for a request's head (request line + headers) and, separately, its body
# For a connection with no byte of a next request yet (a fresh one, or kept alive after a response):
# far beyond a client's own keep-alive expiry (httpx: 5 s) and any lag of its event loop, so the client
# always gives a connection up first (see HeadDeadlineProtocol).
IDLE_TIMEOUT_S = 300.0


class ApiError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             408: "invalid_request_error", 413: "request_too_large", 500: "api_error"}

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def response(self, anthropic: bool) -> JSONResponse:
        kind = self.TYPES.get(self.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": self.message}} if anthropic else \
            {"error": {"message": self.message, "type": kind, "param": None, "code": self.status}}
        # A client too slow to send its body is not waited for any longer.
        slow = {"connection": "close"} if self.status == 408 else None
        return JSONResponse(body, status_code=self.status, headers=slow)


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request head, and a long idle timeout.

    uvicorn waits for a request line and headers forever, so a client that trickles them (slowloris)
    would hold its connection for good. Here a head must be complete READ_TIMEOUT_S after its first byte
    arrived, or the connection is closed. A connection that has not started a head (fresh, or idle after
    a response) closes after IDLE_TIMEOUT_S instead: a client whose event loop runs hundreds of sessions
    may send its next request (or its first, after connecting) tens of seconds late, and a server that
    closed the connection meanwhile failed that turn with a connection error (the client's check that a
    kept-alive connection is still open cannot close the race: it yields to its loop before sending).
    """

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.head_of: Any = "none yet"   # the cycle after which the pending head's deadline was armed
        # uvicorn arms its keep-alive timer (IDLE_TIMEOUT_S) after each response only
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        head_pending = self.cycle is None or self.cycle.response_complete
        if head_pending and self.head_of is not self.cycle:   # these are a next head's first bytes
            self.head_of = self.cycle
            self._arm_head_deadline()

    def client_waiting(self) -> bool:
        """Whether bytes from the client (or its close) wait unread in the socket."""
        sock = self.transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return False
        poll = select.poll()   # not select.select: a worker with 1,024 sessions has fds above 1,024
        poll.register(sock.fileno(), select.POLLIN)
        return bool(poll.poll(0))

    def _arm_head_deadline(self) -> None:
        cycle = self.cycle   # replaced when the head is complete

        def expire() -> None:
            if self.cycle is not cycle:
                return
            if self.client_waiting():   # the server is behind on reading (uvloop runs due timers first)
                self.loop.call_later(READ_TIMEOUT_S, expire)
            else:
                self.transport.close()

        self.loop.call_later(READ_TIMEOUT_S, expire)


def server_config(app: Any) -> uvicorn.Config:
    """uvicorn's config for the loopback app: idle connections close after IDLE_TIMEOUT_S
    (HeadDeadlineProtocol says why so late); a head over 16 KiB is answered 400 (h11's limit)."""
    return uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1,
                          http=HeadDeadlineProtocol, timeout_keep_alive=IDLE_TIMEOUT_S,
                          h11_max_incomplete_event_size=16 << 10)


async def read_body(request: Request) -> bytes:
    """The request's body, refused past MAX_BODY_BYTES (413) or READ_TIMEOUT_S (408)."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    raw = b""
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            async for part in request.stream():
                raw += part
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    except TimeoutError:
        raise ApiError(408, f"request body not received within {READ_TIMEOUT_S:g}s") from None
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected before sending the whole body") from None
    return raw
