"""uvicorn's httptools protocol, with the proxied routes served straight off the connection.

The gateway's two proxied routes (POST /v1/chat/completions, /v1/completions) skip ASGI:
their requests go to `FastPath.serve_cycle` (gateway/fastpath.py), which writes the answer
onto the connection itself. Every other request is uvicorn's, as before.

For those, uvicorn's httptools protocol writes a whole response's head and body in one syscall.

uvicorn writes the status line and headers when the app sends `http.response.start`, and
the body when it sends `http.response.body`: two `send()` calls per proxied answer, a few
percent of the gateway's CPU per request. Here the transport holds back a head that
declares a content-length (a whole answer, whose body follows at once) and writes it with
the body. A streamed answer (chunked, no content-length) is written as before, its head
straight away, so a client sees the headers of a stream before its first token.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

if TYPE_CHECKING:
    from gateway.fastpath import FastPath
    from gateway.front import Hangup


class _Coalescing:
    """A transport that keeps a content-length head until the next write (or close)."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.endswith(b"\r\n\r\n") and data.startswith(b"HTTP/1.1 ") and b"\r\ncontent-length: " in data:
            self._held = data
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's `http="httptools"` protocol over a `_Coalescing` transport; the proxied
    routes go to `fast` (built with functools.partial(GatewayHttpProtocol, fast=...))."""

    def __init__(self, *args: Any, fast: FastPath | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = fast
        # The hang-up watches of this connection's proxied requests in flight (gateway/front.py):
        # told when the connection closes, so no request needs a watcher task of its own.
        self.watched: list[Hangup] = []
        if fast is not None and fast.proxy_headers is None and self.config.proxy_headers:
            fast.proxy_headers = ProxyHeadersMiddleware(_nothing, self.config.forwarded_allow_ips)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Coalescing(transport))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        watched, self.watched = self.watched, []
        for hangup in watched:
            hangup.client_gone()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        fast = self.fast
        kind = fast.hot(cycle.scope) if fast is not None else None  # type: ignore[arg-type]
        if kind is None or app is not self.app or self.config.reset_contextvars:  # uvicorn's 503 app under limit_concurrency
            super()._start_asgi_task(cycle, app)
            return
        assert fast is not None
        task = self.loop.create_task(fast.serve_cycle(cycle, kind, self.watched))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)


async def _nothing(*_: object) -> None:
    return None
