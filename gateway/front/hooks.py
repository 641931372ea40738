"""httptools' callbacks for one front connection, compiled (scripts/compile.py).

The parser of a `GatewayHttpProtocol` (gateway/front/server.py) calls these, not the protocol:
per request that is a callback for the request line, one per header, one at the end of the
head, one per piece of body and one at its end, and uvicorn's are interpreted Python. Here
they are native calls. A proxied route's request becomes an `Exchange` (gateway/front/fastpath.py)
and its task starts here; any other request is handed to the protocol's uvicorn callbacks
(scope, request cycle, ASGI app) exactly as before, with the head gathered so far.

The transport calls `data_received` here too: the protocol sets this object's bound method
as its own (uvloop looks it up once per connection), so a read reaches the parser without
an interpreted frame.

The limits on a head (gateway/front/front_limits.py) are kept here, where its bytes arrive: the
target as the parser hands it over, each whole header line as it is parsed, and the raw
bytes of a head still unfinished after a read (the parser holds a partial header line
until its end, however long), so a head is refused once over its limit, not once read.
A refusal raised in a callback stops the parser; the protocol answers it and closes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser

from gateway.front.fastpath import Exchange

if TYPE_CHECKING:
    from gateway.front.fastpath import FastPath
    from gateway.front.front import Hangup
    from gateway.front.front_limits import FrontLimits


class _Refused(Exception):
    """Raised in a parser callback to stop the parser at a limit (`Hooks.refusal` says which)."""


class Hooks:
    """The parser's callbacks for one connection, with the head of the request being parsed.
    `fast` None: every request is the ASGI app's (the gateway runs without its fast path)."""

    def __init__(self, protocol: Any, fast: FastPath | None, limits: FrontLimits) -> None:
        self.protocol: Any = protocol  # a GatewayHttpProtocol; None once its connection is lost
        self.fast = fast
        self.max_target = limits.max_request_line_bytes
        self.max_head = limits.max_header_bytes
        self.max_headers = limits.max_headers
        self.clock: Callable[[], float] = protocol.loop.time
        parser = HttpRequestParser(self)
        try:  # as uvicorn sets its own parser (httptools >= 0.6.3)
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # pragma: no cover
            pass
        # It holds this object's callbacks, and this object holds it: `close` lets go.
        self.parser: HttpRequestParser | None = parser
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        self.in_head = False  # a request's head is arriving
        self.head_started = 0.0  # when its first byte came (the loop's clock)
        self.head_bytes = 0  # its target and whole header lines so far
        self.unparsed = 0  # raw bytes of it so far, as far as reads tell
        self.began = 0  # messages begun in the read being parsed
        self.in_body = False  # its body is arriving
        self.body_bytes = 0
        self.refusal = ""  # the limit (gateway/front/front_limits.py) a callback stopped the parser at
        # The hang-up watches of this connection's proxied requests in flight (gateway/front/front.py):
        # told when the connection closes, so no request needs a watcher task of its own.
        self.watched: list[Hangup] = []

    def close(self) -> None:
        """The connection is gone: let go of the protocol and of the parser, so that reference
        counting frees all three (tests/e2e/test_connection_garbage.py)."""
        self.protocol = None
        self.parser = None

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:
            return
        idle = not self.in_head and not self.in_body  # the read starts between two messages
        self.began = 0
        try:
            parser.feed_data(data)
        except (HttpParserError, HttpParserUpgrade) as exc:
            protocol = self.protocol
            if protocol is not None:
                if self.refusal:
                    self.parser = None
                    protocol.refuse(self.refusal)
                else:
                    protocol.parse_failed(exc)
            return
        if self.in_head:  # a head still unfinished: what the parser holds of it is bounded
            began = self.began
            if began == 0:  # the whole read was more of it
                self.unparsed += len(data)
            elif began == 1 and idle:  # the whole read was the start of it
                self.unparsed = len(data)
            # (else it began after another message in this read: its share of the read is not known)
            if self.unparsed > self.max_head:
                protocol = self.protocol
                if protocol is not None:
                    self.parser = None
                    protocol.refuse("header_too_large")

    def _refuse(self, reason: str) -> _Refused:
        self.refusal = reason
        return _Refused(reason)

    def on_message_begin(self) -> None:
        self.in_head = True
        self.began += 1
        self.head_started = self.clock()
        self.head_bytes = 0
        self.unparsed = 0
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)
        if len(self.url) > self.max_target:
            raise self._refuse("request_line_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.max_head:
            raise self._refuse("header_too_large")
        if len(self.headers) >= self.max_headers:
            raise self._refuse("too_many_headers")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.in_body = True
        self.body_bytes = 0
        protocol, parser = self.protocol, self.parser
        if protocol is None or parser is None:
            return
        fast = self.fast
        kind: str | None = None
        path = b""
        if fast is not None and not parser.should_upgrade():
            path, _, query = self.url.partition(b"?")
            kind = None if query else fast.hot(parser.get_method(), path)
        if kind is None or fast is None:  # the ASGI app's: uvicorn's scope and request cycle
            protocol.begin_asgi(self.url, self.headers, self.expect_100_continue)
            return
        existing = protocol.cycle
        protocol.cycle = ex = Exchange(
            kind,
            {"type": "http", "path": path.decode("ascii"), "headers": self.headers, "client": protocol.client,
             "scheme": protocol.scheme},
            protocol.raw_transport, protocol.flow, protocol.server_state.default_headers,
            parser.get_http_version() != "1.0" and parser.should_keep_alive(),
            self.expect_100_continue, fast.max_body_bytes(), protocol.on_response_complete,
        )
        if existing is None or existing.response_complete:
            self.start(ex)
        else:  # pipelined behind a request still being answered
            protocol.flow.pause_reading()
            protocol.pipeline.appendleft((ex, None))

    def start(self, ex: Exchange) -> None:
        """Serve `ex` in a task of its own, counted with the server's tasks as uvicorn's are."""
        protocol, fast = self.protocol, self.fast
        assert fast is not None  # (an Exchange is made only with a fast path)
        protocol.answering = ex  # (its `cycle` may be a pipelined request parsed since)
        task = ex.task = protocol.loop.create_task(fast.serve_exchange(ex, self.watched))
        tasks = protocol.tasks
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        protocol = self.protocol
        if protocol is None:
            return
        cycle = protocol.cycle
        if type(cycle) is Exchange:
            cycle.feed(body)
        else:
            protocol.on_body(body)

    def on_message_complete(self) -> None:
        self.in_body = False
        protocol = self.protocol
        if protocol is None:
            return
        cycle = protocol.cycle
        if type(cycle) is Exchange:
            cycle.end()
        else:
            protocol.on_message_complete()
