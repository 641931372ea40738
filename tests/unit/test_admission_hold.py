"""The admission queue's KV hold (gateway/accounts/admission.py): in process, no I/O."""

from __future__ import annotations

import asyncio
import time

from gateway.accounts.admission import Admission


def test_a_held_request_goes_on_when_a_completion_makes_room() -> None:
    async def main() -> tuple[bool, float, int, int]:
        admission = Admission(limit=lambda: 10, recheck_s=5.0)
        room = False
        task = asyncio.create_task(admission.hold("w0", lambda: room, time.monotonic() + 5))
        await asyncio.sleep(0.05)
        held, queued = admission.held, admission.queued
        room = True
        started = time.monotonic()
        admission.wake()  # what a completion does
        got = await task
        return got, time.monotonic() - started, held, queued

    got, waited, held, queued = asyncio.run(main())
    assert got is True and waited < 1.0  # woken, not found by the 5 s re-check
    assert held == 1 and queued == 0  # a hold is not counted against the shedding queue


def test_a_hold_ends_at_its_limit_without_a_refusal() -> None:
    async def main() -> tuple[bool, float, int]:
        admission = Admission(limit=lambda: 10, recheck_s=0.05)
        started = time.monotonic()
        got = await admission.hold("w0", lambda: False, started + 0.2)
        return got, time.monotonic() - started, admission.held

    got, waited, held = asyncio.run(main())
    assert got is False and 0.15 < waited < 2.0 and held == 0


def test_holds_for_one_worker_go_on_in_arrival_order() -> None:
    async def main() -> list[int]:
        admission = Admission(limit=lambda: 10, recheck_s=5.0)
        order: list[int] = []
        free = [0]

        def room() -> bool:
            if free[0] > 0:
                free[0] -= 1
                return True
            return False

        async def one(i: int) -> None:
            await admission.hold("w0", room, time.monotonic() + 5)
            order.append(i)

        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.01)
        for _ in range(4):
            free[0] += 1
            admission.wake()
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3]
