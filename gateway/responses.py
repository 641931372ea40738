"""The Responses API across a fleet: a stored response lives on the engine that made it.

vLLM keeps the responses it stores in its own memory, so a follow-up that names one
(`previous_response_id`), a retrieve and a cancel must reach that engine. The
gateway learns each response's id as it passes (the body's `id`, or the stream's
first event), records `id -> worker` in the registry (shared by every gateway
replica, with a TTL), and pins requests that name it to that worker.

A Responses stream is relayed as it comes; it is not continued on another worker
if its engine dies (the conversation state is on that engine), it ends with an
`error` event instead.
"""

from __future__ import annotations

import msgspec

# Events after which a Responses stream has nothing more to say.
_TERMINAL = (b"event: response.completed", b"event: response.failed", b"event: response.incomplete",
             b"event: error")


class _Created(msgspec.Struct):
    id: str = ""


class _Event(msgspec.Struct):
    # The stream's events carry the whole response object under `response`.
    response: _Created | None = None


class _Body(msgspec.Struct):
    id: str = ""
    object: str = ""


_event = msgspec.json.Decoder(_Event)
_body = msgspec.json.Decoder(_Body)


def response_id_of(body: bytes) -> str:
    """The id of a (non-streamed) response object, or "" when it is none."""
    try:
        parsed = _body.decode(body)
    except msgspec.DecodeError:
        return ""
    return parsed.id if parsed.object == "response" else ""


class ResponsesTracker:
    """Follows a Responses API stream for the relay: every event passes unchanged; it notes
    the response's id (the first event carries it) and the stream's last event."""

    resumable = False
    finished = False
    text = ""

    def __init__(self) -> None:
        self.response_id = ""
        self.done = False
        self.content_chunks = 0
        self._sequence = -1

    def on_event(self, event: bytes) -> bytes:
        self.content_chunks += 1
        at = event.rfind(b'"sequence_number":')
        if at >= 0:
            digits = event[at + 18 : at + 40].lstrip().split(b",", 1)[0].split(b"}", 1)[0]
            if digits.isdigit():
                self._sequence = int(digits)
        if not self.response_id or event.startswith(_TERMINAL):
            _, _, data = event.partition(b"data:")
            try:
                parsed = _event.decode(data)
            except msgspec.DecodeError:
                parsed = _Event()
            if parsed.response is not None and parsed.response.id and not self.response_id:
                self.response_id = parsed.response.id
            if event.startswith(_TERMINAL):
                self.done = True
        return event + b"\n\n"

    def analyse(self) -> None:
        """Nothing to decode: a broken Responses stream is not continued."""

    def error_event(self, message: str, code: str = "stream_interrupted") -> bytes:
        """How a stream that cannot go on ends: the Responses API's `error` event."""
        # The last sequence number seen is a lower bound of what was sent; +1 keeps it increasing.
        self._sequence += 1
        payload = {"type": "error", "code": code, "message": message, "param": None,
                   "sequence_number": self._sequence}
        return b"event: error\ndata: " + msgspec.json.encode(payload) + b"\n\n"
