"""gateway/request/sse.py: an engine's reads come out as runs of whole events, however the reads cut them
(partial events wait for their blank line; comments, multi-line data, CRLF lines and [DONE]
stay whole), and a run splits back into its events."""

from __future__ import annotations

import pytest

from gateway.request.sse import SSEFrames, events

HEL = b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
LO = b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(("reads", "runs"), [
    # one read, one event: passes as it came
    ([HEL], [HEL]),
    # one read, several events and [DONE]: one run, as it came
    ([HEL + LO + DONE], [HEL + LO + DONE]),
    # an event cut in two: nothing until its blank line, then the whole of it
    ([HEL[:10], HEL[10:]], [b"", HEL]),
    # cut inside its blank line
    ([HEL[:-1], b"\n"], [b"", HEL]),
    # cut in three, the middle read holding no line end
    ([HEL[:5], HEL[5:20], HEL[20:]], [b"", b"", HEL]),
    # a read ends one event and starts the next: the started one waits
    ([HEL + LO[:7], LO[7:] + DONE], [HEL, LO + DONE]),
    # [DONE] cut in two
    ([HEL + b"data: [DO", b"NE]\n\n"], [HEL, DONE]),
    # a comment is an event like any other
    ([b": keep-alive\n\n", HEL], [b": keep-alive\n\n", HEL]),
    # several data lines are one event: no run ends between them
    ([b"data: line one\ndata: line two\n", b"\n"], [b"", b"data: line one\ndata: line two\n\n"]),
    # lines ending in CRLF before the blank line
    ([b"data: x\r\n\n", b"data: y\r\n", b"\n"], [b"data: x\r\n\n", b"", b"data: y\r\n\n"]),
    # a blank line of CRLF alone ends no event (the engines end events with LF LF)
    ([b"data: x\r\n\r\n"], [b""]),
])
def test_reads_come_out_as_runs_of_whole_events(reads: list[bytes], runs: list[bytes]) -> None:
    frames = SSEFrames()
    assert [frames.feed(read) for read in reads] == runs


def test_the_unfinished_tail_is_kept_until_the_stream_ends() -> None:
    frames = SSEFrames()
    assert frames.feed(HEL + b"data: {") == HEL
    assert frames.partial == b"data: {"


@pytest.mark.parametrize(("run", "split"), [
    (HEL, [HEL[:-2]]),
    (HEL + LO + DONE, [HEL[:-2], LO[:-2], b"data: [DONE]"]),
    (b": keep-alive\n\n" + DONE, [b": keep-alive", b"data: [DONE]"]),
    (b"data: line one\ndata: line two\n\n", [b"data: line one\ndata: line two"]),
    (b"data: x\r\n\ndata: y\r\n\n", [b"data: x", b"data: y"]),
])
def test_a_run_splits_into_its_events_without_their_line_ends(run: bytes, split: list[bytes]) -> None:
    assert events(run) == split
