"""A whole answer's wait (gateway/engines/patience.py `Patience`, as gateway/request/attempts.py
gives it to the head's wait): cut at its limit unless its engine reports requests waiting, then
extended up to the queued allowance, as a stream's first event is; and how old an engine's report
may be to count (`engine_queued`, by the agent's heartbeat interval)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.accounts.waiting import engine_queued
from gateway.engines.upstream import Patience, Upstream
from gateway.errors import UpstreamTimeout


def answer_after(seconds: float) -> float:
    return seconds  # how long the stand-in engine takes to answer


async def within(delay: float, limit: float, most: float, queued: Callable[[], bool]) -> str:
    """A whole answer from an engine that answers after `delay`, its head's wait given `limit`
    and `most` as an attempt gives them (the upstream's own limit: `most`)."""
    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(delay)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 6\r\n\r\nanswer")
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upstream = Upstream(2.0)
    await upstream.start()
    try:
        patience = Patience(asyncio.get_running_loop().time(), limit, most, queued) if most > limit else None
        resp = await upstream.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", {}, False, most, patience)
        return (await upstream.body_of(resp)).decode()
    finally:
        await upstream.close()
        server.close()


def test_an_answer_within_its_limit_is_returned() -> None:
    assert asyncio.run(within(answer_after(0.05), 0.5, 5.0, lambda: False)) == "answer"


def test_a_wait_past_its_limit_with_no_queue_in_the_engine_is_cut() -> None:
    """The wait is cut at the limit: the caller sees an engine timeout."""
    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await within(answer_after(5.0), 0.2, 5.0, lambda: False)
        return time.monotonic() - started

    assert 0.15 < asyncio.run(main()) < 1.0


def test_a_wait_goes_on_while_the_engine_reports_a_queue_up_to_the_allowance() -> None:
    checks: list[float] = []

    def queued() -> bool:
        checks.append(time.monotonic())
        return True

    assert asyncio.run(within(answer_after(0.5), 0.15, 5.0, queued)) == "answer"
    assert len(checks) >= 2  # asked at each limit

    async def capped() -> float:
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await within(answer_after(5.0), 0.1, 0.35, lambda: True)
        return time.monotonic() - started

    assert 0.3 < asyncio.run(capped()) < 1.0


def view(waiting: int, age_s: float, heartbeat_s: float = 0.0) -> WorkerView:
    return WorkerView(info=WorkerInfo(id="w", url="http://w", engine="vllm", model="m", heartbeat_s=heartbeat_s),
                      state="ready", load=Load(waiting=waiting, ts=time.time() - age_s))


@pytest.mark.parametrize(("report", "expected"), [
    ((3, 1.0, 0.0), True),
    ((0, 1.0, 0.0), False),
    ((3, 6.0, 0.0), False),  # older than five heartbeats of 1 s (an agent that does not say)
    ((3, 6.0, 2.0), True),  # five heartbeats of 2 s
    ((3, 11.0, 2.0), False),
    (None, False),
])
def test_an_engine_queue_counts_while_its_report_is_fresh_by_its_heartbeat(
    report: tuple[int, float, float] | None, expected: bool,
) -> None:
    """(requests waiting, the report's age, the agent's heartbeat interval; 0: not said)"""
    assert engine_queued(view(*report) if report is not None else None) is expected


def test_a_client_hanging_up_is_not_taken_for_an_engine_timeout() -> None:
    async def main() -> None:
        task = asyncio.create_task(within(answer_after(5.0), 1.0, 5.0, lambda: False))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
