"""Cutting an engine's SSE byte stream into whole events, as the relay needs them.

Pure: bytes in, bytes out, no I/O (tests/unit/test_sse.py is its table). An event ends at a
blank line, `\\n\\n`, as the engines the gateway serves send it (vLLM, SGLang, the simulator);
a line may end in `\\r\\n` before that blank line (`events` strips the `\\r`). An event is
never cut in two: its `data:` lines, several of them or one, and a comment (`: ...`) stay
whole, and `[DONE]` is an event like any other here (the tracker, gateway/request/resume.py, knows it).

Compiled (scripts/compile.py): the relay calls `feed` once per read of every stream; compiled,
a stream cost ~6,500 fewer instructions (743,068 -> 736,520, scripts/bench_instructions.py --modes stream --requests 1000).
"""

from __future__ import annotations


class SSEFrames:
    """Whole events out of reads that may end mid-event: what a read completes comes out as one
    run (every event that ended in it, together, as it came); the unfinished tail waits for the
    next read. One per engine stream: a continued stream (gateway/request/resume.py) starts afresh."""

    def __init__(self) -> None:
        self.partial = b""  # the start of an event whose blank line has not come yet

    def feed(self, data: bytes) -> bytes:
        """The run of whole events that `data` completes, ending in a blank line (b"": none yet)."""
        if self.partial:
            data = self.partial + data
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self.partial = data
            return b""
        if end == len(data):  # the common case: a read ends where an event does
            self.partial = b""
            return data
        self.partial = data[end:]
        return data[:end]


def events(run: bytes) -> list[bytes]:
    """The events of a run (`SSEFrames.feed`'s), each without the line ends around it."""
    return [event.strip(b"\r\n") for event in run[:-2].split(b"\n\n")]


__all__ = ["SSEFrames", "events"]
