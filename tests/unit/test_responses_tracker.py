"""The relay's view of a Responses API stream (gateway/request/responses.py ResponsesTracker): every
event passes as it came, its response id and terminal event noted, and the garbage checks of
the other streams hold: an event that is not JSON and the engine's own error event break the
stream (it ends with the gateway's error event, never the engine's message)."""

from __future__ import annotations

import msgspec
import pytest

from gateway.request.responses import ResponsesTracker
from gateway.request.resume import EngineStreamError


def event(kind: str, payload: dict[str, object]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **payload})


CREATED = event("response.created", {"response": {"id": "resp_1", "object": "response"}, "sequence_number": 0})
DELTA = event("response.output_text.delta", {"delta": "Hel", "sequence_number": 1})
COMPLETED = event("response.completed", {"response": {"id": "resp_1", "object": "response"}, "sequence_number": 2})


def test_events_pass_as_they_came_and_the_stream_ends_at_its_terminal_event() -> None:
    t = ResponsesTracker()
    assert [t.on_event(e) for e in (CREATED, DELTA)] == [CREATED + b"\n\n", DELTA + b"\n\n"]
    assert t.response_id == "resp_1" and not t.done
    assert t.on_event(b": keep-alive") == b": keep-alive\n\n"  # a comment carries nothing
    assert t.on_event(COMPLETED) == COMPLETED + b"\n\n" and t.done


@pytest.mark.parametrize("odd", [
    b"event: response.output_text.delta\ndata: {not json}",
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"cut sh',
    b"event: response.output_text.delta\ndata: <html>502 Bad Gateway</html>",
    event("error", {"code": "server_error", "message": "engine at http://10.0.0.7:8000 failed", "param": None,
                    "sequence_number": 2}),
    b'data: {"error":{"message":"engine at http://10.0.0.7:8000 failed","type":"x","param":null,"code":500}}',
    b'data: {"object":"error","message":"boom","type":"x","param":null,"code":500}',
], ids=["not-json", "cut-short", "html", "error-event", "openai-error", "vllm-error"])
def test_garbage_and_the_engines_error_event_break_the_stream(odd: bytes) -> None:
    """Nothing of the odd event reaches the client: the relay ends the stream with the
    gateway's own error event (relay.BROKEN; a Responses stream is not resumed elsewhere)."""
    t = ResponsesTracker()
    t.on_event(CREATED)
    with pytest.raises(EngineStreamError):
        t.on_event(odd)
    closing = t.error_event("The engine serving this stream failed.")
    assert closing.startswith(b"event: error\ndata: ") and b"10.0.0.7" not in closing
    assert msgspec.json.decode(closing.split(b"data: ", 1)[1])["sequence_number"] == 1
