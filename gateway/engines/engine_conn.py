"""HTTP/1.1 to the engines: keep-alive connections as asyncio protocols with httptools' parser.

The gateway sends every proxied request to an engine, and aiohttp's client (request and
response objects, payload wrappers, a stream reader, a timer per read) cost about a third
of the gateway's CPU per request. The engines speak plain HTTP/1.1 on a trusted network,
and the gateway needs little of a general client: POST a body it already has, wait for
the status, then read the whole answer or each piece of a stream as it arrives. This
module does just that, on the same parser uvicorn uses (httptools/llhttp: chunked
bodies, keep-alive, limits). Errors here are plain `ConnectionError`/`TimeoutError`;
gateway/engines/upstream.py translates them into the gateway's error tree.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

from gateway.engines.patience import Patience

# A stream whose client reads slower than the engine writes: stop reading the engine at
# this many buffered bytes (the engine's own send buffer then pushes back on it).
_HIGH_WATER = 1 << 20
_MAX_IDLE_PER_ENGINE = 1024
# A released answer whose body has not ended: how long its connection may take to end it.
_DRAIN_S = 5.0


class Target:
    """Where a URL's requests go, parsed once: the pool key and the request line's pieces."""

    __slots__ = ("host", "key", "port", "prefix", "ssl")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.key = (parts.scheme, self.host, self.port)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        netloc = parts.netloc.rpartition("@")[2]
        # Everything of a request's head that does not depend on the request.
        self.prefix = f" {path} HTTP/1.1\r\nhost: {netloc}\r\n".encode("latin-1")


class Response:
    """One engine answer: its status at once, then its body as it arrives."""

    __slots__ = ("_buffer", "_buffered", "_conn", "_error", "_paused", "_waiter", "content_type", "done",
                 "status", "timeout")

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.content_type = ""
        self.done = False  # the whole body arrived
        self.timeout: float | None = None  # the longest wait for more of a whole answer's body
        self._buffer: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection ---------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        if self._conn.draining is not None:
            return  # released: nobody reads it
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self.done and self._error is None:
            self._error = exc
        self._wake()

    # -- read by the gateway -----------------------------------------------------------
    def _take(self) -> bytes:
        buffer = self._buffer
        data = buffer.popleft() if len(buffer) == 1 else b"".join(buffer)
        buffer.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self._conn.transport is not None:
                self._conn.transport.resume_reading()
        return data

    async def _wait(self, limit_s: float | None) -> None:
        # One timer handle rather than asyncio.timeout's context per wait: this is every request's path.
        loop = self._conn.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(limit_s, _expire, waiter) if limit_s is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def head(self, limit_s: float, patience: Patience | None = None) -> None:
        """Wait for the status and headers, at most `limit_s` seconds; with `patience`, cut
        sooner (TimeoutError, `patience.cut` set) unless it says, when asked, that the wait goes on."""
        if self.status:
            return
        loop = self._conn.loop
        deadline = loop.time() + limit_s
        while not self.status:
            if self._error is not None:
                raise self._error
            now = loop.time()
            remaining = deadline - now
            if remaining <= 0:
                raise TimeoutError
            if patience is None or patience.at >= deadline:
                await self._wait(remaining)
            elif patience.at > now:
                # The same one timer per wait: the check's time, then (next turn) the check.
                try:
                    await self._wait(patience.at - now)
                except TimeoutError:
                    pass
            elif not patience.goes_on(now):
                raise TimeoutError

    async def readany(self) -> bytes:
        """What has arrived (waiting for something if nothing has); b"" once the body is over.
        The caller times the wait (a stream's stall limit is its own)."""
        while True:
            if self._buffer:
                return self._take()
            if self.done:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait(None)

    async def read(self, each_s: float | None = None) -> bytes:
        """The whole body; `each_s` bounds each wait for more of it."""
        while not self.done:
            if self._error is not None:
                raise self._error
            await self._wait(each_s)
        return self._take() if self._buffer else b""

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it can carry another."""
        conn = self._conn
        if conn.response is not self:
            return
        self._buffer.clear()
        if self._error is not None or not conn.reusable():
            conn.response = None
            conn.abort()
        elif self.done:
            conn.response = None
            conn.pool.put(conn)
        else:  # a stream's [DONE] came before the body's end (vLLM's last chunk follows it)
            conn.draining = conn.loop.call_later(_DRAIN_S, conn.abort)

    def close(self) -> None:
        """Drop the connection (the engine sees its request's connection close and aborts it)."""
        conn = self._conn
        if conn.response is self:
            conn.response = None
        conn.abort()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; at most one request on it at a time."""

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        # It holds this connection's callbacks, and the connection holds it: connection_lost lets go.
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self.used = False  # carried a request before (a stale keep-alive may be closed under it)
        self.got_bytes = False
        self.framed = False  # the body's end is known from its head (length or chunked), not EOF
        self.keep_alive = True
        self.draining: asyncio.TimerHandle | None = None  # released, waiting for its body's end
        # The body's pieces parsed from one read (httptools calls on_body once per chunk of a
        # chunked body: once per SSE event), handed to the response together at the read's end.
        self.pieces: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: an engine closing an idle connection says so
            self.abort()
            return
        parser = self.parser
        if parser is None:
            return
        self.got_bytes = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._deliver()
            self._lost(ConnectionError(f"malformed answer from the engine: {exc}"))
            self.abort()
            return
        self._deliver()

    def _deliver(self) -> None:
        pieces = self.pieces
        if pieces:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            if self.response is not None:
                self.response._feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.parser = None  # (reference counting frees both: tests/unit/test_engine_conn.py)
        if self.response is None:
            self.pool.discard(self)  # an idle connection the engine closed (or the engine went away)
        if self.draining is not None:
            self.draining.cancel()
            self.draining = None
        self._lost(ConnectionError("the engine closed the connection"))

    def _lost(self, exc: BaseException) -> None:
        resp = self.response
        if resp is None or resp.done:
            return
        if resp.status and not self.framed and resp._error is None:
            resp.done = True  # a body that runs to the end of the connection has ended
            resp._wake()
        else:
            resp._fail(exc)

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type" and self.response is not None:
            self.response.content_type = value.decode("latin-1").partition(";")[0].strip()
        elif lower in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        resp, parser = self.response, self.parser
        if resp is not None and parser is not None:
            resp.status = parser.get_status_code()
            self.keep_alive = parser.should_keep_alive()
            resp._wake()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self._deliver()
        resp = self.response
        if resp is not None:
            resp.done = True
            resp._wake()
            if self.draining is not None:
                self.draining.cancel()
                self.draining = None
                self.response = None
                if self.reusable():
                    self.pool.put(self)
                else:
                    self.abort()

    def reusable(self) -> bool:
        return self.keep_alive and not self.closed and self.transport is not None

    def write_request(self, head: bytes, body: bytes) -> Response:
        """Write a request (its head, then its body) and return the answer to wait on."""
        resp = self.response = Response(self)
        self.got_bytes = False
        self.framed = False
        self.keep_alive = True
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return resp

    def abort(self) -> None:
        self.closed = True
        if self.draining is not None:
            self.draining.cancel()
            self.draining = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


class Pool:
    """Idle keep-alive connections per engine, most recently used first."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float = 30.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closing = False

    def put(self, conn: _Conn) -> None:
        if self.closing:
            conn.abort()
            return
        idle = self._idle.setdefault(conn.key, [])
        now = time.monotonic()
        while idle and (idle[0].closed or now - idle[0].idle_since >= self.keepalive_s):
            idle.pop(0).abort()  # the oldest first: closed by the engine or kept too long
        if len(idle) >= _MAX_IDLE_PER_ENGINE:
            conn.abort()
            return
        conn.used = True
        conn.idle_since = now
        idle.append(conn)

    def discard(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    def take(self, target: Target) -> _Conn | None:
        idle = self._idle.get(target.key)
        if idle is None:
            return None
        now = time.monotonic()
        found = None
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                found = conn
                break
            conn.abort()
        if not idle:
            del self._idle[target.key]  # no list is kept for an engine with nothing idle (engines come and go)
        return found

    async def connect(self, target: Target) -> _Conn:
        loop = asyncio.get_running_loop()
        context = None
        if target.ssl:
            context = self._ssl = self._ssl or ssl.create_default_context()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: _Conn(self, loop, target.key), target.host, target.port, ssl=context,
            )
        return conn

    def close(self) -> None:
        self.closing = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
            idle.clear()
