"""The relay's view of an engine stream (gateway/request/resume.py StreamTracker): runs of whole events
pass as they came, and what was sent is still read back whole when a stream must be resumed."""

from __future__ import annotations

import msgspec
import pytest

from gateway.request.resume import EngineStreamError, StreamTracker


def chat(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, object] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


USAGE = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[],' \
        b'"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def tracker(hide_usage: bool = True) -> StreamTracker:
    return StreamTracker("chat", lambda text_sent: None, hide_usage=hide_usage)


ROLE, HEL, LO = chat(role=True), chat("Hel"), chat("lo")


@pytest.mark.parametrize(("block", "passed"), [
    (ROLE + HEL + LO, ROLE + HEL + LO),
    (b": a comment\n\n" + HEL, b": a comment\n\n" + HEL),
    (chat("x", finish="length"), chat("x", finish="length")),
    # [DONE] and the usage chunk are looked at on their own, with whatever follows them
    (HEL + LO + DONE, HEL + LO),
    (HEL + USAGE + DONE, HEL),
    (USAGE + DONE, b""),
    (DONE, b""),
    # [DONE] in a chunk's text is text: the run passes as it came
    (HEL + chat("[DONE] is a word") + LO, HEL + chat("[DONE] is a word") + LO),
    (HEL + LO + USAGE, HEL + LO),
])
def test_a_run_of_events_passes_as_it_came_up_to_one_that_needs_a_look(block: bytes, passed: bytes) -> None:
    t = tracker()
    assert t.on_block(block) == (passed, block[len(passed):])


def test_after_a_resume_every_event_is_rewritten_one_by_one() -> None:
    t = tracker()
    assert t.on_block(chat(role=True) + chat("a"))[1] == b""
    t.analyse()
    t.start_segment()
    block = chat(role=True) + chat("b")
    assert t.on_block(block) == (b"", block)


def test_the_text_sent_in_runs_and_one_by_one_is_read_back_in_order() -> None:
    t = tracker()
    assert t.on_block(chat(role=True) + chat("One ") + chat("two "))[1] == b""
    assert t.on_event(chat("three").rstrip(b"\n")) is not None
    assert t.on_block(b"\n" + chat("four") + chat(finish="length"))[1] == b""
    assert t.on_event(USAGE.rstrip(b"\n")) is None  # hidden: the client did not ask for usage
    assert t.hidden_usage == (5, 3)
    t.analyse()
    assert t.text == "One two threefour" and t.content_chunks == 4
    assert t.response_id == "chatcmpl-1" and t.created == 7 and t.finished


def test_a_finish_reason_in_a_run_marks_the_stream_finished() -> None:
    t = tracker()
    t.on_block(chat("a"))
    assert not t.finished
    t.on_block(chat("b") + chat(finish="stop"))
    assert t.finished


ERROR_EVENT = b'data: {"error":{"message":"engine at http://10.0.0.7:8000 failed","type":"x","param":null,"code":500}}\n\n'
OBJECT_ERROR = b'data: {"object":"error","message":"boom","type":"x","param":null,"code":500}\n\n'
CUT_SHORT = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choi\n\n'
NOT_JSON = b"data: {not json}\n\n"


@pytest.mark.parametrize("odd", [ERROR_EVENT, OBJECT_ERROR, CUT_SHORT, NOT_JSON])
def test_a_run_with_an_event_that_is_not_a_chunk_as_they_come_is_looked_at_event_by_event(odd: bytes) -> None:
    """Nothing of such a run passes unread: on_event breaks the stream at the odd event (resumed
    elsewhere, or ended with the gateway's error event), so its text never reaches the client."""
    t = tracker()
    block = HEL + odd + LO
    assert t.on_block(block) == (b"", block)
    assert t.on_event(HEL.rstrip(b"\n")) == HEL
    with pytest.raises(EngineStreamError):
        t.on_event(odd.rstrip(b"\n"))


def test_a_finish_reason_that_passed_unread_is_found_when_asked() -> None:
    t = tracker()
    assert t.on_block(chat("a") + chat(finish="length")) == (chat("a") + chat(finish="length"), b"")
    assert t.finished
