"""A relayed stream's books and timers (gateway/request/relay.py's `relay` is the generator that
uses them): `Relayed`, the stream's books across its segments (what the client was sent, the
failover to another worker, the summary line and metrics when it ends); `StallWatch`, a
segment's stall limit; `FirstEvent`, the wait for a segment's first event. Apart from the
generator so that mypyc compiles them (scripts/compile.py; it has no async generators).
"""

from __future__ import annotations

import asyncio
import math
import time

import structlog

from gateway.accounts.waiting import engine_queued
from gateway.engines.capabilities import continues_trailing_assistant, shaped
from gateway.engines.upstream import Response
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics, usage_of
from gateway.request.attempts import Attempt
from gateway.request.responses import ResponsesTracker, remember
from gateway.request.resume import DONE, EngineStreamError, StreamTracker, continuation
from gateway.request.sse import events
from gateway.routing import Choice
from gateway.tenants.quota import Ticket

# The stream's log lines have always been gateway.relay's.
log = structlog.get_logger("gateway.relay")

# A stream is given up after `stall_timeout_s` of silence, and at most this factor of it.
STALL_MARGIN = 1.1


class StreamBroke(Exception):
    """The engine's stream ended without finishing."""


def queued_in_engine(attempt: Attempt, worker_id: str) -> bool:
    """Whether the worker's engine says, in a fresh healthy report, that it holds requests
    waiting (its queue, or adapters waiting for a LoRA slot): a first event not come yet is
    then a wait in that queue, not a hung engine."""
    return engine_queued(attempt.dispatch.watcher.snapshot.by_id.get(worker_id))


class FirstEvent:
    """The wait for a stream's first event, within the attempt's first-byte limit; each time that
    runs out while the engine reports requests waiting, another such limit, up to
    `first_byte_queued_timeout_s` in all (a request queued in the engine keeps its place rather
    than being sent again elsewhere; a hung engine's reports go stale or unhealthy). A timer on
    the segment's `asyncio.timeout`, as `StallWatch` is, not a timeout context of its own: when
    the wait runs out, the deadline expires at once and the read raises TimeoutError."""

    __slots__ = ("attempt", "deadline", "fired", "handle", "limit", "loop", "most", "waited", "worker_id")

    def __init__(self, deadline: asyncio.Timeout, attempt: Attempt, worker_id: str) -> None:
        self.loop = asyncio.get_running_loop()
        self.deadline, self.attempt, self.worker_id = deadline, attempt, worker_id
        self.limit = attempt.first_byte_timeout()
        self.most = max(self.limit, attempt.dispatch.settings.first_byte_queued_timeout_s)
        self.waited = 0.0
        self.fired = False
        self.handle: asyncio.TimerHandle | None = self.loop.call_later(self.limit, self._due)

    def _due(self) -> None:
        self.waited += min(self.limit, self.most - self.waited)
        if self.waited >= self.most or not queued_in_engine(self.attempt, self.worker_id):
            self.handle = None
            self.fired = True
            self.deadline.reschedule(self.loop.time())  # expires at once: the read raises TimeoutError
            return
        log.info("gateway.first_event_queued", worker=self.worker_id, waited_s=round(self.waited, 1))
        self.handle = self.loop.call_later(min(self.limit, self.most - self.waited), self._due)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        elif self.fired and not self.deadline.expired():
            # The event came as the wait ran out, before the deadline's expiry ran: it stands.
            self.fired = False
            self.deadline.reschedule(None)


class StallWatch:
    """A stream segment's stall limit: `stall_s` of the engine's silence while the relay waits
    on it. The time the relay spends at its `yield` is the client's (a client that reads slowly
    holds the relay there, and the engine's connection is not read meanwhile), so it never
    counts: a client paused for longer than the limit is waited for, not cut off as if the
    engine had stalled.

    The deadline moves only when it is less than `stall_s` away, to STALL_MARGIN times that:
    never before `stall_s` of silence, at most a tenth of it late, and one timer per few
    seconds, not one per read. When it is due during a read, the segment's `asyncio.timeout`
    is made to expire, so the read raises TimeoutError (a stall, continued elsewhere)."""

    __slots__ = ("armed", "deadline", "handle", "loop", "reading", "stall_s")

    def __init__(self, deadline: asyncio.Timeout, stall_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.deadline, self.stall_s = deadline, stall_s
        self.armed = -math.inf  # the read must have brought data by then
        self.handle: asyncio.TimerHandle | None = None
        self.reading = False

    def arm(self, now: float) -> None:
        self.armed = now + self.stall_s * STALL_MARGIN
        if self.handle is None:
            self.handle = self.loop.call_at(self.armed, self._due)
        # else the timer set earlier finds the deadline moved when it fires, and follows it

    def _due(self) -> None:
        now = self.loop.time()
        if now < self.armed:  # moved since the timer was set
            self.handle = self.loop.call_at(self.armed, self._due)
        elif self.reading:
            self.handle = None
            self.deadline.reschedule(now)  # expires at once: the read raises TimeoutError
        else:  # at the client's pace since: the next read arms it again
            self.handle = None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Relayed:
    """One relayed stream's books across its segments: the worker serving it now and whether this
    gateway counts the stream there, what the client was sent, and how the stream ended."""

    __slots__ = ("attempt", "before_first", "counted", "fields", "first_chunk_ms", "metrics", "outcome",
                 "ran_to_its_end", "resp", "resumes", "started", "stores", "ticket", "tokens", "tracker", "worker")

    def __init__(self, attempt: Attempt, choice: Choice, resp: Response, tracker: StreamTracker | ResponsesTracker,
                 metrics: GatewayMetrics, started: float, fields: dict[str, object], stores: bool,
                 ticket: Ticket | None) -> None:
        self.attempt = attempt
        self.worker = choice.worker
        self.resp = resp
        self.tracker = tracker
        self.metrics = metrics
        self.started = started
        self.fields = fields
        self.stores = stores  # the response id is still to be recorded (a stored Responses API answer)
        self.ticket = ticket
        self.outcome = "completed"
        # Else the client went away, or the server stops: "client_gone" (or "client_stalled").
        self.ran_to_its_end = False
        self.first_chunk_ms: float | None = None
        self.before_first = True  # `first_out` has work left: the first piece, or the id to record
        self.resumes = 0
        self.counted = True  # `worker` holds one of this gateway's in-flight counts
        self.tokens = (0, 0)

    def one_by_one(self, joined: bytes, rest: bytes) -> tuple[bytes, EngineStreamError | None]:
        """What the client gets of a run of whole events whose `rest` the tracker looks at one
        by one (`StreamTracker.on_block`), after the `joined` that passed as it came; and the
        garbage that broke the stream in that run (None: none), to raise once what came before
        it is out (the tracker counts those events as sent: a stream resumed elsewhere goes on
        after them)."""
        tracker = self.tracker
        out: list[bytes] = []
        garbage = None
        try:
            for event in events(rest):
                piece = tracker.on_event(event)
                if piece is not None:
                    out.append(piece)
        except EngineStreamError as exc:
            garbage = exc
        for piece in out:
            # find(), not `in`: see gateway/request/resume.py's _usage_only.
            if piece.find(b'"usage":{') >= 0 or piece.find(b'"usage": {') >= 0:
                usage = usage_of(piece)
                if usage[1]:
                    self.tokens = usage
        if not out:
            return joined, garbage
        return (b"".join((joined, *out)) if joined else b"".join(out)), garbage

    async def first_out(self) -> None:
        """Before a piece leaves: the time to the first, and a stored response's id, recorded
        before the client can see it so that a follow-up finds it."""
        if self.first_chunk_ms is None:
            self.first_chunk_ms = round((time.perf_counter() - self.started) * 1000, 2)
        if self.stores and self.tracker.response_id:
            settings = self.attempt.dispatch.settings
            await remember(self.attempt.dispatch.watcher, self.tracker.response_id, self.worker.id,
                           settings.responses_ttl_s)
            self.stores = False
        self.before_first = self.stores

    def ending(self) -> bytes:
        """What ends the client's stream once the engine's ended: nothing more after [DONE],
        [DONE] after a finish_reason without it; StreamBroke before either."""
        if self.tracker.done:
            self.attempt.dispatch.breakers.success(self.worker.id)
            return b""
        if self.tracker.finished:  # a finish_reason came, only [DONE] is missing
            return DONE
        raise StreamBroke("the engine closed the stream before it finished")

    async def fail_over(self, exc: BaseException) -> bytes | None:
        """The engine's stream broke: continue it on another worker (None, and `resp` is the
        new worker's stream), else the last bytes the client gets."""
        reason = self._broke(exc)
        tracker = self.tracker
        if not tracker.resumable or self.resumes >= self.attempt.dispatch.settings.max_resumes:
            self.outcome = f"broken:{reason}"
            return tracker.error_event("The engine serving this stream failed and the stream cannot be "
                                       f"resumed elsewhere{tracker.why_not}; the answer is incomplete.")
        assert isinstance(tracker, StreamTracker)  # the only resumable kind
        attempt = self.attempt
        plan = continuation(attempt.body, attempt.kind, tracker.text, tracker.content_chunks,
                            continues_trailing_assistant(self.worker.info))
        if plan is None:
            return tracker.final_length_chunk()
        self.resumes += 1
        try:  # shaped for whichever engine takes over, by what its worker declares
            choice, self.resp = await attempt.resume(shaped(plan.body))
        except GatewayError as err:
            self.outcome = f"broken:{reason}"
            return tracker.error_event(f"The stream could not be resumed on another worker: {err.message}")
        self.worker = choice.worker
        self.counted = True
        self.metrics.resumed_stream(str(self.fields["model"]))
        attempt.trace.resumed(self.worker.id, self.resumes)
        tracker.start_segment()
        log.info("gateway.stream_resumed", worker=self.worker.id, resumes=self.resumes,
                 sent_chunks=tracker.content_chunks, request_id=self.fields["request_id"])
        return None

    def _broke(self, exc: BaseException) -> str:
        """Count the break against the worker and let go of it; returns the reason."""
        reason = "stalled" if isinstance(exc, TimeoutError) else type(exc).__name__
        worker_id = self.worker.id
        self.attempt.dispatch.breakers.failure(worker_id, f"stream {reason}")
        self.attempt.trace.stream_broke(worker_id, reason)
        self.resp.close()
        self.attempt.release(worker_id)
        self.counted = False
        self.tracker.analyse()
        log.warning("gateway.stream_broke", worker=worker_id, reason=reason,
                    sent_chunks=self.tracker.content_chunks, request_id=self.fields["request_id"])
        return reason

    async def close(self) -> None:
        """The stream ended, however it did: let go of the worker, settle the key's tokens,
        count the request and write its one summary line."""
        if not self.ran_to_its_end and self.outcome != "client_stalled":
            self.outcome = "client_gone"
        worker_id = self.worker.id
        if self.counted:
            if self.outcome == "completed":
                self.resp.release()
            else:
                self.resp.close()
            self.attempt.release(worker_id)
        self.attempt.trace.end(200, self.outcome)
        elapsed = time.perf_counter() - self.started
        tokens = self.tokens if self.tokens[1] else self.tracker.hidden_usage
        if self.ticket is not None:
            tokens = await self._settle(self.ticket, tokens)
        first_chunk_ms = self.first_chunk_ms
        self.metrics.request_done(
            str(self.fields["model"]), worker_id, 200, True, elapsed,
            first_chunk_ms / 1000 if first_chunk_ms is not None else None, *tokens,
        )
        log.bind().info(  # bind(): see Answered.run in gateway/request/reply.py
            "gateway.request", **self.fields, final_worker=worker_id, status=200, outcome=self.outcome,
            resumes=self.resumes, ttft_ms=first_chunk_ms, ms=round(elapsed * 1000, 2),
            prompt_tokens=tokens[0], completion_tokens=tokens[1],
        )

    async def _settle(self, ticket: Ticket, tokens: tuple[int, int]) -> tuple[int, int]:
        """Settle the key's ticket for the stream's tokens; returns the tokens counted."""
        tracker = self.tracker
        if not tokens[1] and isinstance(tracker, StreamTracker) and tracker.sent:
            tracker.analyse()  # no usage came (the client left first): count what was sent
            tokens = (ticket.charged, tracker.content_chunks)
        if self.outcome in ("client_gone", "client_stalled"):  # this task is being cancelled: settle beside it
            ticket.settle_soon(*tokens, 200)
        else:
            await ticket.settle(*tokens, 200)
        return tokens


__all__ = ["STALL_MARGIN", "FirstEvent", "Relayed", "StallWatch", "StreamBroke", "queued_in_engine"]
