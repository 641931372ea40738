"""How a streamed answer leaves the fast path: a stream relayed within one turn of the loop
goes out in one write (head, events, end), a paced one piece by piece, and a stream broken
off still sends what was relayed before the connection closes.

The transport here records writes: what is checked is how `ConnectionWriter` groups its bytes into
writes, which a real socket would hide (loopback TCP may merge or split segments)."""

from __future__ import annotations

import asyncio

from gateway.front.fastpath import ConnectionWriter, Exchange
from tests.unit.test_server import Recorder as _Transport


class _Flow:
    write_paused = False


def _exchange(transport: _Transport) -> tuple[Exchange, list[int]]:
    answered: list[int] = []
    ex = Exchange("chat", {"path": "/v1/chat/completions", "headers": []}, transport, _Flow(),  # type: ignore[arg-type]
                  [(b"date", b"today")], True, False, 1 << 20, lambda: answered.append(1))
    return ex, answered


def _body(writes: list[bytes]) -> bytes:
    data = b"".join(writes)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\ndate: today\r\nx-a: 1\r\n")
    assert b"transfer-encoding: chunked" in head
    return body


def test_a_stream_relayed_in_one_turn_leaves_in_one_write() -> None:
    async def main() -> list[bytes]:
        transport = _Transport()
        ex, answered = _exchange(transport)
        out = ConnectionWriter(ex)
        await out.start(200, [("x-a", "1")])
        assert out.chunk(b"data: a\n\n") is False
        out.chunk(b"data: [DONE]\n\n")
        await out.end()
        assert answered == [1] and ex.response_complete
        await asyncio.sleep(0)  # the scheduled flush finds nothing left
        return transport.writes

    writes = asyncio.run(main())
    assert len(writes) == 1
    assert _body(writes) == b"9\r\ndata: a\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


def test_a_paced_stream_writes_its_head_when_the_loop_turns_then_each_piece() -> None:
    async def main() -> list[bytes]:
        transport = _Transport()
        ex, _ = _exchange(transport)
        out = ConnectionWriter(ex)
        await out.start(200, [("x-a", "1")])
        assert transport.writes == []
        await asyncio.sleep(0)  # the relaying task waits for the engine: the head goes out
        assert len(transport.writes) == 1
        out.chunk(b"data: a\n\n")
        await asyncio.sleep(0)
        out.chunk(b"data: b\n\n")
        await out.end()
        return transport.writes

    writes = asyncio.run(main())
    assert len(writes) == 4
    assert writes[1:] == [b"9\r\ndata: a\n\n\r\n", b"9\r\ndata: b\n\n\r\n", b"0\r\n\r\n"]
    assert _body(writes) == b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n"


def test_a_stream_broken_off_sends_what_was_relayed_then_closes() -> None:
    async def main() -> _Transport:
        transport = _Transport()
        ex, answered = _exchange(transport)
        out = ConnectionWriter(ex)
        await out.start(200, [("x-a", "1")])
        out.chunk(b"data: a\n\n")
        out.abort()
        await asyncio.sleep(0)
        assert answered == []  # never complete: the client sees the connection close mid-stream
        return transport

    transport = asyncio.run(main())
    assert transport.closed
    assert len(transport.writes) == 1 and _body(transport.writes) == b"9\r\ndata: a\n\n\r\n"


def test_nothing_is_written_to_a_client_that_left() -> None:
    async def main() -> list[bytes]:
        transport = _Transport()
        ex, _ = _exchange(transport)
        out = ConnectionWriter(ex)
        await out.start(200, [("x-a", "1")])
        out.chunk(b"data: a\n\n")
        ex.lost()
        await asyncio.sleep(0)
        out.chunk(b"data: b\n\n")
        await out.end()
        return transport.writes

    assert asyncio.run(main()) == []
