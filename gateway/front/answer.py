"""One way to answer a proxied request: `answer()`, through a `Writer`.

Every proxied OpenAI request (`requests.KINDS`) is answered here, whichever way it came in: on
the gateway's own connection (`FastPath.serve_exchange`, gateway/front/fastpath.py, with its
`ConnectionWriter`) or through plain ASGI (gateway/front/asgi_answer.py, with its `AsgiWriter`:
a query string or %-escapes in the path, another server in front, or `fast_path: false`, where the
Litestar route hands the request over). `answer` checks the API key (gateway/tenants/tenants.py),
counts the client against its rate limit and reads the body (a request refused there, 401, 429
or 413, is logged and counted like every other answer), serves it (`Proxy.serve`) while watching
the client's connection (`front.Hangup`), then owns what follows: a client gone before its answer
(nothing is written), the error tree rendered as the client's answer (`GatewayError.body()` and
`headers()`; any other exception is a bug, logged, and answered as a 500), the key's limit
headers joined to the answer's, a whole answer written and then its bookkeeping run
(`Reply.written`), a stream relayed at the client's pace, closed on a hang-up (which closes the
engine's request), told of a stalled client (`front.tell_stalled`) or broken off if it fails.

A writer knows only how bytes reach its client; the order of its calls is always `whole`, or
`start`, `chunk`* (with `drain` when asked), `end`; `abort` after a stream, in every case.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any, Protocol

import structlog

from gateway.errors import GatewayError
from gateway.front import front
from gateway.request.reply import Reply

log = structlog.get_logger("gateway.answer")

Headers = Collection[tuple[str, str]]


class Writer(Protocol):
    """Where one proxied request's answer goes."""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole JSON answer (an error's too): its head, content type and length, its body."""

    async def start(self, status: int, headers: Headers) -> None:
        """An SSE stream's head."""

    def chunk(self, data: bytes) -> bool:
        """One piece of the stream; True when `drain` must be awaited before the next (the
        connection's writer: its client reads slower than pieces come; an ASGI writer: always,
        its `send` is a coroutine). Synchronous, so that most pieces cost no coroutine."""

    async def drain(self) -> None:
        """Wait until the client can take the next piece."""

    async def end(self) -> None:
        """The stream is complete."""

    def abort(self) -> None:
        """After a stream, in every case: one that broke off (a bug, a hang-up) must not leave
        its client waiting; no-op once the answer is complete."""

    def answering(self, headers: list[tuple[str, str]]) -> None:
        """The answer about to be written has these headers (its request id, should its client
        stall: gateway/front/server.py)."""

    @property
    def stalled(self) -> bool:
        """The connection was closed because its client stopped reading (send_timeout_s)."""

    def serving(self) -> asyncio.Task[Any] | None:
        """The task serving the request, where the writer knows it (None: the current task)."""


INTERNAL = "Internal error in the gateway."


async def answer(gw: Any, writer: Writer, header: Callable[[str], str | None], client_host: str | None,
                 read_body: Callable[[], Awaitable[bytes]], receive: front.Receive, path: str, kind: str,
                 watched: list[front.Hangup] | None = None, task: asyncio.Task[Any] | None = None) -> None:
    """Answer one proxied request of `kind` through `writer` (see the module's docstring).
    `receive`, `watched` and `task` as for `_serve`."""
    try:
        reply, hangup, limits = await _serve(gw, header, client_host, read_body, receive, path, kind, watched,
                                             task if task is not None else writer.serving())
    except front.ClientGone:
        return  # nobody to answer; the engine's request was closed
    except GatewayError as exc:
        await writer.whole(exc.status, exc.headers().items(), exc.body())
        return
    except Exception:
        log.exception("gateway.internal_error", path=path)
        internal = GatewayError(INTERNAL)
        await writer.whole(internal.status, internal.headers().items(), internal.body())
        return
    if limits:  # the key's own limits' headers (gateway/tenants/quota.py), when it has any, come first
        have = {name for name, _ in reply.headers}
        reply.headers.extend(h for h in limits if h[0] not in have)
    writer.answering(reply.headers)
    stream = reply.stream
    if stream is None:
        front.unwatch(watched, hangup)
        try:
            await writer.whole(reply.status, reply.headers, reply.body)
        finally:
            reply.written()
        return
    await _relay(reply.status, reply.headers, stream, writer, hangup, watched, path)


async def _serve(
    gw: Any, header: Callable[[str], str | None], client_host: str | None, read_body: Callable[[], Awaitable[bytes]],
    receive: front.Receive, path: str, kind: str, watched: list[front.Hangup] | None = None,
    task: asyncio.Task[Any] | None = None,
) -> tuple[Reply, front.Hangup, list[tuple[str, str]]]:
    """Admit and serve one proxied request: its reply, its hang-up watch and the key's limit
    headers. The watch keeps watching a streamed answer; it is stopped for a whole one.
    `front.ClientGone` if the client hung up first. `watched`: the server's
    list of its connection's hang-up watches, which it tells itself when the connection closes
    (then no watcher runs). `task`: the task serving it, where the caller knows it."""
    started = time.perf_counter()
    key_id = ""
    try:
        tenant = gw.tenants.directory.authenticate(header("authorization") or "")
        key_id = tenant.id if tenant is not None else ""
        limits = await gw.limiter.admit(key_id, client_host)
        body = await read_body()
    except GatewayError as exc:
        gw.proxy.refused(exc, header, key_id, started)
        raise
    hangup = front.Hangup(receive, watch=watched is None, task=task)
    if watched is not None:
        watched.append(hangup)
    try:
        reply: Reply = await gw.proxy.serve(body, header, path, kind, key_id, tenant, hangup.task)
    except asyncio.CancelledError:
        hangup.finish()
        front.unwatch(watched, hangup)
        if hangup.absorb():
            raise front.ClientGone from None
        raise
    except BaseException:
        front.unwatch(watched, hangup)
        await hangup.stop()
        raise
    if reply.stream is None:
        await hangup.stop()
    return reply, hangup, limits


async def _relay(status: int, headers: Headers, stream: AsyncIterator[bytes], writer: Writer,
                 hangup: front.Hangup, watched: list[front.Hangup] | None, path: str) -> None:
    """Write a stream's head, then its pieces as they come, at the client's pace; a client that
    hangs up cancels it (which closes the engine's request)."""
    try:
        await writer.start(status, headers)
        async for chunk in stream:
            if writer.chunk(chunk):
                await writer.drain()
        hangup.finish()
        await writer.end()
    except asyncio.CancelledError:
        hangup.finish()
        if hangup.absorb():  # the generator's cleanup closes the engine's request; end quietly
            return
        raise
    except Exception:  # the stream's own errors end in an SSE error event; this is a bug's
        log.exception("gateway.internal_error", path=path)
    finally:
        front.unwatch(watched, hangup)
        await hangup.stop()
        if writer.stalled:
            await front.tell_stalled(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        writer.abort()


__all__ = ["INTERNAL", "Writer", "answer"]
