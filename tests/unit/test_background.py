"""fleetgate/background.py: one warning when a loop's step starts failing, one info line when it
works again, whatever the steps between (table-driven, structlog's own capture)."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from structlog.testing import capture_logs

from fleetgate.background import Outage, repeat, stop_tasks


@pytest.mark.parametrize(
    ("steps", "logged"),
    [
        ("", []),
        ("ooo", []),
        ("x", [("warning", "loop.failed")]),
        ("xxx", [("warning", "loop.failed")]),
        ("xxo", [("warning", "loop.failed"), ("info", "loop.resumed")]),
        ("xoxo", [("warning", "loop.failed"), ("info", "loop.resumed")] * 2),
        ("oxxooxo", [("warning", "loop.failed"), ("info", "loop.resumed")] * 2),
    ],
)
def test_one_line_each_way_per_outage(steps: str, logged: list[tuple[str, str]]) -> None:
    outage = Outage(structlog.get_logger("t"), "loop.failed", "loop.resumed", worker="w1")
    with capture_logs() as logs:
        for step in steps:
            if step == "x":
                outage.failed(OSError("Connection refused"))
            else:
                outage.ok()
    assert [(e["log_level"], e["event"]) for e in logs] == logged
    assert all(e["worker"] == "w1" for e in logs)
    assert all(e["error"] == "OSError('Connection refused')" for e in logs if e["log_level"] == "warning")
    assert outage.failing == (steps[-1:] == "x")


def test_without_a_recovery_event_only_the_failure_is_said() -> None:
    outage = Outage(structlog.get_logger("t"), "usage.unavailable")
    with capture_logs() as logs:
        assert outage.failed(OSError("down"), pending=3) is True
        assert outage.failed(OSError("down")) is False
        assert outage.ok() is True
        assert outage.ok() is False
    assert [(e["event"], e.get("pending")) for e in logs] == [("usage.unavailable", 3)]


async def test_stop_tasks_cancels_and_waits_for_every_task_even_one_that_failed() -> None:
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    async def broken() -> None:
        raise RuntimeError("its own loop logged this")

    tasks = [asyncio.create_task(forever("a")), asyncio.create_task(broken()), asyncio.create_task(forever("b"))]
    await asyncio.sleep(0)  # all started; `broken` has failed
    await stop_tasks(*tasks, None)
    assert sorted(ended) == ["a", "b"] and all(t.done() for t in tasks)
    assert tasks[0].cancelled() and not tasks[1].cancelled()


async def test_a_caller_cancelled_while_it_stops_tasks_is_cancelled_itself() -> None:
    """A timeout on a close that waits for a task which will not end reaches the closer: stop_tasks
    does not take the caller's own cancel for the task's."""
    stubborn = True

    async def misses_its_cancel() -> None:
        while stubborn:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(misses_its_cancel())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stop_tasks(task), 0.2)
    stubborn = False
    task.cancel()
    await asyncio.wait({task})


async def test_stop_tasks_cancels_again_a_task_that_lost_its_cancel() -> None:
    """A task that misses its first two cancels (as one awaiting pyzmq's poll can) is cancelled
    again every `again_after_s` until it ends; without it the stop would wait for ever."""
    missed: list[int] = []

    async def misses_two() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if len(missed) == 2:
                    raise
                missed.append(1)

    task = asyncio.create_task(misses_two())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):  # the precondition: one cancel does not end it
        await asyncio.wait_for(asyncio.shield(stop_tasks(task)), 0.1)
    await asyncio.wait_for(stop_tasks(task, again_after_s=0.05), 2.0)
    assert task.cancelled() and len(missed) == 2


async def test_repeat_runs_the_step_says_each_outage_once_and_calls_on_error_per_failure() -> None:
    """Steps fail, fail, work, fail, then the loop is cancelled: one warning per run of failures,
    one recovery line, `on_error` after each failure, and the cancel ends the loop."""
    plan = iter("xxox")
    seen: list[str] = []
    done = asyncio.Event()

    async def step() -> None:
        outcome = next(plan, None)
        if outcome is None:
            done.set()
            await asyncio.sleep(3600)
        seen.append(str(outcome))
        if outcome == "x":
            raise OSError("Connection refused")

    errors: list[int] = []
    outage = Outage(structlog.get_logger("t"), "loop.failed", "loop.resumed")
    with capture_logs() as logs:
        task = asyncio.create_task(repeat(step, outage, 0.001, on_error=lambda: errors.append(len(seen))))
        await asyncio.wait_for(done.wait(), 5)
        await stop_tasks(task)
    assert seen == list("xxox") and errors == [1, 2, 4]
    assert [e["event"] for e in logs] == ["loop.failed", "loop.resumed", "loop.failed"]
    assert task.cancelled()


async def test_repeat_lets_an_error_it_was_not_told_of_end_the_loop() -> None:
    async def step() -> None:
        raise KeyError("a bug")

    outage = Outage(structlog.get_logger("t"), "loop.failed")
    with pytest.raises(KeyError):
        await asyncio.wait_for(repeat(step, outage, 0.001, errors=(OSError,)), 5)
    assert not outage.failing


async def test_repeat_with_wake_runs_the_next_step_when_woken_not_after_the_interval() -> None:
    wake = asyncio.Event()
    ran = [asyncio.Event(), asyncio.Event()]
    runs = 0

    async def step() -> None:
        nonlocal runs
        runs += 1
        ran[min(runs, 2) - 1].set()

    task = asyncio.create_task(repeat(step, Outage(structlog.get_logger("t"), "loop.failed"), 3600, wake=wake))
    await asyncio.wait_for(ran[0].wait(), 5)
    assert runs == 1
    wake.set()
    await asyncio.wait_for(ran[1].wait(), 5)  # an hour's interval: only the wake runs it
    await stop_tasks(task)
    assert runs == 2 and not wake.is_set()  # cleared for the next wait
