"""uvicorn's httptools protocol, with the proxied routes served straight off the connection.

A request for a proxied route (POST /v1/chat/completions, /v1/completions and the others of
`gateway.request.requests.KINDS`, by their raw path) becomes an `Exchange` (gateway/front/fastpath.py):
its head as httptools parsed it, its body as it arrives, served by
`FastPath.serve_exchange` through the one answer path (gateway/front/answer.py) with a
`ConnectionWriter`, which writes the answer onto the connection itself. No ASGI
scope, request cycle, message dicts or body event per request. The parser's callbacks
and the transport's reads go to `Hooks` (gateway/front/hooks.py, compiled), not to uvicorn's
interpreted callbacks. Every other request (and a
proxied one with a query string, a %-escaped path, a root path, or under uvicorn's
limit_concurrency) is uvicorn's request cycle for the ASGI app, as before; both kinds may
follow each other, pipelined too, on one connection.

On a connection with hooks (every one, unless uvicorn is told limit_concurrency, a root path or
fresh contextvars; then uvicorn's callbacks and timer run as they are, but for the reads held
while the writes are paused, below), one timer keeps every deadline of the connection
(gateway/front/front_limits.py), armed once per idle spell, not once per request: when it fires
it looks at what the connection is doing and closes it past that deadline or re-arms for what
is left. Idle, `timeout_keep_alive` (the setting idle_timeout_s) since it opened or since its
last answer; a head arriving, header_timeout_s since its first byte; a body arriving,
body_timeout_s since its request's first byte plus a second per body_min_rate bytes (then 408);
a request being answered is looked at again after its answer. uvicorn arms one per answer and
cancels it at the next request. The parser hooks refuse a head over its limits (414, 431); a
connection past max_connections is answered 503 and closed as it opens.

Every answer leaves through this connection's one transport, whichever writes it (the fast
path's `ConnectionWriter`, uvicorn's request cycle for the ASGI app and Litestar, a refusal),
so the send limit is kept here, on the transport's flow control, not per write: the transport
calls `pause_writing` when its buffer passes its high-water mark (the client reads slower than
the answer comes) and `resume_writing` once it drains. A timer is armed on the pause and
cancelled on the resume; one that fires (send_timeout_s with the writes paused throughout: a
client that reads nothing, or too little to drain the buffer) closes the connection, which
cancels a request still being answered as a hang-up does, so its engine lets go of the request.
While the writes are paused the reads are paused too (issue 35), on every connection, with
hooks or without: the connection's next request, pipelined or not, is not parsed, and one
parsed already in the same read is not started, until they resume, so a client that pipelines
requests and reads no answer makes the gateway hold one answer, not one per request. The
connection's other deadlines do not count that time; the send limit does.

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
import structlog
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.front import front
from gateway.front.fastpath import Exchange
from gateway.front.front_limits import FrontGuard
from gateway.front.hooks import Hooks
from gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from gateway.front.fastpath import FastPath
    from gateway.front.front import Hangup

log = structlog.get_logger("gateway.front")


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
    """uvicorn's `http="httptools"` protocol over a `_Coalescing` transport, built with
    functools.partial(GatewayHttpProtocol, fast=..., guard=...). Its parser calls a compiled
    `Hooks` (gateway/front/hooks.py), which keeps the limits of `guard` on each head, turns a
    proxied route's request into an `Exchange` for `fast` (where given) and hands every
    other request back to uvicorn's callbacks here, for the ASGI app as before."""

    def __init__(self, *args: Any, fast: FastPath | None = None, guard: FrontGuard | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = fast
        self.guard = guard if guard is not None else FrontGuard.from_settings(GatewaySettings())
        self.raw_transport: asyncio.Transport | None = None  # past _Coalescing: an Exchange's writes are whole
        self._idle_since = 0.0
        self._counted = False  # in guard.open
        self._send_timer: asyncio.TimerHandle | None = None  # armed while the writes are paused
        self._reads_held_at: float | None = None  # when the paused writes held the reads
        self._next_held = False  # an answer completed while they were held: the next request waits
        # The request last taken up (`cycle` is the last one parsed: a pipelined one may wait).
        self.answering: Any = None
        # Hooks only where uvicorn would hand every request the app as it is (no 503 app
        # under limit_concurrency, no root path, no fresh context per task).
        self.hooks: Hooks | None = None
        self.watched: list[Hangup] = []
        if self.limit_concurrency is None and not self.root_path and not self.config.reset_contextvars:
            self.hooks = hooks = Hooks(self, fast, self.guard.limits)
            self.parser = hooks.parser  # type: ignore[assignment]  # (None only once closed)
            self.watched = hooks.watched
            # The transport looks this up once per connection: reads go straight to the parser.
            self.data_received = hooks.data_received  # type: ignore[method-assign]
        if fast is not None and fast.proxy_headers is None and self.config.proxy_headers:
            fast.proxy_headers = ProxyHeadersMiddleware(_nothing, self.config.forwarded_allow_ips)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.raw_transport = transport
        super().connection_made(_Coalescing(transport))  # type: ignore[arg-type]
        guard = self.guard
        guard.open += 1
        self._counted = True
        if guard.open > guard.max_connections:
            self.refuse("connection_limit")
        elif self.hooks is not None:  # the first byte's deadline
            self._idle_since = self.loop.time()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.guard.open -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        cycle = self.cycle
        if type(cycle) is Exchange and not cycle.response_complete:
            cycle.lost()
        self._stop_timer()
        self._stop_send_timer()
        super().connection_lost(exc)
        watched, self.watched = self.watched, []
        for hangup in watched:
            hangup.client_gone()
        watched.clear()
        # The request cycle (or exchange) holds this protocol's on_response_complete, and the
        # protocol holds it; the hooks hold the protocol and their parser, and both hold the
        # hooks: let reference counting free them all (tests/e2e/test_connection_garbage.py).
        self.cycle = None  # type: ignore[assignment]
        self.answering = None
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

    def refuse(self, reason: str) -> None:
        """A limit (gateway/front/front_limits.py) was hit: counted, answered where the limit has an
        answer and no other answer is under way on this connection, and the connection closed."""
        answer = self.guard.refuse(reason)
        cycle = self.cycle
        if answer is not None and not self.pipeline and (cycle is None or cycle.response_complete):
            self.transport.write(answer)
        self.transport.close()

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
        self.answering = cycle
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
        self._stop_send_timer()
        self._uncount()  # the transport's next protocol is uvicorn's, not counted
        super().handle_websocket_upgrade()

    def on_response_complete(self) -> None:
        hooks = self.hooks
        if hooks is None and self._reads_held_at is None:
            super().on_response_complete()
            return
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if hooks is None:  # uvicorn's callbacks, the reads held: as uvicorn's, but the next request waits
            self._unset_keepalive_if_required()
            self._next_held = True  # (resume_writing takes it up)
            return
        self._idle_since = now = self.loop.time()
        if self._reads_held_at is not None:  # the writes are paused: the next request waits for them
            self._next_held = True  # (resume_writing takes it up, and arms the timer)
            return
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request: its clock starts now, as it is taken up
            hooks.head_started = now
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def timeout_keep_alive_handler(self) -> None:
        """The connection's deadline (see the module's docstring): close it past the deadline of
        what it is doing, else look again when that is due. One busy with a request is looked at
        again after its answer."""
        self.timeout_keep_alive_task = None
        hooks = self.hooks
        if self.transport.is_closing():
            return
        if hooks is None:
            super().timeout_keep_alive_handler()
            return
        if self._reads_held_at is not None:  # waiting on the client to read: the send limit's to judge
            return  # (resume_writing arms this again)
        now = self.loop.time()
        limits = self.guard.limits
        cycle = self.cycle
        if hooks.in_body and not self.pipeline:
            due = hooks.head_started + limits.body_timeout_s + hooks.body_bytes / limits.body_min_rate
            if now >= due:
                self._body_too_slow()
                return
        elif hooks.in_head:
            due = hooks.head_started + limits.header_timeout_s
            if now >= due:
                self.refuse("header_timeout")
                return
        elif self.pipeline or (cycle is not None and not cycle.response_complete):
            return
        else:
            due = self._idle_since + self.timeout_keep_alive
            if now >= due:
                if cycle is None:  # it never sent a request
                    self.guard.refuse("idle_timeout")
                self.transport.close()
                return
        self.timeout_keep_alive_task = self.loop.call_later(due - now, self.timeout_keep_alive_handler)

    def _body_too_slow(self) -> None:
        """408: an Exchange's task answers it (its read of the body raises); an ASGI request's
        answer is written here (its app then reads a disconnect)."""
        cycle, guard = self.cycle, self.guard
        answer = guard.refuse("body_timeout")
        if cycle is None or cycle.response_started:  # answered (or answering) already: only closed
            self.transport.close()
        elif type(cycle) is Exchange:
            cycle.give_up(guard.error("body_timeout"))  # its task answers, and closes the connection
        else:
            cycle.disconnected = True  # its app reads a disconnect; an answer it sends goes nowhere
            cycle.message_event.set()
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()

    # -- the send limit: a timer per pause of the writes, none per write ---------------------
    def pause_writing(self) -> None:
        self.flow.pause_writing()
        self.guard.send_paused += 1
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.guard.limits.send_timeout_s, self._send_timed_out)
        if self._reads_held_at is None:
            # Read nothing more while the client reads nothing: a next request (pipelined or
            # not) is neither parsed nor started, so one connection holds one answer's bytes,
            # not one per request it sends (issue 35). A hang-up is still seen: its reset
            # fails the pending write.
            self._reads_held_at = self.loop.time()
            self.flow.pause_reading()

    def resume_writing(self) -> None:
        self.flow.resume_writing()
        self._stop_send_timer()
        held_at = self._reads_held_at
        if held_at is None:
            return
        self._reads_held_at = None
        if self.transport.is_closing():
            return
        hooks = self.hooks
        now = self.loop.time()
        if hooks is not None and (hooks.in_head or hooks.in_body):  # its clock does not count the held time
            hooks.head_started += now - held_at
        if self._next_held:  # what on_response_complete left for now
            self._next_held = False
            self._idle_since = now
            self.flow.resume_reading()
            if self.pipeline:
                if hooks is not None:
                    hooks.head_started = now
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            elif hooks is None and self.timeout_keep_alive_task is None:  # idle: uvicorn's keep-alive timer
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
        elif not self.pipeline:  # an answer under way, none queued behind it: read on, as before the pause
            self.flow.resume_reading()
        # With hooks the timer looks at what the connection does when it fires; uvicorn's (hookless)
        # closes it, so it is armed only on an idle connection, as uvicorn arms it.
        if hooks is not None and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        """The writes stayed paused send_timeout_s: the client reads too little of its answer to
        drain the gateway's buffer. Counted, logged with the request's id, and the connection
        aborted (a close would wait for the buffer to drain, which this client never lets
        happen); losing it cancels a request still being answered as a hang-up does, marked as
        the client's stall so that its summary line says so (gateway/front/front.py,
        `tell_stalled`)."""
        self._send_timer = None
        self.guard.refuse("send_timeout")
        cycle = self.answering
        headers: Any = None
        if type(cycle) is Exchange:
            cycle.stalled = True
            headers = cycle.answer_headers
        elif cycle is not None:  # uvicorn's request cycle: the ASGI app's scope (front.answering)
            scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]  # (a TypedDict; keys of our own)
            scope[front.STALLED] = True
            headers = scope.get(front.ANSWER_HEADERS)
        request_id = front.request_id_in(headers)
        # One line per proxied request (which has its own summary line already); a stall on
        # another route is in gateway.front_refused's counts only (under attack a line per
        # connection would be the attacker's).
        if request_id is not None:
            log.warning("gateway.client_stalled", request_id=request_id, send_timeout_s=self.guard.limits.send_timeout_s,
                        unsent_bytes=self.transport.get_write_buffer_size(),
                        answering=cycle is not None and not cycle.response_complete)
        self.transport.abort()


async def _nothing(*_: object) -> None:
    return None
