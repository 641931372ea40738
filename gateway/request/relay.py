"""Relaying one engine stream to the client as it arrives, and continuing it if it breaks.

Three parts: gateway/request/sse.py cuts the engine's bytes into runs of whole events; `relay`, the
one generator, reads, gives up on a stall and yields what the client gets; `Relayed`
(gateway/request/relay_books.py, compiled, with the segment's timers) keeps the stream's books
across its segments: what the tracker lets through of the events it must
look at on their own ([DONE], the usage chunk, a resumed stream's events; any other run leaves
in one write, as it came: `StreamTracker.on_block`), the failover to
another worker when the engine dies or stalls mid-stream (gateway/request/resume.py, through the
request's `Attempt`), and the one summary log line and the request's metrics, written when
the stream ends, however it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog

from gateway.accounts.waiting import WorkerWentAway
from gateway.engines.upstream import Response
from gateway.observe.metrics import GatewayMetrics
from gateway.request.attempts import Attempt
from gateway.request.relay_books import FirstEvent, Relayed, StallWatch, StreamBroke
from gateway.request.responses import ResponsesTracker
from gateway.request.resume import EngineStreamError, StreamTracker
from gateway.request.sse import SSEFrames
from gateway.routing import Choice
from gateway.tenants.quota import Ticket

log = structlog.get_logger("gateway.relay")


class ClientStalled(Exception):
    """Thrown into the relay where it waits for its client: the client read none of its
    answer for send_timeout_s and its connection was closed (gateway/front/server.py)."""


# How an engine's stream can break mid-way; each is continued elsewhere when it can be.
BROKEN = (ConnectionError, TimeoutError, StreamBroke, WorkerWentAway, EngineStreamError)


async def relay(
    attempt: Attempt, choice: Choice, resp: Response, tracker: StreamTracker | ResponsesTracker,
    metrics: GatewayMetrics, started: float, fields: dict[str, object], stores: bool, ticket: Ticket | None = None,
) -> AsyncIterator[bytes]:
    """Relay the engine's stream to the client; continue it on another worker if it breaks."""
    books = Relayed(attempt, choice, resp, tracker, metrics, started, fields, stores, ticket)
    on_block = tracker.on_block
    waiting = attempt.dispatch.waits.waiting
    clock = asyncio.get_running_loop().time
    stall_s = attempt.dispatch.settings.stall_timeout_s
    try:
        last: bytes | None = None  # what ends the client's stream; None: another segment
        while last is None:  # one segment per engine that serves the stream
            try:
                feed = SSEFrames().feed
                read = books.resp.readany  # b"" at the end
                async with asyncio.timeout(None) as deadline:
                    watch = StallWatch(deadline, stall_s)
                    first = FirstEvent(deadline, attempt, books.worker.id)
                    try:
                        # Waiting for the first event counts as waiting for a first byte (gateway/accounts/waiting.py):
                        # the engine has sent the client nothing yet; it may wait behind the engine's queue.
                        with waiting(books.worker.id, attempt.task):
                            data = await read()
                        first.close()
                        attempt.prefilled()
                        while data:
                            piece, rest = on_block(feed(data))  # (b"", b"") until an event is whole
                            if rest:
                                piece, garbage = books.one_by_one(piece, rest)
                                if garbage is not None and not tracker.done:  # what came before it goes out first
                                    if piece:
                                        if books.before_first:
                                            await books.first_out()
                                        yield piece
                                    raise garbage
                            if piece:
                                if books.before_first:
                                    await books.first_out()
                                yield piece  # at the client's pace: not the engine's silence
                                if tracker.done:
                                    break
                            now = clock()
                            if watch.armed - now < stall_s:
                                watch.arm(now)
                            watch.reading = True
                            data = await read()
                            watch.reading = False
                    finally:
                        first.close()
                        watch.close()
                last = books.ending()
            except BROKEN as exc:
                last = await books.fail_over(exc)
        if last:
            yield last
        books.ran_to_its_end = True
    except ClientStalled:
        books.outcome = "client_stalled"
        raise
    finally:
        # Otherwise the client went away (cancellation) or the server is stopping: `close`
        # aborts the engine's request by closing its connection instead of reading it to the end.
        await books.close()
