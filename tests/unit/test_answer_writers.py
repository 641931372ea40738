"""Each writer of a proxied request's answer, driven through the one answer path
(gateway/front/answer.py: admission and the proxy, then the writer): the gateway's connection writer
(`FastPath.serve_exchange` onto an `Exchange`, its `ConnectionWriter`), the plain-ASGI writer
(`asgi_answer.answer` through `send`, its `AsgiWriter`), and the Litestar route taken with
`fast_path: false` (a thin caller of the same). For each: an engine's failure reaches the client
as the error tree's answer, and a bug as a logged 500; a whole answer runs its bookkeeping once
written and carries the key's limit headers; a stream goes out head, events and end, and one that
fails midway is logged and broken off; a client that hangs up, before its answer or mid-stream,
gets nothing more and its stream (the engine's request) is closed.

The gateway under them is a stand-in that answers with a given `Reply` (or error): what is
checked is what each writer does with it, through the real answer path and `Hangup`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import structlog
from litestar import Litestar
from litestar.datastructures import State

from gateway.app import _proxy_route
from gateway.errors import RateLimited, UpstreamError
from gateway.front import asgi_answer
from gateway.front.fastpath import Exchange, FastPath
from gateway.request.reply import Reply
from tests.unit.test_server import Recorder

PATH = "/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
ENGINE_DOWN = UpstreamError("The engine answered 500.", detail="engine w1 answered 500: boom")


class _Stream:
    """An engine's stream as the relay yields it: `events`, then (with `hold`) a wait that only
    a cancellation ends. `closed`: the generator was closed (the engine's request with it)."""

    def __init__(self, events: list[bytes], hold: bool = False, fail: bool = False) -> None:
        self.events, self.hold, self.fail, self.closed = events, hold, fail, False
        self.sent = asyncio.Event()

    async def run(self) -> AsyncIterator[bytes]:
        try:
            for event in self.events:
                yield event
            self.sent.set()
            if self.hold:
                await asyncio.Event().wait()
            if self.fail:
                raise RuntimeError("a bug in the relay")
        finally:
            self.closed = True


class _Gateway:
    """What the answer path reads of the gateway: no keys, the key's `limits` headers (none unless
    given), a proxy that answers `answer()`."""

    def __init__(self, answer: Callable[[], Awaitable[Reply]], limits: list[tuple[str, str]] | None = None) -> None:
        self.answer = answer
        self.limits = limits or []
        self.bodies: list[bytes] = []
        self.refused: list[Exception] = []
        self.settings = SimpleNamespace(max_body_bytes=1 << 20)
        self.tenants = SimpleNamespace(directory=SimpleNamespace(authenticate=lambda _: None))
        self.limiter = SimpleNamespace(admit=self._admit)
        self.proxy = SimpleNamespace(serve=self._serve, refused=lambda exc, *_: self.refused.append(exc))

    async def _admit(self, key_id: str, host: str | None) -> list[tuple[str, str]]:
        return self.limits

    async def _serve(self, body: bytes, header: Callable[[str], str | None], path: str, kind: str,
                     key_id: str = "", tenant: Any = None, task: Any = None) -> Reply:
        self.bodies.append(body)
        return await self.answer()


def _raise(error: Exception) -> Callable[[], Awaitable[Reply]]:
    async def answer() -> Reply:
        raise error
    return answer


def _reply(reply: Reply) -> Callable[[], Awaitable[Reply]]:
    async def answer() -> Reply:
        return reply
    return answer


def _never(started: asyncio.Event) -> Callable[[], Awaitable[Reply]]:
    async def answer() -> Reply:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")
    return answer


# -- the connection writer: FastPath.serve_exchange ---------------------------------------------


class _Flow:
    write_paused = False

    async def drain(self) -> None:
        return None


class _Connection:
    """One proxied request on a recorded connection, served as gateway/front/server.py serves it."""

    def __init__(self, gw: _Gateway) -> None:
        self.transport = Recorder()
        self.answered: list[int] = []
        self.exchange = Exchange("chat", {"path": PATH, "headers": [], "client": ("127.0.0.1", 5)},
                                 self.transport, _Flow(), [], True, False, 1 << 20,  # type: ignore[arg-type]
                                 lambda: self.answered.append(1))
        self.exchange.feed(BODY)
        self.exchange.end()
        self.watched: list[Any] = []
        self.app = FastPath(Litestar(route_handlers=[], state={"gw": gw}))  # type: ignore[arg-type]

    def start(self) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self.app.serve_exchange(self.exchange, self.watched))
        self.exchange.task = task
        return task

    def close(self) -> None:
        """The client's connection closes: what the server tells the exchange and each hang-up watch."""
        self.exchange.lost()
        for hangup in list(self.watched):
            hangup.client_gone()

    def head_and_body(self) -> tuple[bytes, bytes]:
        head, _, body = b"".join(self.transport.writes).partition(b"\r\n\r\n")
        return head, body


def test_connection_writer_answers_an_engine_failure_with_the_error_tree() -> None:
    async def main() -> _Connection:
        conn = _Connection(_Gateway(_raise(ENGINE_DOWN)))
        await conn.start()
        return conn

    conn = asyncio.run(main())
    head, body = conn.head_and_body()
    assert head.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    error = msgspec.json.decode(body)["error"]
    assert error["type"] == "upstream_error" and error["message"] == "The engine answered 500."
    assert b"boom" not in body  # the engine's own words stay in the log
    assert conn.answered == [1] and not conn.transport.closed  # keep-alive: the next request may come


def test_connection_writer_writes_a_whole_answer_then_runs_its_bookkeeping() -> None:
    done: list[str] = []

    async def main() -> _Connection:
        reply = Reply(200, [("x-fleetgate-worker", "w1")], body=b'{"id":"a"}', after=lambda: done.append("after"))
        conn = _Connection(_Gateway(_reply(reply)))
        await conn.start()
        return conn

    conn = asyncio.run(main())
    head, body = conn.head_and_body()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-fleetgate-worker: w1\r\n" in head
    assert body == b'{"id":"a"}' and done == ["after"] and len(conn.transport.writes) == 1


def test_connection_writer_relays_a_stream_head_events_and_end() -> None:
    async def main() -> tuple[_Connection, _Stream]:
        stream = _Stream([b"data: a\n\n", b"data: [DONE]\n\n"])
        conn = _Connection(_Gateway(_reply(Reply(200, [("x-fleetgate-worker", "w1")], stream=stream.run()))))
        await conn.start()
        return conn, stream

    conn, stream = asyncio.run(main())
    head, body = conn.head_and_body()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-type: text/event-stream\r\n" in head
    assert body == b"9\r\ndata: a\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    assert stream.closed and conn.answered == [1] and conn.watched == []


def test_connection_writer_closes_the_stream_of_a_client_that_hangs_up_mid_stream() -> None:
    async def main() -> tuple[_Connection, _Stream, list[bytes]]:
        stream = _Stream([b"data: a\n\n"], hold=True)
        conn = _Connection(_Gateway(_reply(Reply(200, [], stream=stream.run()))))
        task = conn.start()
        await stream.sent.wait()
        await asyncio.sleep(0)  # the head and the first event are flushed
        before = list(conn.transport.writes)
        conn.close()
        await task  # ends quietly: a hang-up is nobody's error
        return conn, stream, before

    conn, stream, before = asyncio.run(main())
    assert b"".join(before).endswith(b"9\r\ndata: a\n\n\r\n")
    assert conn.transport.writes == before  # nothing more, not even the stream's end
    assert stream.closed and conn.answered == [] and conn.watched == []


def test_connection_writer_writes_nothing_to_a_client_gone_before_its_answer() -> None:
    async def main() -> _Connection:
        started = asyncio.Event()
        conn = _Connection(_Gateway(_never(started)))
        task = conn.start()
        await started.wait()
        conn.close()
        await task
        return conn

    conn = asyncio.run(main())
    assert conn.transport.writes == [] and conn.answered == []


# -- the plain-ASGI writer: asgi_answer.answer ---------------------------------------------------


class _Asgi:
    """One proxied request through ASGI messages: its body, then (once `hang_up`) a disconnect."""

    def __init__(self, gw: _Gateway) -> None:
        self.gw = gw
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self._body_read = False
        self.scope = {"type": "http", "method": "POST", "path": PATH, "headers": [], "client": ("127.0.0.1", 5)}

    async def receive(self) -> dict[str, Any]:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def answer(self) -> None:
        await asgi_answer.answer(self.gw, self.scope, self.receive, self.send, "chat")

    def status(self) -> int:
        return int(self.sent[0]["status"])

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def test_asgi_writer_answers_an_engine_failure_with_the_error_tree() -> None:
    async def main() -> _Asgi:
        asgi = _Asgi(_Gateway(_raise(ENGINE_DOWN)))
        await asgi.answer()
        return asgi

    asgi = asyncio.run(main())
    assert asgi.status() == 502
    assert (b"content-type", b"application/json") in asgi.sent[0]["headers"]
    error = msgspec.json.decode(asgi.body())["error"]
    assert error["type"] == "upstream_error" and error["message"] == "The engine answered 500."
    assert b"boom" not in asgi.body()


def test_asgi_writer_writes_a_whole_answer_then_runs_its_bookkeeping() -> None:
    done: list[str] = []

    async def main() -> _Asgi:
        reply = Reply(200, [("x-fleetgate-worker", "w1")], body=b'{"id":"a"}', after=lambda: done.append("after"))
        asgi = _Asgi(_Gateway(_reply(reply)))
        await asgi.answer()
        return asgi

    asgi = asyncio.run(main())
    assert asgi.status() == 200 and (b"x-fleetgate-worker", b"w1") in asgi.sent[0]["headers"]
    assert asgi.body() == b'{"id":"a"}' and done == ["after"] and asgi.gw.bodies == [BODY]


def test_asgi_writer_relays_a_stream_head_events_and_end() -> None:
    async def main() -> tuple[_Asgi, _Stream]:
        stream = _Stream([b"data: a\n\n", b"data: [DONE]\n\n"])
        asgi = _Asgi(_Gateway(_reply(Reply(200, [], stream=stream.run()))))
        await asgi.answer()
        return asgi, stream

    asgi, stream = asyncio.run(main())
    assert asgi.status() == 200 and (b"content-type", b"text/event-stream") in asgi.sent[0]["headers"]
    assert [m.get("body") for m in asgi.sent[1:]] == [b"data: a\n\n", b"data: [DONE]\n\n", b""]
    assert [m.get("more_body", False) for m in asgi.sent[1:]] == [True, True, False]
    assert stream.closed


def test_asgi_writer_closes_the_stream_of_a_client_that_hangs_up_mid_stream() -> None:
    async def main() -> tuple[_Asgi, _Stream]:
        stream = _Stream([b"data: a\n\n"], hold=True)
        asgi = _Asgi(_Gateway(_reply(Reply(200, [], stream=stream.run()))))
        task = asyncio.ensure_future(asgi.answer())
        await stream.sent.wait()
        asgi.gone.set()  # the hang-up watch (started after front.WATCH_AFTER_S) sees the disconnect
        await asyncio.wait_for(task, 30)  # a bound for a broken watch, not a timing check
        return asgi, stream

    asgi, stream = asyncio.run(main())
    assert [m.get("body") for m in asgi.sent[1:]] == [b"data: a\n\n"]  # no end: the stream broke off
    assert stream.closed


def test_asgi_writer_sends_nothing_to_a_client_gone_before_its_answer() -> None:
    async def main() -> _Asgi:
        started = asyncio.Event()
        asgi = _Asgi(_Gateway(_never(started)))
        task = asyncio.ensure_future(asgi.answer())
        await started.wait()
        asgi.gone.set()
        await asyncio.wait_for(task, 30)
        return asgi

    assert asyncio.run(main()).sent == []


# -- every writer through the one answer path (gateway/front/answer.py) --------------------------


class _Litestar(_Asgi):
    """The Litestar route of `fast_path: false` (gateway/app.py), served as ASGI: a thin caller of
    the same answer path, through the ASGI writer."""

    async def answer(self) -> None:
        app = Litestar(route_handlers=[_proxy_route(PATH, "chat")], state=State({"gw": self.gw}))
        scope = {**self.scope, "query_string": b"", "root_path": "", "raw_path": PATH.encode(),
                 "scheme": "http", "server": ("127.0.0.1", 8000), "http_version": "1.1", "asgi": {"version": "3.0"}}
        await app(scope, self.receive, self.send)  # type: ignore[arg-type]


WRITERS = ["connection", "asgi", "litestar"]


async def _answered(writer: str, gw: _Gateway) -> tuple[int, dict[str, str], bytes]:
    """A whole answer as its client sees it, through `writer`: status, headers, body."""
    if writer == "connection":
        conn = _Connection(gw)
        await conn.start()
        head, body = conn.head_and_body()
        status_line, *lines = head.decode().split("\r\n")
        assert conn.answered == [1]
        return int(status_line.split()[1]), dict(line.split(": ", 1) for line in lines), body
    asgi = (_Asgi if writer == "asgi" else _Litestar)(gw)
    await asgi.answer()
    assert not asgi.sent[-1].get("more_body", False)
    return asgi.status(), {k.decode(): v.decode() for k, v in asgi.sent[0]["headers"]}, asgi.body()


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_renders_the_error_tree_alike(writer: str) -> None:
    limited = RateLimited("Too many requests.", retry_after=2.2, limit_headers={"x-ratelimit-limit-requests": "10"})
    status, headers, body = asyncio.run(_answered(writer, _Gateway(_raise(limited))))
    assert status == 429 and body == limited.body()
    assert headers["retry-after"] == "2" and headers["x-ratelimit-limit-requests"] == "10"
    assert headers["content-type"] == "application/json" and headers["content-length"] == str(len(body))


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_answers_a_bug_with_a_logged_500(writer: str) -> None:
    with structlog.testing.capture_logs() as logs:
        status, _, body = asyncio.run(_answered(writer, _Gateway(_raise(RuntimeError("a bug: secret")))))
    error = msgspec.json.decode(body)["error"]
    assert status == 500 and error["code"] == "internal_error" and b"secret" not in body
    assert [(e["event"], e["path"]) for e in logs if e["log_level"] == "error"] == [("gateway.internal_error", PATH)]


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_gives_the_keys_limit_headers_with_a_whole_answer(writer: str) -> None:
    """The key's limit headers join the answer's; a header the answer has itself is not repeated."""
    reply = Reply(200, [("x-fleetgate-worker", "w1")], body=b'{"id":"a"}')
    gw = _Gateway(_reply(reply), limits=[("x-ratelimit-remaining-requests", "9"), ("x-fleetgate-worker", "other")])
    status, headers, body = asyncio.run(_answered(writer, gw))
    assert status == 200 and body == b'{"id":"a"}'
    assert headers["x-ratelimit-remaining-requests"] == "9" and headers["x-fleetgate-worker"] == "w1"


@pytest.mark.parametrize("writer", ["asgi", "litestar"])
def test_an_asgi_writer_relays_a_stream_and_breaks_off_one_that_fails(writer: str) -> None:
    async def main(fail: bool) -> tuple[_Asgi, _Stream]:
        stream = _Stream([b"data: a\n\n"], fail=fail)
        asgi = (_Asgi if writer == "asgi" else _Litestar)(_Gateway(_reply(Reply(200, [], stream=stream.run()))))
        await asgi.answer()
        return asgi, stream

    asgi, stream = asyncio.run(main(fail=False))
    assert asgi.status() == 200 and (b"content-type", b"text/event-stream") in asgi.sent[0]["headers"]
    assert [m.get("body") for m in asgi.sent[1:]] == [b"data: a\n\n", b""] and stream.closed
    with structlog.testing.capture_logs() as logs:
        asgi, stream = asyncio.run(main(fail=True))
    assert [m.get("body") for m in asgi.sent[1:]] == [b"data: a\n\n"]  # no end: the server closes it
    assert stream.closed and [e["event"] for e in logs] == ["gateway.internal_error"]


def test_connection_writer_breaks_off_a_stream_that_fails_midway() -> None:
    """What was relayed goes out, then the connection closes: the client does not wait on it."""
    async def main() -> tuple[_Connection, _Stream]:
        stream = _Stream([b"data: a\n\n"], fail=True)
        conn = _Connection(_Gateway(_reply(Reply(200, [], stream=stream.run()))))
        await conn.start()
        return conn, stream

    with structlog.testing.capture_logs() as logs:
        conn, stream = asyncio.run(main())
    _, body = conn.head_and_body()
    assert body == b"9\r\ndata: a\n\n\r\n" and conn.transport.closed and conn.answered == []
    assert stream.closed and conn.watched == [] and [e["event"] for e in logs] == ["gateway.internal_error"]
