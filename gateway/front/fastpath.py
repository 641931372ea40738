"""The data plane as a raw ASGI app in front of Litestar.

The two proxied routes are the gateway's whole hot path, and Litestar's routing,
signature model, middleware and response objects cost about a third of the CPU of a
proxied request. This app answers the proxied POST routes (`requests.KINDS`) itself, through
the one answer path (gateway/front/answer.py) with its ASGI writer (gateway/front/asgi_answer.py);
everything else (lifespan, admin, models, metrics, docs) goes to Litestar unchanged.

Under the gateway's own server protocol (gateway/front/server.py) those routes skip ASGI as
well: the protocol parses the request into an `Exchange`, and `serve_exchange` answers it through
the same path with the `ConnectionWriter`, which writes the answer's bytes to the connection
itself (one write for a whole answer; for a stream, its head with what was relayed before the
loop turned, then one per relayed piece), with no scope, request cycle, message dicts, header
validation or proxy-headers middleware in between (X-Forwarded-For is honoured as that
middleware would, when a request has it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from litestar import Litestar

from gateway.engines.upstream import header_lines
from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge
from gateway.front import asgi_answer, front
from gateway.front.answer import answer
from gateway.front.asgi_answer import Receive, Scope, Send
from gateway.request.requests import KINDS, header_reader, headers_by_name

if TYPE_CHECKING:
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

# The proxied routes by their raw path (a path with %-escapes or a query is the ASGI app's).
_RAW_KINDS = {path.encode(): kind for path, kind in KINDS.items()}


class FastPath:
    def __init__(self, app: Litestar) -> None:
        self.app = app
        # uvicorn's X-Forwarded-For handling (gateway/front/server.py sets it), for requests that have it.
        self.proxy_headers: ProxyHeadersMiddleware | None = None

    def hot(self, method: bytes, raw_path: bytes) -> str | None:
        """The kind of request that `serve_exchange` answers (None: the ASGI app's)."""
        if method != b"POST":
            return None
        kind = _RAW_KINDS.get(raw_path)
        return kind if kind is not None and self.app.state.get("gw") is not None else None

    def max_body_bytes(self) -> int:
        return int(self.app.state["gw"].settings.max_body_bytes)

    def serve_exchange(self, ex: Exchange, watched: list[front.Hangup]) -> Coroutine[Any, Any, None]:
        """What answers one proxied request straight onto its connection (see the module's
        docstring), for the connection to run in a task: the one answer path's coroutine itself,
        with none around it (one coroutine less on every step of the request)."""
        names = headers_by_name(ex.scope["headers"])
        if self.proxy_headers is not None and (b"x-forwarded-for" in names or b"x-forwarded-proto" in names):
            return self._forwarded(ex, watched, names)
        return self._answer(ex, watched, names)

    def _answer(self, ex: Exchange, watched: list[front.Hangup], names: dict[bytes, bytes]) -> Coroutine[Any, Any, None]:
        scope = ex.scope
        client = scope["client"]
        # `watched`: the connection tells the hang-up itself, so no receive is watched.
        return answer(self.app.state["gw"], ConnectionWriter(ex), header_reader(names), client[0] if client else None,
                      ex.read_body, _nothing, scope["path"], ex.kind, watched)  # type: ignore[arg-type]

    async def _forwarded(self, ex: Exchange, watched: list[front.Hangup], names: dict[bytes, bytes]) -> None:
        """A request with X-Forwarded-For: uvicorn's middleware reads it into the scope first."""
        assert self.proxy_headers is not None
        await self.proxy_headers(ex.scope, _nothing, _nothing)  # type: ignore[arg-type]
        await self._answer(ex, watched, names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = KINDS.get(scope.get("path", "")) if scope["type"] == "http" else None
        gw = self.app.state.get("gw") if kind is not None and scope["method"] == "POST" else None
        if gw is None:
            await self.app(scope, receive, send)  # type: ignore[arg-type]
            return
        await asgi_answer.answer(gw, scope, receive, send, kind)  # type: ignore[arg-type]


async def _nothing(*_: object) -> None:
    return None


def _block(headers: Collection[tuple[str, str]]) -> bytes:
    """Header lines, UTF-8; a value holding CR or LF (a client's model name, say) is left out."""
    return header_lines(headers).encode()


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS = {code: _status_line(code) for code in range(100, 600)}
_JSON_HEAD = b"content-type: application/json\r\ncontent-length: "
_SSE_HEAD = (b"content-type: text/event-stream\r\ncache-control: no-cache\r\nx-accel-buffering: no\r\n"
             b"transfer-encoding: chunked\r\n")


class ConnectionWriter:
    """Writes one answer onto an `Exchange`'s connection (gateway/front/answer.py's `Writer`) and
    keeps its books as uvicorn's `send` would: started, complete, keep-alive or close, and the
    protocol told so it reads the next request.

    A stream's head waits in `pending` until the task that relays it yields to the loop (a
    `call_soon`), and pieces relayed meanwhile join it: a stream that arrives in one read (a
    short answer, a fast engine) leaves in one write, head, events and end together, instead of
    three. Once the head is out, each piece is written as it comes."""

    __slots__ = ("cycle", "pending", "transport")

    def __init__(self, cycle: Exchange) -> None:
        self.cycle = cycle
        self.transport = cycle.transport
        self.pending: list[bytes] = []

    def _head(self, status: int, headers: Collection[tuple[str, str]]) -> list[bytes]:
        cycle = self.cycle
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        parts = [_STATUS.get(status) or _status_line(status)]
        for name, value in cycle.default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(_block(headers))
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        return parts

    def _complete(self) -> None:
        cycle = self.cycle
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def answering(self, headers: list[tuple[str, str]]) -> None:
        self.cycle.answer_headers = headers  # its request id, should the client stall (gateway/front/server.py)

    @property
    def stalled(self) -> bool:
        return self.cycle.stalled

    def serving(self) -> asyncio.Task[Any] | None:
        return self.cycle.task  # (asyncio.current_task() is interpreted Python before 3.12)

    async def whole(self, status: int, headers: Collection[tuple[str, str]], body: bytes) -> None:
        if self.cycle.disconnected:
            return
        parts = self._head(status, headers)
        parts += (_JSON_HEAD, str(len(body)).encode(), b"\r\n\r\n", body)
        self.transport.write(b"".join(parts))
        self._complete()

    async def start(self, status: int, headers: Collection[tuple[str, str]]) -> None:
        if self.cycle.disconnected:
            return
        parts = self._head(status, headers)
        parts += (_SSE_HEAD, b"\r\n")
        self.pending.append(b"".join(parts))
        asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Write what waits in `pending` (the head, and pieces relayed with it)."""
        pending = self.pending
        if pending:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            if not self.cycle.disconnected:
                self.transport.write(data)

    def chunk(self, data: bytes) -> bool:
        """Write a piece of a stream; True when the client reads slower than it comes."""
        cycle = self.cycle
        if cycle.disconnected:
            return False
        if data:
            framed = b"%x\r\n%b\r\n" % (len(data), data)
            if self.pending:
                self.pending.append(framed)
            else:
                self.transport.write(framed)
        return cycle.flow.write_paused  # type: ignore[no-any-return]

    async def drain(self) -> None:
        await self.cycle.flow.drain()

    async def end(self) -> None:
        if not self.cycle.disconnected:
            if self.pending:
                self.pending.append(b"0\r\n\r\n")
                self.flush()
            else:
                self.transport.write(b"0\r\n\r\n")
            self._complete()

    def abort(self) -> None:
        """A stream broken off (no-op once complete): what was relayed goes out, then the
        connection closes, so that the client does not wait on it."""
        cycle = self.cycle
        if cycle.response_started and not cycle.response_complete and not cycle.disconnected:
            self.flush()
            self.transport.close()


class _NoEvent:
    __slots__ = ()

    def set(self) -> None:
        return None


class Exchange:
    """One proxied request on the gateway's connection protocol (gateway/front/server.py): its head
    as parsed, its body as it arrives, and the books that `ConnectionWriter` keeps as uvicorn's request
    cycle would (started, complete, keep-alive or close), with no ASGI in between."""

    __slots__ = ("_chunks", "_error", "_limit", "_size", "_waiter", "answer_headers", "default_headers",
                 "disconnected", "flow", "keep_alive", "kind", "more_body", "on_response", "response_complete",
                 "response_started", "scope", "stalled", "task", "transport", "waiting_for_100_continue")
    # uvicorn's protocol sets its request cycle's event when the connection closes; nobody waits here.
    message_event = _NoEvent()

    def __init__(self, kind: str, scope: Scope, transport: asyncio.Transport, flow: Any,
                 default_headers: list[tuple[bytes, bytes]], keep_alive: bool, expect_100_continue: bool,
                 limit: int, on_response: Callable[[], None]) -> None:
        self.kind = kind
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.on_response = on_response
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.more_body = True
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._error: GatewayError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None  # the task serving it, once the server starts one
        # Its answer's headers once it has one, and whether its client stopped reading past
        # send_timeout_s (gateway/front/server.py sets it as it closes the connection).
        self.answer_headers: list[tuple[str, str]] | None = None
        self.stalled = False

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- fed by the protocol -----------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._error is not None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self.give_up(RequestTooLarge.over(self._limit))
            return
        self._chunks.append(data)

    def give_up(self, error: GatewayError) -> None:
        """Read no more of the body: the request is answered `error` and its connection closes
        (a body over the limit, or too slow: gateway/front/server.py)."""
        self._chunks.clear()
        self._error = error
        self.keep_alive = False  # the rest of the body is never read
        self._wake()

    def end(self) -> None:
        self.more_body = False
        self._wake()

    def lost(self) -> None:
        self.disconnected = True
        self._wake()

    # -- read by the request's task --------------------------------------------------------
    async def read_body(self) -> bytes:
        while self.more_body and self._error is None:
            if self.disconnected:
                raise InvalidRequest("The client went away before sending the whole body.")
            if self.waiting_for_100_continue and not self.response_started:
                self.waiting_for_100_continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
