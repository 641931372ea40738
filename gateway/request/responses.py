"""The Responses API across a fleet: a stored response lives on the engine that made it.

vLLM keeps the responses it stores in its own memory, so a follow-up that names one
(`previous_response_id`), a retrieve and a cancel must reach that engine. The
gateway learns each response's id as it passes (the body's `id`, or the stream's
first event), records `id -> worker` in the registry (shared by every gateway
replica, with a TTL), and pins requests that name it to that worker.

A Responses stream is relayed as it comes; it is not continued on another worker
if its engine dies (the conversation state is on that engine), it ends with an
`error` event instead. The garbage checks of the other streams (gateway/request/resume.py)
hold here too: an event whose data is not JSON, and the engine's own error event (its
message may name the engine), break the stream, which ends with the gateway's `error` event.
"""

from __future__ import annotations

import msgspec
import structlog
from redis.exceptions import RedisError

from fleetgate.schema import WorkerView
from gateway.engines.upstream import Upstream, is_json, openai_error_body
from gateway.errors import NotFound, NoWorkerAvailable
from gateway.fleet import FleetWatcher
from gateway.request.resume import EngineStreamError

log = structlog.get_logger("gateway.responses")

# Events after which a Responses stream has nothing more to say.
_TERMINAL = (b"event: response.completed", b"event: response.failed", b"event: response.incomplete")


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
    why_not = " (a Responses stream's state is on its engine)"
    finished = False
    text = ""
    hidden_usage = (0, 0)

    def __init__(self) -> None:
        self.response_id = ""
        self.done = False
        self.content_chunks = 0
        self._sequence = -1

    def on_block(self, block: bytes) -> tuple[bytes, bytes]:
        """Every event is looked at (`on_event`): the sequence numbers and the terminal event."""
        return b"", block

    def on_event(self, event: bytes) -> bytes:
        """The event as it came (EngineStreamError: garbage, or the engine's own error event)."""
        _, _, data = event.partition(b"data:")
        data = data.strip()
        if event.startswith(b"event: error") or data.startswith(b'{"error"') or data.startswith(b'{"type":"error"') \
                or data.startswith(b'{"type": "error"') or data.find(b'"object":"error"') >= 0 \
                or data.find(b'"object": "error"') >= 0:
            raise EngineStreamError("the engine sent an error event")
        if data and not is_json(data):
            raise EngineStreamError("the engine sent an event that is not JSON")
        self.content_chunks += 1
        at = event.rfind(b'"sequence_number":')
        if at >= 0:
            digits = event[at + 18 : at + 40].lstrip().split(b",", 1)[0].split(b"}", 1)[0]
            if digits.isdigit():
                self._sequence = int(digits)
        if not self.response_id or event.startswith(_TERMINAL):
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


async def owner_of(watcher: FleetWatcher, response_id: str, param: str) -> WorkerView:
    """The worker that stores Responses API response `response_id` (NotFound if none does)."""
    try:
        owner = await watcher.registry.response_worker(response_id)
    except (RedisError, OSError) as exc:  # the registry cannot say
        raise NoWorkerAvailable("The gateway cannot reach its registry to find where response "
                                f"`{response_id}` is stored; try again shortly.", retry_after=1) from exc
    if owner is None:
        raise NotFound(f"Response `{response_id}` is not known to this fleet: it was created with "
                       "`store: false`, has expired, or never existed.", param=param,
                       code="response_not_found")
    view = watcher.snapshot.by_id.get(owner)
    if view is None:
        raise NotFound(f"Response `{response_id}` was stored on worker `{owner}`, which has left the "
                       "fleet; its state is gone. Send the conversation in `input` instead.",
                       param=param, code="response_not_found")
    return view


async def remember(watcher: FleetWatcher, response_id: str, worker_id: str, ttl_s: float) -> None:
    """Record which worker stores `response_id`, for every gateway replica's follow-ups."""
    try:
        await watcher.registry.remember_response(response_id, worker_id, ttl_s)
    except (RedisError, OSError) as exc:  # the answer still goes out; only follow-ups will miss it
        watcher.unrecorded.failed(exc, response_id=response_id, worker=worker_id)
    else:
        watcher.unrecorded.ok()


async def forward_stored(
    upstream: Upstream, worker: WorkerView, method: str, path: str, query: str, timeout_s: float,
) -> tuple[int, str, bytes]:
    """A retrieve or cancel (`path`: the id and any suffix) on the worker storing the response."""
    url = f"{worker.info.url}/v1/responses/{path}" + (f"?{query}" if query else "")
    status, content_type, data = await upstream.call(method, url, timeout_s)
    if status >= 400:
        data, content_type = openai_error_body(status, data), "application/json"
    return status, content_type, data
