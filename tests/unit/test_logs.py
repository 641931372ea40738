"""fleetgate/logs.py: a loop iteration's log lines reach the file in one write, none later than that iteration."""

from __future__ import annotations

import asyncio
import io

from fleetgate.logs import LoopFlushedLogger


class _Raw(io.RawIOBase):
    """A file's raw layer that records each write(2) it would make."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def _logger() -> tuple[LoopFlushedLogger, _Raw]:
    raw = _Raw()
    return LoopFlushedLogger(raw), raw  # unbuffered, as stderr is under PYTHONUNBUFFERED


def test_outside_a_loop_each_line_is_written_at_once() -> None:
    logger, raw = _logger()
    logger.info(b'{"event":"a"}')
    assert raw.writes == [b'{"event":"a"}\n']
    logger.warning(b'{"event":"b"}')
    assert raw.writes[-1] == b'{"event":"b"}\n'


def test_the_lines_of_one_loop_iteration_go_out_in_one_write_when_it_ends() -> None:
    logger, raw = _logger()

    async def main() -> list[bytes]:
        for n in range(5):
            logger.info(b'{"n":%d}' % n)
        held = list(raw.writes)  # nothing written while the iteration runs
        await asyncio.sleep(0)  # the next iteration: the flush has run
        return held

    held = asyncio.run(main())
    assert held == []
    assert raw.writes == [b"".join(b'{"n":%d}\n' % n for n in range(5))]


def test_a_loop_that_stopped_before_its_flush_does_not_hold_later_lines_back() -> None:
    logger, raw = _logger()
    first = asyncio.new_event_loop()

    def log_and_stop() -> None:
        logger.info(b'{"event":"first"}')
        first.stop()  # the loop ends with this iteration: the flush it queued never runs

    first.call_soon(log_and_stop)
    first.run_forever()
    first.close()
    assert raw.writes == []

    async def later() -> None:
        logger.info(b'{"event":"second"}')
        await asyncio.sleep(0)

    asyncio.run(later())
    assert raw.writes == [b'{"event":"first"}\n{"event":"second"}\n']


def test_lines_left_by_a_stopped_loop_are_written_by_the_flush_at_exit() -> None:
    logger, raw = _logger()
    loop = asyncio.new_event_loop()

    def log_and_stop() -> None:
        logger.info(b'{"event":"last"}')
        loop.stop()

    loop.call_soon(log_and_stop)
    loop.run_forever()
    loop.close()
    logger.flush()  # configure_logging registers it with atexit
    assert raw.writes == [b'{"event":"last"}\n']
