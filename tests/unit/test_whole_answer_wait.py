"""A whole answer's wait (gateway/accounts/waiting.py `within`): cut at its limit unless its engine reports
requests waiting, then extended up to the queued allowance, as a stream's first event is; and
how old an engine's report may be to count (`engine_queued`, by the agent's heartbeat interval)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.accounts.waiting import engine_queued, within
from gateway.errors import UpstreamTimeout


async def answer_after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "answer"  # stands in for the engine's response


def test_an_answer_within_its_limit_is_returned() -> None:
    assert asyncio.run(within(answer_after(0.05), 0.5, 5.0, lambda: False)) == "answer"


def test_a_wait_past_its_limit_with_no_queue_in_the_engine_is_cut() -> None:
    """The task is cancelled at the limit and uncancelled: the caller sees an engine timeout."""
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
