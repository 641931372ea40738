"""Mid-stream failover: follow an SSE stream closely enough to continue it on another worker.

`StreamTracker` keeps every event the client is sent and, only when a stream
breaks, decodes them for the text so far, the response id and whether the request
can be resumed faithfully. When the engine dies or stalls, a `Continuation` builds the
request that makes another engine carry on from that text, shaped for the engine that
takes over (whether it continues a trailing assistant message by itself: a capability
its worker declares, gateway/engines/capabilities.py), and the tracker rewrites the new
engine's events so the client sees one stream: the same id, no repeated role chunk,
one finish_reason, usage summed (and kept from a client that did not ask for it).

A constrained stream (`response_format`, guided decoding, tools) is resumed only
before any of its text was sent: another engine would start the constraint over
after the prefilled text (a second JSON object, say), so it ends with an error event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from gateway.engines.upstream import is_json, sse_error
from gateway.observe.metrics import answer_usage
from gateway.wire import StreamChunk

DONE = b"data: [DONE]\n\n"

# Request fields for guided decoding (older and newer names), which some engines accept
# beyond OpenAI's API.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


# (The chunk shapes live in gateway/wire.py: this module is compiled, scripts/compile.py.)
_chunk = msgspec.json.Decoder(StreamChunk)


class EngineStreamError(Exception):
    """The engine's stream carried its own error event, or an event that is not JSON: it broke
    (continued elsewhere, or ended with the gateway's error event; the engine's never reaches the
    client: it may name the engine)."""


_DONE_EVENT = b"data: [DONE]\n\n"


def _as_they_come(run: bytes) -> bool:
    """Whether every event of `run` (whole events) can pass to the client unread: a comment, or
    an engine's chunk as vLLM and the OpenAI-style engines write them, `data: {"id"...}` whole
    (it ends its JSON object). An error event (`{"error"...}`, `{"object":"error"...}`), an event
    cut short or one that is not JSON is not: `on_event` looks at it. Three counts for the
    common run; comments are counted only where the chunks do not add up."""
    events = run.count(b"\n\n")
    chunks = run.count(b'data: {"id"')
    if chunks != events:
        chunks += run.count(b"\n\n:") + run.startswith(b":")
        if chunks != events:
            return False
        return run.count(b"}\n\n") + run.count(b"\n\n:") + run.startswith(b":") >= events
    return run.count(b"}\n\n") == events


def _usage_only(payload: bytes) -> bool:
    """The chunk `stream_options.include_usage` adds: `"choices": []` and the usage."""
    # "usage" first: content chunks lack it, so most events cost one scan here, not two.
    # find(), not `in`: bytes.__contains__ first tries its needle as an int, which raises and
    # formats a TypeError on every call under CPython 3.11 (twice the cost of the scan).
    return payload.find(b'"usage"') >= 0 and (payload.find(b'"choices":[]') >= 0
                                               or payload.find(b'"choices": []') >= 0)


_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


def with_usage(body: bytes) -> bytes:
    """A stream request's body that asks the engine for its usage chunk, so that the gateway
    counts the tokens of every stream (the relay drops that chunk for a client that did not
    ask for it). `body` is a JSON object with fields (parse_request checked it)."""
    if body.find(b'"stream_options"') < 0:
        start = body.index(b"{") + 1
        return body[:start] + _INCLUDE_USAGE + body[start:]
    d = msgspec.json.decode(body)
    options = d.get("stream_options")
    d["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
    return msgspec.json.encode(d)


def unresumable(body: bytes, kind: str, text_sent: bool) -> str | None:
    """Why a stream of this request cannot be continued elsewhere without changing its meaning
    (None: it can), once `text_sent` or not."""
    try:
        d = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return "its body is not JSON"
    if not isinstance(d, dict):
        return "its body is not an object"
    if (d.get("n") or 1) != 1 or (d.get("best_of") or 1) != 1:
        return "it asks for several choices"
    if d.get("logprobs") or d.get("top_logprobs") or d.get("echo"):
        return "it asks for logprobs or echo"
    if kind == "completion" and not isinstance(d.get("prompt"), str):
        return "its prompt is not one string"
    if text_sent:
        fmt = d.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
            return f"its response_format {fmt.get('type')} would start over on another engine"
        if any(d.get(name) is not None for name in _GUIDED):
            return "its guided decoding would start over on another engine"
        if d.get("tools") and d.get("tool_choice") != "none":
            return "it offers tools, whose parsing would start over on another engine"
    return None


def _payloads(sent: list[bytes]) -> Iterator[bytes]:
    """The data payloads in what was sent: runs of SSE events, or the JSON of one chunk."""
    for item in sent:
        if item.startswith(b"{"):
            yield item
            continue
        for event in item.split(b"\n\n"):
            event = event.strip(b"\r\n")
            if event.startswith(b"data:"):
                yield event[5:].strip()


class StreamTracker:
    """Follows one stream. The common case (nothing breaks) costs a list append and a few byte
    searches per read from the engine (`on_block`): events are only decoded when the stream
    must be resumed."""

    def __init__(self, kind: str, unresumable: Callable[[bool], str | None], hide_usage: bool = False) -> None:
        self.kind = kind
        # The gateway asked the engine for usage, the client did not: its chunk is dropped.
        self.hide_usage = hide_usage
        self.hidden_usage = (0, 0)
        # Asked only when the stream breaks (it decodes the whole request body), with
        # whether any text was sent.
        self._unresumable = unresumable
        self.resumable = True
        # Why not, for the client's error event: " (<reason>)" or "".
        self.why_not = ""
        # What the client was sent, as sent: runs of whole SSE events, or one event's data.
        self.sent: list[bytes] = []
        self._finished = False
        self.done = False
        self.segment = 0
        self.text = ""
        self.content_chunks = 0
        self.response_id = ""
        self.created = 0
        self._usage_before = 0

    def on_block(self, block: bytes) -> tuple[bytes, bytes]:
        """Split a run of whole events (`block` ends in a blank line) into what goes to the client
        as it came and the rest, whose events need `on_event` one by one: from a usage chunk or
        [DONE] on, all of it once the stream goes on from another engine, and all of it when an
        event of the run is not an engine's chunk as they come (an error event, one that is not
        JSON or was cut short: `_as_they_come`)."""
        if self.segment:
            return b"", block
        end = len(block)
        if block.endswith(_DONE_EVENT):  # the stream's last event: looked at on its own
            end -= len(_DONE_EVENT)
        # The common run, in three searches: every event `data: {"id"...}` whole: the first and the
        # last so, and every `data:` line after the first follows a `}` and a blank line and opens
        # a chunk (an error event, a chunk cut short, a second data line does not); then where a
        # usage chunk is. (A line in the middle that is no `data:` line carries nothing to a client.)
        if end and block.startswith(b'data: {"id"') and block.endswith(b"}\n\n", 0, end) \
                and block.startswith(b'data: {"id"', block.rfind(b"\n\n", 0, end - 2) + 2) \
                and block.count(b'}\n\ndata: {"id"', 0, end) == block.count(b"\ndata:", 0, end):
            at = block.find(b'"usage"', 0, end)
            cut = end if at < 0 else block.rfind(b"\n\n", 0, at) + 2
        else:
            cut = self._odd_run(block)
        if cut < 2:
            return b"", block
        passed = block if cut == len(block) else block[:cut]
        self.sent.append(passed)
        return passed, block[cut:]

    @staticmethod
    def _odd_run(block: bytes) -> int:
        """Where a run that is not all chunks as they come stops passing unread (0: none of it):
        before the first event holding [DONE] or a usage chunk, if what precedes it is."""
        cut = len(block)
        for marker in (b"[DONE]", b'"usage"'):
            at = block.find(marker, 0, cut)
            if at >= 0:
                cut = block.rfind(b"\n\n", 0, at) + 2  # where that event starts (-1 + 2: the first)
                cut = cut if cut >= 2 else 0
        return cut if cut and _as_they_come(block if cut == len(block) else block[:cut]) else 0

    @property
    def finished(self) -> bool:
        """Whether a finish_reason came: read from what was sent when first asked (a run that
        passed as it came was not looked into, which keeps the common read to a few searches)."""
        if not self._finished:
            self._finished = any(p.find(b'"finish_reason":"') >= 0 or p.find(b'"finish_reason": "') >= 0
                                 for p in self.sent)
        return self._finished

    def on_event(self, event: bytes) -> bytes | None:
        """The bytes to send the client for one SSE event (None: drop it)."""
        if not event.startswith(b"data:"):
            return event + b"\n\n" if self.segment == 0 else None
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return DONE
        if payload.startswith(b'{"error"') or payload.find(b'"object":"error"') >= 0 \
                or payload.find(b'"object": "error"') >= 0:
            raise EngineStreamError("the engine sent an error event")
        if self.hide_usage and _usage_only(payload):
            usage = answer_usage(payload, is_json)  # checked and read in one decode
            if usage is None:
                raise EngineStreamError("the engine sent an event that is not JSON")
            prompt, completion = usage
            before = self._usage_before  # summed over segments as _merge_usage does
            self.hidden_usage = (max(0, prompt - before), completion + before)
            return None
        if not is_json(payload):
            raise EngineStreamError("the engine sent an event that is not JSON")
        if self.segment == 0:
            self.sent.append(event)
            if payload.find(b'"finish_reason":"') >= 0 or payload.find(b'"finish_reason": "') >= 0:
                self._finished = True
            return event + b"\n\n"
        return self._rewrite(payload)

    def error_event(self, message: str) -> bytes:
        """How a stream that cannot go on ends: an OpenAI-style error event, then [DONE]."""
        return sse_error(message)

    def analyse(self) -> None:
        """Decode what was sent: the text so far, its id, and whether it can be continued."""
        text: list[str] = []
        why_not = None
        chunks = 0
        for payload in _payloads(self.sent):
            try:
                chunk = _chunk.decode(payload)
            except msgspec.DecodeError:
                continue
            if not self.response_id and chunk.id:
                self.response_id, self.created = chunk.id, chunk.created
            for choice in chunk.choices:
                piece = choice.text if self.kind == "completion" else (
                    choice.delta.content if choice.delta else None
                )
                if piece:
                    text.append(piece)
                    chunks += 1
                if choice.delta is not None and choice.delta.tool_calls:
                    # Half a tool call's arguments cannot be continued faithfully.
                    why_not = "a tool call was being streamed"
                if choice.finish_reason:
                    self._finished = True
        self.text = "".join(text)
        self.content_chunks = chunks
        why_not = why_not or self._unresumable(bool(self.text))
        if self.resumable and why_not:
            self.resumable, self.why_not = False, f" ({why_not})"

    def _rewrite(self, payload: bytes) -> bytes | None:
        try:
            chunk = _chunk.decode(payload)
        except msgspec.DecodeError:
            return None
        carries = False
        for choice in chunk.choices:
            piece = choice.text if self.kind == "completion" else (
                choice.delta.content if choice.delta else None
            )
            if piece or choice.finish_reason:
                carries = True
            if choice.finish_reason:
                self._finished = True
        if chunk.choices and not carries:
            return None  # the new engine's opening role chunk (or an empty delta): already sent
        data = msgspec.json.decode(payload)
        data["id"] = self.response_id or data.get("id")
        if self.created:
            data["created"] = self.created
        usage = data.get("usage")
        if isinstance(usage, dict) and usage:
            data["usage"] = self._merge_usage(usage)
        out = msgspec.json.encode(data)
        self.sent.append(out)
        return b"data: " + out + b"\n\n"

    def _merge_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        # The continuation's prompt held the text already sent, which the first engine
        # generated: count those tokens (about one per streamed chunk) as completion.
        before = self._usage_before
        completion = int(usage.get("completion_tokens") or 0) + before
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - before)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def start_segment(self) -> None:
        """The stream goes on elsewhere: events from now on are rewritten to fit the first ones."""
        self.segment += 1
        self._usage_before = self.content_chunks

    def final_length_chunk(self) -> bytes:
        """A closing chunk for a stream that already used all its max_tokens."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if self.kind == "chat":
            choice["delta"] = {}
            obj = "chat.completion.chunk"
        else:
            choice["text"] = ""
            obj = "text_completion"
        body = {"id": self.response_id, "object": obj, "created": self.created, "choices": [choice]}
        return b"data: " + msgspec.json.encode(body) + b"\n\n" + DONE


class Continuation:
    """The request that continues a broken stream from `text`, for whichever engine takes over."""

    def __init__(self, request: dict[str, Any], kind: str, text: str, first_continued: bool) -> None:
        self.request = request
        self.kind = kind
        self.text = text
        # Whether the first engine read a trailing assistant message of the client's as the
        # start of its answer (it continues one by itself, or the client asked it to with
        # `continue_final_message`).
        self.first_continued = first_continued

    def body(self, continues_trailing_assistant: bool) -> bytes:
        """The body for an engine that continues a trailing assistant message by itself, or not
        (then it needs `continue_final_message`, else it starts a new reply after the text)."""
        d = dict(self.request)
        if not self.text:
            return msgspec.json.encode(d)
        if self.kind == "completion":
            d["prompt"] = d["prompt"] + self.text
            return msgspec.json.encode(d)
        messages = list(d["messages"])
        if (self.first_continued or d.get("continue_final_message")) and messages[-1].get("role") == "assistant":
            last = dict(messages[-1])
            last["content"] = (last.get("content") or "") + self.text
            messages[-1] = last
        else:
            messages.append({"role": "assistant", "content": self.text})
        d["messages"] = messages
        if not continues_trailing_assistant:
            d["continue_final_message"] = True
            d["add_generation_prompt"] = False
        return msgspec.json.encode(d)


def continuation(
    body: bytes, kind: str, text: str, tokens_sent: int, first_continues: bool,
) -> Continuation | None:
    """How to continue `text` elsewhere (`first_continues`: the engine that broke continues a
    trailing assistant message by itself); None when nothing is left to generate."""
    d = msgspec.json.decode(body)
    for key in ("max_completion_tokens", "max_tokens"):
        if d.get(key):
            left = int(d[key]) - tokens_sent
            if left <= 0:
                return None
            d[key] = left
    return Continuation(d, kind, text, first_continues)
