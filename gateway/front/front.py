"""What the one answer path (gateway/front/answer.py) does around the proxy before it writes.

Check the API key (gateway/tenants/tenants.py), count the client against its rate limit, read the body, then serve,
while watching the client's connection: a client that hangs up before its answer is
ready cancels the work, which closes the engine's request (an engine generates on for
nobody otherwise; vLLM and the simulator abort a request whose connection closes). The
connection is watched from `WATCH_AFTER_S` into the request on, so a fast answer costs no task
(under the gateway's own server protocol, gateway/front/server.py, nothing is watched: the protocol
tells the request's `Hangup` when its connection closes, at once). A
request refused here (401, 429, 413) is logged and counted like every other answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from gateway.errors import GatewayError
from gateway.request.relay import ClientStalled
from gateway.request.reply import Reply

Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class ClientGone(Exception):
    """The client hung up before its answer was ready: there is nobody to answer."""


# A client's connection is watched only once its request has run this long: watching costs a
# task (created, cancelled and awaited) per request, and most whole answers of a fast engine
# are out before it would matter. A hang-up earlier is acted on at this mark (the engine
# generates at most this much longer for nobody).
WATCH_AFTER_S = 0.1


class Hangup:
    """Watches the client's connection (ASGI `receive`, once the body is read) and cancels the
    task serving it when the client hangs up, unless the answer is already going out."""

    __slots__ = ("_receive", "_task", "_timer", "_watch", "finishing", "gone")

    def __init__(self, receive: Receive, watch: bool = True, task: asyncio.Task[Any] | None = None) -> None:
        task = task or asyncio.current_task()
        assert task is not None
        self._task = task
        self._receive = receive
        self.gone = False
        self.finishing = False
        self._watch: asyncio.Task[None] | None = None
        # watch=False: the server calls `client_gone` itself when the connection closes.
        self._timer: asyncio.TimerHandle | None = (
            asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start) if watch else None)

    def client_gone(self) -> None:
        """The connection closed (gateway/front/server.py saw it): a hang-up unless the answer is going out."""
        if not self.finishing and not self.gone:
            self.gone = True
            self._task.cancel()

    def _start(self) -> None:
        self._timer = None
        if not self.finishing:
            self._watch = asyncio.create_task(self._run(self._receive))

    async def _run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # The server also says "disconnect" once the response is complete: only a hang-up
        # before that may cancel (cancelling a finished request would break its keep-alive
        # connection).
        if not self.finishing:
            self.gone = True
            self._task.cancel()

    def finish(self) -> None:
        """The answer is going out: a disconnect from now on is the server's, not a hang-up."""
        self.finishing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watch is not None:
            self._watch.cancel()

    async def stop(self) -> None:
        self.finish()
        if self._watch is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        self.absorb()  # a hang-up just as the answer was ready: its cancellation was swallowed here

    def absorb(self) -> bool:
        """In an `except CancelledError`: True (and the cancellation undone) if the hang-up caused it."""
        if not self.gone:
            return False
        self._task.uncancel()
        return True


async def serve(
    gw: Any, header: Callable[[str], str | None], client_host: str | None, read_body: Callable[[], Awaitable[bytes]],
    receive: Receive, path: str, kind: str, watched: list[Hangup] | None = None,
    task: asyncio.Task[Any] | None = None,
) -> tuple[Reply, Hangup]:
    """Admit and serve one proxied request. The Hangup keeps watching a streamed answer; it is
    stopped for a whole one. ClientGone if the client hung up first. `watched`: the server's
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
    hangup = Hangup(receive, watch=watched is None, task=task)
    if watched is not None:
        watched.append(hangup)
    try:
        reply: Reply = await gw.proxy.serve(body, header, path, kind, key_id, tenant)
    except asyncio.CancelledError:
        hangup.finish()
        unwatch(watched, hangup)
        if hangup.absorb():
            raise ClientGone from None
        raise
    except BaseException:
        unwatch(watched, hangup)
        await hangup.stop()
        raise
    if limits:  # the key's own limits' headers (gateway/tenants/quota.py), when it has any, come first
        have = {name for name, _ in reply.headers}
        reply.headers.extend(h for h in limits if h[0] not in have)
    if reply.stream is None:
        await hangup.stop()
    return reply, hangup


def unwatch(watched: list[Hangup] | None, hangup: Hangup) -> None:
    """Take `hangup` off its connection's list, unless the connection went first (it empties
    the list as it tells each of them: gateway/front/server.py)."""
    if watched is not None and hangup in watched:
        watched.remove(hangup)


# What the ASGI paths serving a proxied request leave in its scope for the connection
# (gateway/front/server.py): the answer's headers, which carry its request id, and the mark the
# connection sets when it closes a client that stopped reading (send_timeout_s). The fast
# path's `Exchange` has slots of its own for both (no key added to its scope per request).
ANSWER_HEADERS = "fleetgate.answer_headers"
STALLED = "fleetgate.stalled"


def answering(scope: MutableMapping[str, Any], headers: list[tuple[str, str]]) -> None:
    """The answer to `scope`'s request has `headers` (its id is looked up only if the client stalls)."""
    scope[ANSWER_HEADERS] = headers


def request_id_in(headers: Iterable[tuple[str, str]] | None) -> str | None:
    """The request id among an answer's headers (None: no proxied answer has begun)."""
    for name, value in headers or ():
        if name == "x-request-id":
            return value
    return None


async def tell_stalled(stream: AsyncIterator[bytes]) -> None:
    """Tell a relayed stream, before it is closed, that its client stopped reading (the
    connection marked it `STALLED` as it closed it at send_timeout_s), at the
    point it waits for the client, so that its summary line says `client_stalled` rather than a
    hang-up (gateway/request/relay.py)."""
    with contextlib.suppress(ClientStalled, StopAsyncIteration, RuntimeError):
        await stream.athrow(ClientStalled())  # type: ignore[attr-defined]
