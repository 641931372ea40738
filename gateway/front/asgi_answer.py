"""Answering a proxied request over plain ASGI: `AsgiWriter`, the one answer path's (gateway/front/answer.py)
writer onto ASGI messages.

The gateway's own connection protocol hands a proxied request to `FastPath.serve_exchange`,
which writes the answer onto the connection itself. A proxied request that reaches an ASGI app
instead (a query string or %-escapes in its path, another server in front, or the Litestar route
with `fast_path: false`) is answered by `answer` here: the same `answer.answer`, through `send`.
Not on the measured request path, so not compiled (scripts/compile.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.errors import InvalidRequest, RequestTooLarge
from gateway.front import answer as answer_path
from gateway.front import front
from gateway.front.answer import Headers
from gateway.request.requests import header_reader, headers_by_name

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]


async def answer(gw: Any, scope: Scope, receive: Receive, send: Send, kind: str, path: str | None = None) -> None:
    """Answer one proxied request of `kind` through `send` (`path`: the route's, where it is
    not the scope's own)."""
    client = scope.get("client")
    await answer_path.answer(
        gw, AsgiWriter(scope, send), header_reader(headers_by_name(scope["headers"])), client[0] if client else None,
        lambda: _read_body(receive, gw.settings.max_body_bytes), receive, path or scope["path"], kind,
    )


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("The client went away before sending the whole body.")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge.over(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _encoded(headers: Headers) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers]


class AsgiWriter:
    """Writes one answer as ASGI messages through `send` (gateway/front/answer.py's `Writer`).

    Each piece of a stream waits in `pending` until `drain` sends it: `send` is a coroutine, so
    `chunk` always asks to be drained. A stream that breaks off is left incomplete, which the
    server answers by closing the connection (`abort` has nothing to do)."""

    __slots__ = ("pending", "scope", "send")

    def __init__(self, scope: Scope, send: Send) -> None:
        self.scope = scope
        self.send = send
        self.pending = b""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        raw = [*_encoded(headers), _JSON, (b"content-length", str(len(body)).encode())]
        await self.send({"type": "http.response.start", "status": status, "headers": raw})
        await self.send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": _encoded(headers) + _SSE})

    def chunk(self, data: bytes) -> bool:
        self.pending = data
        return True

    async def drain(self) -> None:
        await self.send({"type": "http.response.body", "body": self.pending, "more_body": True})

    async def end(self) -> None:
        await self.send({"type": "http.response.body", "body": b""})

    def abort(self) -> None:
        return None

    def answering(self, headers: list[tuple[str, str]]) -> None:
        front.answering(self.scope, headers)

    @property
    def stalled(self) -> bool:
        return front.STALLED in self.scope

    def serving(self) -> asyncio.Task[Any] | None:
        return None


__all__ = ["AsgiWriter", "answer"]
