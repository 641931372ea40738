"""gateway/front/server.py: a whole answer's head leaves with its body; a stream's head at once."""

from __future__ import annotations

from typing import Any

from gateway.front.server import _Coalescing


class Recorder:
    """Stands in for the socket's transport: what was written, call by call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


def test_a_content_length_head_waits_for_its_body() -> None:
    """Head and body of a whole answer go out in one write; the next answer's too."""
    rec = Recorder()
    t = _Coalescing(rec)  # type: ignore[arg-type]
    t.write(HEAD)
    assert rec.writes == []
    t.write(b"{}")
    t.write(HEAD)
    t.write(b"[]")
    assert rec.writes == [HEAD + b"{}", HEAD + b"[]"]


def test_a_stream_head_goes_at_once_and_close_flushes() -> None:
    """A chunked head (a stream) is written straight away; a held head is not lost on close;
    anything else the protocol asks of the transport reaches the real one."""
    rec = Recorder()
    t = _Coalescing(rec)  # type: ignore[arg-type]
    stream_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    t.write(stream_head)
    assert rec.writes == [stream_head]
    t.write(HEAD)
    t.close()
    assert rec.writes[-1] == HEAD and rec.closed
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)
