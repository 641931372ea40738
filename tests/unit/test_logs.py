"""fleetgate/logs.py: a loop iteration's log lines reach the file in one write, none later than that iteration."""

from __future__ import annotations

import asyncio
import io

import pytest

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


def test_the_json_info_line_is_the_one_structlogs_chain_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    """configure_logging's JSON `info` (run inline) writes what the configured chain writes."""
    import json
    import logging
    import sys

    import structlog

    from fleetgate.logs import configure_logging

    raw = _Raw()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BufferedWriter(raw)))
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("info", json=True)
        structlog.contextvars.bind_contextvars(gateway_pid=42)
        log = structlog.get_logger("t").bind(bound="b")
        log.info("t.fast", a=1, b=None)
        log.warning("t.slow", a=1, b=None)  # structlog's own path, through the same chain
        log.info("t.%s", "args", a=1)  # positional arguments: structlog's path too
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.configure(**saved)
        root.handlers[:], root.level = handlers, level
    lines = [json.loads(line) for line in b"".join(raw.writes).splitlines()]
    assert [line["event"] for line in lines] == ["t.fast", "t.slow", "t.args"]
    fast, slow = lines[0], lines[1]
    assert fast.keys() == slow.keys() == {"bound", "a", "b", "event", "gateway_pid", "level", "timestamp"}
    assert (fast["level"], slow["level"]) == ("info", "warning")
    assert fast["gateway_pid"] == 42 and fast["bound"] == "b" and fast["timestamp"].endswith("Z")


def test_a_child_forked_inside_a_loops_callback_writes_its_lines_at_once() -> None:
    """The child is not in the parent's loop (which would flush for it): its line is written at once."""
    import os

    logger, _raw = _logger()
    read_end, write_end = os.pipe()
    logger._file = os.fdopen(write_end, "wb", buffering=0)

    async def main() -> None:
        logger.info(b'{"event":"parent"}')  # a flush is now pending on this loop
        pid = os.fork()
        if pid == 0:  # the child: log, then leave without running anything of the loop's
            logger.info(b'{"event":"child"}')
            os._exit(0)
        os.waitpid(pid, 0)  # noqa: ASYNC222 - the child exits at once; the loop must not turn meanwhile
        await asyncio.sleep(0)

    asyncio.run(main())
    logger._file.close()
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read()
    assert out == b'{"event":"child"}\n{"event":"parent"}\n'


def test_lines_logged_from_another_thread_are_not_left_to_this_loops_flush() -> None:
    import threading

    logger, raw = _logger()

    async def main() -> None:
        logger.info(b'{"event":"loop"}')
        worker = threading.Thread(target=logger.info, args=(b'{"event":"thread"}',))
        worker.start()
        worker.join()
        assert raw.writes == [b'{"event":"thread"}\n']  # no loop in that thread: written at once
        await asyncio.sleep(0)

    asyncio.run(main())
    assert raw.writes == [b'{"event":"thread"}\n', b'{"event":"loop"}\n']
