"""The gateway's HTTP/1.1 client to the engines (gateway/engines/engine_conn.py via gateway/engines/upstream.py),
against small real servers on loopback that misbehave in the ways engines do."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.engines.engine_conn import Target, _Conn
from gateway.engines.upstream import Upstream
from gateway.errors import UpstreamError, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
JSON = b'{"ok":true}'


def whole(body: bytes = JSON, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json; charset=utf-8\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class Server:
    """Counts connections and requests; `handler(reader, writer, n)` answers request n (from 1)
    and says whether the connection stays open."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                self.requests.append(await read_request(reader))
                if not await self.handler(reader, writer, len(self.requests)):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        server = Server(handler)
        srv = await asyncio.start_server(server._serve, "127.0.0.1", 0)
        servers.append(srv)
        server.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        return server

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream(connect_timeout_s=2)
    await up.start()
    yield up
    await up.close()


async def post(up: Upstream, url: str, *, stream: bool = False, first_byte_s: float = 5) -> tuple[int, str, bytes]:
    resp = await up.post(url + "/v1/completions", b'{"prompt":"hi"}', {"content-type": "application/json",
                                                                         "x-request-id": "r1"}, stream, first_byte_s)
    try:
        return resp.status, resp.content_type, await up.read(resp)
    finally:
        resp.release()


async def test_keep_alive_carries_requests_one_after_another(serve, upstream) -> None:
    async def answer(reader, writer, n):
        writer.write(whole())
        return True

    server = await serve(answer)
    for _ in range(3):
        assert await post(upstream, server.url) == (200, "application/json", JSON)
    assert server.connections == 1
    head = server.requests[0].split(b"\r\n\r\n")[0].decode()
    assert head.startswith("POST /v1/completions HTTP/1.1\r\n")
    assert f"host: {server.url[7:]}" in head and "x-request-id: r1" in head and "content-length: 15" in head


async def test_a_keep_alive_the_engine_closed_as_the_request_went_out_is_sent_again_on_a_new_one(serve, upstream):
    async def answer(reader, writer, n):
        if n == 2:  # read the request, then close without a byte: the idle-timeout race
            return False
        writer.write(whole())
        return True

    server = await serve(answer)
    assert (await post(upstream, server.url))[0] == 200
    assert (await post(upstream, server.url))[0] == 200
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_fresh_connection_closed_without_an_answer_is_an_upstream_error(serve, upstream) -> None:
    async def answer(reader, writer, n):
        return False

    server = await serve(answer)
    with pytest.raises(UpstreamError, match="unreachable"):
        await post(upstream, server.url)
    assert server.connections == 1


async def test_a_body_cut_short_is_an_upstream_error_and_the_connection_is_not_reused(serve, upstream) -> None:
    async def answer(reader, writer, n):
        if n == 1:
            writer.write(whole()[:-4])
            await writer.drain()
            return False
        writer.write(whole())
        return True

    server = await serve(answer)
    with pytest.raises(UpstreamError, match="connection broke"):
        await post(upstream, server.url)
    assert (await post(upstream, server.url))[0] == 200
    assert server.connections == 2


async def test_a_body_that_runs_to_the_end_of_the_connection_is_whole(serve, upstream) -> None:
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 404 Not Found\r\nconnection: close\r\n\r\nno such ")
        await writer.drain()
        writer.write(b"model")
        return False

    server = await serve(answer)
    assert await post(upstream, server.url) == (404, "", b"no such model")


async def test_a_hung_engine_is_given_up_after_the_limit_once(serve, upstream) -> None:
    async def answer(reader, writer, n):
        if n == 1:
            writer.write(whole())
            return True
        await asyncio.sleep(30)
        return False

    server = await serve(answer)
    await post(upstream, server.url)  # a kept-alive connection, so the hang happens on a reused one
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        await post(upstream, server.url, stream=True, first_byte_s=0.3)
    assert 0.25 < time.monotonic() - started < 0.6  # not sent again after its timeout


async def test_an_unreachable_engine_is_an_upstream_error(upstream) -> None:
    with pytest.raises(UpstreamError, match="unreachable"):
        await post(upstream, "http://127.0.0.1:9")


async def test_an_engines_address_is_in_the_errors_detail_never_its_message(serve, upstream) -> None:
    """What the client reads names no engine; what the log and the admin API read does."""
    async def hang(reader, writer, n):
        await asyncio.sleep(30)
        return False

    server = await serve(hang)
    for url, kwargs in (("http://127.0.0.1:9", {}), (server.url, {"stream": True, "first_byte_s": 0.2})):
        with pytest.raises(UpstreamError) as caught:
            await post(upstream, url, **kwargs)
        assert "127.0.0.1" not in caught.value.message and "127.0.0.1" not in caught.value.body().decode()
        assert url in caught.value.detail


async def test_a_stream_is_read_as_it_arrives_and_its_connection_reused_after_its_last_chunk(serve, upstream):
    go_on = asyncio.Event()

    async def answer(reader, writer, n):
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"d\r\ndata: first\n\n\r\n")
            await writer.drain()
            await go_on.wait()
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)  # vLLM's last chunk comes after [DONE], on its own
            writer.write(b"0\r\n\r\n")
            return True
        writer.write(whole())
        return True

    server = await serve(answer)
    resp = await upstream.post(server.url + "/v1/completions", b"{}", {}, True, 5)
    assert (resp.status, resp.content_type) == (200, "text/event-stream")
    assert await resp.readany() == b"data: first\n\n"
    go_on.set()
    assert await resp.readany() == b"data: [DONE]\n\n"
    resp.release()  # before the body's end: the connection waits for it, then goes back
    await asyncio.sleep(0.2)
    assert (await post(upstream, server.url))[0] == 200
    assert server.connections == 1


async def test_closing_a_stream_closes_its_connection(serve, upstream) -> None:
    closed = asyncio.Event()

    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        assert await reader.read(10) == b""  # the gateway hung up: the engine would abort here
        closed.set()
        return False

    server = await serve(answer)
    resp = await upstream.post(server.url + "/v1/completions", b"{}", {}, True, 5)
    assert await resp.readany() == b"hello"
    resp.close()
    await asyncio.wait_for(closed.wait(), 2)


async def test_the_pool_forgets_an_engine_once_its_idle_connection_is_closed(serve, upstream) -> None:
    """Engines come and go: a departed engine's closed keep-alive leaves nothing behind in the pool."""
    async def answer(reader, writer, n):
        writer.write(whole())
        await writer.drain()
        await asyncio.sleep(0.05)  # the answer is read and the connection pooled, then the engine goes
        return False

    servers = [await serve(answer) for _ in range(3)]
    for server in servers:
        assert (await post(upstream, server.url))[0] == 200
    pool = upstream._pool
    assert pool is not None
    for _ in range(200):  # the engines' closes arrive within 2 s
        if not pool._idle:
            break
        await asyncio.sleep(0.01)
    assert pool._idle == {}


def _closed_conns() -> list[_Conn]:
    return [o for o in gc.get_objects() if type(o) is _Conn and o.closed]


async def test_a_connection_the_engine_closed_is_freed_without_the_cycle_collector(serve, upstream) -> None:
    """A connection and its parser hold each other: once closed, it lets go, so that reference
    counting frees both (the gateway runs the collector rarely: gateway/front/gctune.py)."""
    async def answer(reader, writer, n):
        writer.write(whole(extra=b"connection: close\r\n"))
        await writer.drain()
        return False  # the engine closes each connection after its answer, as it said

    server = await serve(answer)
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            assert (await post(upstream, server.url))[0] == 200
        for _ in range(200):
            if not _closed_conns():
                break
            await asyncio.sleep(0.01)
        left = len(_closed_conns())
    finally:
        gc.enable()
    assert server.connections == 5
    assert left == 0


def test_a_header_value_holding_cr_or_lf_is_left_out_of_the_engine_request() -> None:
    target = Target("http://127.0.0.1:9/v1/completions")
    head = Upstream._head(b"POST", target, {"x-request-id": "r1", "x-session-id": "a\r\nx-evil: 1",
                                            "x-b": "b\nc", "x-c": "ok"}, 15).decode()
    assert head == ("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:9\r\nx-request-id: r1\r\nx-c: ok\r\n"
                    "content-length: 15\r\n\r\n")
    assert Upstream._head(b"POST", target, {"x-a": "1"}, 0).decode().endswith("x-a: 1\r\ncontent-length: 0\r\n\r\n")
