"""The fast path's stream writer: fewer writes, and no byte held past the loop iteration that made it."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.fastpath import _Out


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True


class _Flow:
    write_paused = False


class _Cycle:
    """The attributes of uvicorn's RequestResponseCycle that `_Out` reads and sets."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.flow = _Flow()
        self.disconnected = False
        self.keep_alive = True
        self.default_headers = [(b"server", b"t")]
        self.response_started = self.response_complete = self.waiting_for_100_continue = False
        self.message_event = asyncio.Event()
        self.completed = 0

    def on_response(self) -> None:
        self.completed += 1


def _run(steps: Any) -> _Cycle:
    async def main() -> _Cycle:
        cycle = _Cycle()
        await steps(_Out(cycle))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        return cycle
    return asyncio.run(main())


def test_a_stream_whose_first_event_came_with_its_head_starts_in_one_write() -> None:
    async def steps(out: _Out) -> None:
        out.start_stream(200, b"x-a: 1\r\n")
        await out.chunk(b"data: 1\n\n")

    writes = _run(steps).transport.writes
    assert len(writes) == 1
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\nserver: t\r\nx-a: 1\r\n") and writes[0].endswith(b"9\r\ndata: 1\n\n\r\n")


def test_a_head_waits_no_longer_than_its_loop_iteration() -> None:
    seen: list[list[bytes]] = []

    async def steps(out: _Out) -> None:
        out.start_stream(200, b"")
        seen.append(list(out.cycle.transport.writes))  # type: ignore[attr-defined]
        await asyncio.sleep(0)  # the engine's first event is not there yet
        seen.append(list(out.cycle.transport.writes))  # type: ignore[attr-defined]
        await out.chunk(b"data: 1\n\n")

    writes = _run(steps).transport.writes
    assert seen[0] == [] and len(seen[1]) == 1 and seen[1][0].startswith(b"HTTP/1.1 200 OK")
    assert writes[1] == b"9\r\ndata: 1\n\n\r\n"


def test_the_last_event_leaves_with_the_end_of_the_body() -> None:
    async def steps(out: _Out) -> None:
        out.start_stream(200, b"")
        await asyncio.sleep(0)
        await out.chunk(b"data: 1\n\n")
        await out.chunk(b"data: 2\n\ndata: [DONE]\n\n")
        out.end_stream()

    cycle = _run(steps)
    assert cycle.transport.writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"17\r\ndata: 2\n\ndata: [DONE]\n\n\r\n0\r\n\r\n"]
    assert cycle.response_complete and cycle.completed == 1


def test_a_held_last_event_goes_out_at_the_iterations_end_even_without_the_body_end() -> None:
    async def steps(out: _Out) -> None:
        out.start_stream(200, b"")
        await out.chunk(b"data: [DONE]\n\n")

    cycle = _run(steps)
    assert b"".join(cycle.transport.writes).endswith(b"data: [DONE]\n\n\r\n") and not cycle.response_complete


def test_an_aborted_stream_sends_what_it_held_then_closes() -> None:
    async def steps(out: _Out) -> None:
        out.start_stream(200, b"")
        await out.chunk(b'data: {"error": {}}\n\ndata: [DONE]\n\n')
        out.abort()

    cycle = _run(steps)
    assert len(cycle.transport.writes) == 1 and cycle.transport.writes[0].endswith(b"data: [DONE]\n\n\r\n")
    assert cycle.transport.closed


def test_nothing_is_written_to_a_client_that_left() -> None:
    async def steps(out: _Out) -> None:
        out.start_stream(200, b"")
        out.cycle.disconnected = True
        await out.chunk(b"data: 1\n\n")

    assert _run(steps).transport.writes == []
