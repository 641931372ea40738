"""uvicorn's httptools protocol, with the proxied routes served straight off the connection.

A request for a proxied route (POST /v1/chat/completions, /v1/completions and the others of
`gateway.requests.KINDS`, by their raw path) becomes an `Exchange` (gateway/fastpath.py):
its head as httptools parsed it, its body as it arrives, served by
`FastPath.serve_exchange`, which writes the answer onto the connection itself. No ASGI
scope, request cycle, message dicts or body event per request. The parser's callbacks
and the transport's reads go to `Hooks` (gateway/hooks.py, compiled), not to uvicorn's
interpreted callbacks. Every other request (and a
proxied one with a query string, a %-escaped path, a root path, or under uvicorn's
limit_concurrency) is uvicorn's request cycle for the ASGI app, as before; both kinds may
follow each other, pipelined too, on one connection.

On a connection with hooks (every one where proxied routes are served off the connection;
otherwise uvicorn's timer runs as it is), the keep-alive timer is armed once per idle spell,
not once per request: when it fires it
closes a connection idle for `timeout_keep_alive` since its last answer, re-arms for what is
left of that, or leaves a connection with a request (or a request's head) in flight alone
until its answer is out. uvicorn arms one per answer and cancels it at the next request.

For the ASGI requests, the transport writes a whole response's head and body in one syscall:
uvicorn writes the status line and headers when the app sends `http.response.start`, and
the body when it sends `http.response.body`. Here the transport holds back a head that
declares a content-length (a whole answer, whose body follows at once) and writes it with
the body. A streamed answer (chunked, no content-length) is written as before, its head
straight away, so a client sees the headers of a stream before its first token.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.fastpath import Exchange
from gateway.hooks import Hooks

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
        elif data.endswith(b"\r\n\r\n") and data.startswith(b"HTTP/1.1 ") and data.find(b"\r\ncontent-length: ") >= 0:
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

    def is_closing(self) -> bool:  # asked once per answer: not through __getattr__'s failed lookup first
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's `http="httptools"` protocol over a `_Coalescing` transport. Where proxied routes
    are served off the connection (built with functools.partial(GatewayHttpProtocol, fast=...)),
    its parser calls a compiled `Hooks` (gateway/hooks.py), which turns a proxied route's
    request into an `Exchange` for `fast` and hands every other request back to uvicorn's
    callbacks here, for the ASGI app as before. Otherwise it is uvicorn's protocol as it is."""

    def __init__(self, *args: Any, fast: FastPath | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = fast
        self.raw_transport: asyncio.Transport | None = None  # past _Coalescing: an Exchange's writes are whole
        self._idle_since = 0.0
        # Exchanges only where uvicorn would hand every request the app as it is (no 503 app
        # under limit_concurrency, no root path, no fresh context per task).
        self.hooks: Hooks | None = None
        self.watched: list[Hangup] = []
        if (fast is not None and self.limit_concurrency is None and not self.root_path
                and not self.config.reset_contextvars):
            self.hooks = hooks = Hooks(self, fast)
            self.parser = hooks.parser  # type: ignore[assignment]  # (None only once closed)
            self.watched = hooks.watched
            # The transport looks this up once per connection: reads go straight to the parser.
            self.data_received = hooks.data_received  # type: ignore[method-assign]
        if fast is not None and fast.proxy_headers is None and self.config.proxy_headers:
            fast.proxy_headers = ProxyHeadersMiddleware(_nothing, self.config.forwarded_allow_ips)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.raw_transport = transport
        super().connection_made(_Coalescing(transport))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        if type(cycle) is Exchange and not cycle.response_complete:
            cycle.lost()
        self._stop_timer()
        super().connection_lost(exc)
        watched, self.watched = self.watched, []
        for hangup in watched:
            hangup.client_gone()
        watched.clear()
        # The request cycle (or exchange) holds this protocol's on_response_complete, and the
        # protocol holds it; the hooks hold the protocol and their parser, and both hold the
        # hooks: let reference counting free them all (tests/e2e/test_connection_garbage.py).
        self.cycle = None  # type: ignore[assignment]
        self.pipeline.clear()
        if self.hooks is not None:
            self.hooks.close()

    # -- requests (with hooks; without, uvicorn's callbacks run as they are) ---------------
    def begin_asgi(self, url: bytes, headers: list[tuple[bytes, bytes]], expect_100_continue: bool) -> None:
        """A request for the ASGI app, its head parsed by the hooks: uvicorn's scope and cycle."""
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect_100_continue
        self.scope["headers"] = headers
        super().on_headers_complete()

    def parse_failed(self, exc: Exception) -> None:
        """What uvicorn's data_received does when the parser raises."""
        if isinstance(exc, httptools.HttpParserUpgrade):
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if type(cycle) is Exchange and self.hooks is not None:
            self.hooks.start(cycle)
        else:
            super()._start_asgi_task(cycle, app)

    # -- keep-alive: a timer per idle spell, not one armed and cancelled per request ------
    def _unset_keepalive_if_required(self) -> None:
        if self.hooks is None:
            super()._unset_keepalive_if_required()
        # else the timer looks for itself when it fires (timeout_keep_alive_handler)

    def _stop_timer(self) -> None:
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def handle_websocket_upgrade(self) -> None:
        self._stop_timer()
        super().handle_websocket_upgrade()

    def on_response_complete(self) -> None:
        if self.hooks is None:
            super().on_response_complete()
            return
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = self.loop.time()
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        elif self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def timeout_keep_alive_handler(self) -> None:
        """Close the connection once it has been idle `timeout_keep_alive` seconds since its last
        answer. One busy with a request, or a request's head, is looked at again after its answer."""
        self.timeout_keep_alive_task = None
        if self.transport.is_closing():
            return
        if self.hooks is None:
            super().timeout_keep_alive_handler()
            return
        cycle = self.cycle
        if self.hooks.in_head or self.pipeline or (cycle is not None and not cycle.response_complete):
            return
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left <= 0:
            self.transport.close()
        else:
            self.timeout_keep_alive_task = self.loop.call_later(left, self.timeout_keep_alive_handler)


async def _nothing(*_: object) -> None:
    return None
