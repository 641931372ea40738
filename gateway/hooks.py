"""httptools' callbacks for one front connection, compiled (scripts/compile.py).

The parser of a `GatewayHttpProtocol` (gateway/server.py) calls these, not the protocol:
per request that is a callback for the request line, one per header, one at the end of the
head, one per piece of body and one at its end, and uvicorn's are interpreted Python. Here
they are native calls. A proxied route's request becomes an `Exchange` (gateway/fastpath.py)
and its task starts here; any other request is handed to the protocol's uvicorn callbacks
(scope, request cycle, ASGI app) exactly as before, with the head gathered so far.

The transport calls `data_received` here too: the protocol sets this object's bound method
as its own (uvloop looks it up once per connection), so a read reaches the parser without
an interpreted frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from httptools import HttpParserError, HttpParserUpgrade, HttpRequestParser

from gateway.fastpath import Exchange

if TYPE_CHECKING:
    from gateway.fastpath import FastPath
    from gateway.front import Hangup


class Hooks:
    """The parser's callbacks for one connection, with the head of the request being parsed."""

    def __init__(self, protocol: Any, fast: FastPath) -> None:
        self.protocol: Any = protocol  # a GatewayHttpProtocol; None once its connection is lost
        self.fast = fast
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
        # The hang-up watches of this connection's proxied requests in flight (gateway/front.py):
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
        try:
            parser.feed_data(data)
        except (HttpParserError, HttpParserUpgrade) as exc:
            protocol = self.protocol
            if protocol is not None:
                protocol.parse_failed(exc)

    def on_message_begin(self) -> None:
        self.in_head = True
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        protocol, parser = self.protocol, self.parser
        if protocol is None or parser is None:
            return
        kind: str | None = None
        path = b""
        if not parser.should_upgrade():
            path, _, query = self.url.partition(b"?")
            kind = None if query else self.fast.hot(parser.get_method(), path)
        if kind is None:  # the ASGI app's: uvicorn's scope and request cycle
            protocol.begin_asgi(self.url, self.headers, self.expect_100_continue)
            return
        existing = protocol.cycle
        protocol.cycle = ex = Exchange(
            kind,
            {"type": "http", "path": path.decode("ascii"), "headers": self.headers, "client": protocol.client,
             "scheme": protocol.scheme},
            protocol.raw_transport, protocol.flow, protocol.server_state.default_headers,
            parser.get_http_version() != "1.0" and parser.should_keep_alive(),
            self.expect_100_continue, self.fast.max_body_bytes(), protocol.on_response_complete,
        )
        if existing is None or existing.response_complete:
            self.start(ex)
        else:  # pipelined behind a request still being answered
            protocol.flow.pause_reading()
            protocol.pipeline.appendleft((ex, None))

    def start(self, ex: Exchange) -> None:
        """Serve `ex` in a task of its own, counted with the server's tasks as uvicorn's are."""
        protocol = self.protocol
        task = ex.task = protocol.loop.create_task(self.fast.serve_exchange(ex, self.watched))
        tasks = protocol.tasks
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def on_body(self, body: bytes) -> None:
        protocol = self.protocol
        if protocol is None:
            return
        cycle = protocol.cycle
        if type(cycle) is Exchange:
            cycle.feed(body)
        else:
            protocol.on_body(body)

    def on_message_complete(self) -> None:
        protocol = self.protocol
        if protocol is None:
            return
        cycle = protocol.cycle
        if type(cycle) is Exchange:
            cycle.end()
        else:
            protocol.on_message_complete()
