"""The client's side of a proxied request: its hang-up (`Hangup`) and its stall.

A client that hangs up before its answer is ready cancels the work, which closes the engine's
request (an engine generates on for nobody otherwise; vLLM and the simulator abort a request
whose connection closes). The connection is watched from `WATCH_AFTER_S` into the request on,
so a fast answer costs no task (under the gateway's own server protocol, gateway/front/server.py,
nothing is watched: the protocol tells the request's `Hangup` when its connection closes, at
once). A client that stops reading is closed by its connection at send_timeout_s
(gateway/front/server.py), which tells its stream (`tell_stalled`). The one answer path
(gateway/front/answer.py) uses both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from gateway.request.relay import ClientStalled

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

    @property
    def task(self) -> asyncio.Task[Any]:
        """The task serving the request (the one a hang-up cancels)."""
        return self._task

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
