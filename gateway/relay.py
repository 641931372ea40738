"""Relaying one engine stream to the client as it arrives, and continuing it if it breaks.

Events are relayed as they arrive; what arrived in one read leaves in one write, as it came
unless the tracker must look at an event on its own ([DONE], the usage chunk, a resumed
stream's events: `StreamTracker.on_block`). If the
engine dies or stalls mid-stream, the stream is continued on another worker
(gateway/resume.py) through the request's `Attempt`; the one summary log line and the
request's metrics are written when the stream ends, however it ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from gateway.attempts import Attempt
from gateway.capabilities import continues_trailing_assistant, shaped
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics, usage_of
from gateway.quota import Ticket
from gateway.responses import ResponsesTracker, remember
from gateway.resume import StreamTracker, continuation
from gateway.routing import Choice
from gateway.upstream import Response
from gateway.waiting import WorkerWentAway

log = structlog.get_logger("gateway.proxy")


# A stream is given up after `stall_timeout_s` of silence, and at most this factor of it.
STALL_MARGIN = 1.1


# An engine report this old or newer says the engine is alive now (agents report every second).
REPORT_FRESH_S = 5.0


class StreamBroke(Exception):
    """The engine's stream ended without finishing."""


def queued_in_engine(attempt: Attempt, worker_id: str) -> bool:
    """Whether the worker's engine says, in a fresh healthy report, that it holds requests
    waiting (its queue, or adapters waiting for a LoRA slot): a first event not come yet is
    then a wait in that queue, not a hung engine."""
    view = attempt.dispatch.watcher.snapshot.by_id.get(worker_id)
    if view is None or view.unhealthy:
        return False
    load = view.load
    return (load.waiting > 0 or load.deferred > 0) and time.time() - load.ts <= REPORT_FRESH_S


async def first_event(read: Callable[[], Awaitable[bytes]], attempt: Attempt, worker_id: str) -> bytes:
    """The stream's first bytes, within the attempt's first-byte limit; each time that runs
    out while the engine reports requests waiting, another such limit, up to
    `first_byte_queued_timeout_s` in all (a request queued in the engine keeps its place
    rather than being sent again elsewhere; a hung engine's reports go stale or unhealthy)."""
    limit = attempt.first_byte_timeout()
    most = max(limit, attempt.dispatch.settings.first_byte_queued_timeout_s)
    waited = 0.0
    while True:
        try:
            async with asyncio.timeout(min(limit, most - waited)):
                return await read()
        except TimeoutError:
            waited += min(limit, most - waited)
            if waited >= most or not queued_in_engine(attempt, worker_id):
                raise
            log.info("gateway.first_event_queued", worker=worker_id, waited_s=round(waited, 1))


async def relay(
    attempt: Attempt, choice: Choice, resp: Response, tracker: StreamTracker | ResponsesTracker,
    metrics: GatewayMetrics, started: float, fields: dict[str, object], stores: bool, ticket: Ticket | None = None,
) -> AsyncIterator[bytes]:
    """Relay the engine's stream to the client; continue it on another worker if it breaks."""
    dispatch = attempt.dispatch
    settings = dispatch.settings
    loop = asyncio.get_running_loop()
    worker = choice.worker
    outcome = "completed"
    first_chunk_ms: float | None = None
    resumes = 0
    counted = True  # `worker` holds one of this gateway's in-flight counts
    tokens = (0, 0)
    try:
        while True:
            try:
                buffer = b""
                # The first event may wait behind the engine's queue; later ones may not stall.
                read = resp.readany  # b"" at the end
                stall = settings.stall_timeout_s
                armed = -math.inf  # the stall deadline set last
                # Waiting for the first event counts as waiting for a first byte
                # (gateway/waiting.py): the engine has sent the client nothing yet.
                with dispatch.waits.waiting(worker.id):
                    data = await first_event(read, attempt, worker.id)
                async with asyncio.timeout(None) as deadline:
                    while data:
                        # The stall deadline moves only when it is less than `stall` away, to
                        # STALL_MARGIN times that: never before `stall` s of silence, at most a
                        # tenth of it late, and one timer set per few seconds, not one per read.
                        now = loop.time()
                        if armed - now < stall:
                            armed = now + stall * STALL_MARGIN
                            deadline.reschedule(armed)
                        if buffer:
                            data = buffer + data
                        end = data.rfind(b"\n\n") + 2
                        if end < 2:
                            buffer = data
                            data = await read()
                            continue
                        # What arrived in one read leaves in one write: as it came, when the
                        # tracker need not look at its events one by one.
                        block, buffer = (data, b"") if end == len(data) else (data[:end], data[end:])
                        joined, rest = tracker.on_block(block)
                        if rest:
                            out = [x for e in rest[:-2].split(b"\n\n")
                                   if (x := tracker.on_event(e.strip(b"\r\n"))) is not None]
                            if not out and not joined:
                                data = await read()
                                continue
                            for piece in out:
                                # find(), not `in`: see gateway/resume.py's _usage_only.
                                if piece.find(b'"usage":{') >= 0 or piece.find(b'"usage": {') >= 0:
                                    usage = usage_of(piece)
                                    if usage[1]:
                                        tokens = usage
                            if out:
                                joined = b"".join((joined, *out)) if joined else b"".join(out)
                        if first_chunk_ms is None:
                            first_chunk_ms = round((time.perf_counter() - started) * 1000, 2)
                        if stores and tracker.response_id:
                            # Recorded before the client can see the id, so a follow-up finds it.
                            await remember(dispatch.watcher, tracker.response_id, worker.id,
                                           settings.responses_ttl_s)
                            stores = False
                        yield joined
                        if tracker.done:
                            break
                        data = await read()
                if tracker.done:
                    dispatch.breakers.success(worker.id)
                    return
                if tracker.finished:  # a finish_reason came, only [DONE] is missing
                    yield b"data: [DONE]\n\n"
                    return
                raise StreamBroke("the engine closed the stream before it finished")
            except (ConnectionError, TimeoutError, StreamBroke, WorkerWentAway) as exc:
                reason = "stalled" if isinstance(exc, TimeoutError) else type(exc).__name__
                dispatch.breakers.failure(worker.id, f"stream {reason}")
                attempt.trace.stream_broke(worker.id, reason)
                resp.close()
                attempt.release(worker.id)
                counted = False
                tracker.analyse()
                log.warning("gateway.stream_broke", worker=worker.id, reason=reason,
                            sent_chunks=tracker.content_chunks, request_id=fields["request_id"])
                if not tracker.resumable or resumes >= settings.max_resumes:
                    outcome = f"broken:{reason}"
                    yield tracker.error_event("The engine serving this stream failed and the stream cannot be "
                                              f"resumed elsewhere{tracker.why_not}; the answer is incomplete.")
                    return
                assert isinstance(tracker, StreamTracker)  # the only resumable kind
                plan = continuation(attempt.body, attempt.kind, tracker.text, tracker.content_chunks,
                                    continues_trailing_assistant(worker.info))
                if plan is None:
                    yield tracker.final_length_chunk()
                    return
                resumes += 1
                try:  # shaped for whichever engine takes over, by what its worker declares
                    choice, resp = await attempt.resume(shaped(plan.body))
                except GatewayError as err:
                    outcome = f"broken:{reason}"
                    yield tracker.error_event(f"The stream could not be resumed on another worker: {err.message}")
                    return
                worker = choice.worker
                counted = True
                metrics.resumed_stream(str(fields["model"]))
                attempt.trace.resumed(worker.id, resumes)
                tracker.start_segment()
                log.info("gateway.stream_resumed", worker=worker.id, resumes=resumes,
                         sent_chunks=tracker.content_chunks, request_id=fields["request_id"])
    except BaseException:
        # The client went away (cancellation) or the server is stopping: abort the
        # engine's request by closing its connection instead of reading it to the end.
        outcome = "client_gone"
        raise
    finally:
        if counted:
            if outcome == "completed":
                resp.release()
            else:
                resp.close()
            attempt.release(worker.id)
        attempt.trace.end(200, outcome)
        elapsed = time.perf_counter() - started
        tokens = tokens if tokens[1] else tracker.hidden_usage
        if ticket is not None:
            if not tokens[1] and isinstance(tracker, StreamTracker) and tracker.sent:
                tracker.analyse()  # no usage came (the client left first): count what was sent
                tokens = (ticket.charged, tracker.content_chunks)
            if outcome == "client_gone":  # this task is being cancelled: settle beside it
                ticket.settle_soon(*tokens, 200)
            else:
                await ticket.settle(*tokens, 200)
        metrics.request_done(
            str(fields["model"]), worker.id, 200, True, elapsed,
            first_chunk_ms / 1000 if first_chunk_ms is not None else None, *tokens,
        )
        log.bind().info(  # bind(): see _Answered.run in gateway/proxy.py
            "gateway.request", **fields, final_worker=worker.id, status=200, outcome=outcome,
            resumes=resumes, ttft_ms=first_chunk_ms, ms=round(elapsed * 1000, 2),
            prompt_tokens=tokens[0], completion_tokens=tokens[1],
        )
