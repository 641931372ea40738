"""Mid-stream failover: follow an SSE stream closely enough to continue it on another worker.

`StreamTracker` reads every event the client is sent (decoding only the fields it
needs) and remembers the text so far, the response id and whether the request can
be resumed faithfully. When the engine dies or stalls, `continuation_body` builds the
request that makes another engine carry on from that text, and the tracker rewrites
the new engine's events so the client sees one stream: the same id, no repeated
role chunk, one finish_reason, usage summed.
"""

from __future__ import annotations

from typing import Any

import msgspec

DONE = b"data: [DONE]\n\n"

# Engines that continue a trailing assistant message by themselves (no vLLM flags).
_CONTINUES_TRAILING_ASSISTANT = ("lmdeploy", "swift")


class _Delta(msgspec.Struct):
    content: str | None = None
    role: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None


_chunk = msgspec.json.Decoder(_Chunk)


def resumable_request(body: bytes, kind: str) -> bool:
    """Whether a stream of this request can be continued elsewhere without changing its meaning."""
    try:
        d = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    if not isinstance(d, dict):
        return False
    if (d.get("n") or 1) != 1 or (d.get("best_of") or 1) != 1:
        return False
    if d.get("logprobs") or d.get("top_logprobs") or d.get("echo"):
        return False
    if kind == "completion" and not isinstance(d.get("prompt"), str):
        return False
    return True


class StreamTracker:
    def __init__(self, kind: str, resumable: bool) -> None:
        self.kind = kind
        self.resumable = resumable
        self.text: list[str] = []
        self.content_chunks = 0
        self.response_id = ""
        self.created = 0
        self.finished = False
        self.done = False
        self.segment = 0
        self._usage_before: dict[str, int] = {}

    @property
    def sent_text(self) -> str:
        return "".join(self.text)

    def on_event(self, event: bytes) -> bytes | None:
        """The bytes to send the client for one SSE event (None: drop it)."""
        if not event.startswith(b"data:"):
            return event + b"\n\n" if self.segment == 0 else None
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return DONE
        try:
            chunk = _chunk.decode(payload)
        except msgspec.DecodeError:
            return event + b"\n\n"
        if self.segment == 0:
            if not self.response_id:
                self.response_id, self.created = chunk.id, chunk.created
            self._follow(chunk)
            return event + b"\n\n"
        return self._rewrite(payload, chunk)

    def _follow(self, chunk: _Chunk) -> bool:
        """Record what the client got; True if this chunk carries new text or a finish."""
        carries = False
        for choice in chunk.choices:
            piece = choice.text if self.kind == "completion" else (
                choice.delta.content if choice.delta else None
            )
            if piece:
                self.text.append(piece)
                self.content_chunks += 1
                carries = True
            if choice.delta is not None and choice.delta.tool_calls:
                # Half a tool call's arguments cannot be continued faithfully.
                self.resumable = False
            if choice.finish_reason:
                self.finished = True
                carries = True
        return carries

    def _rewrite(self, payload: bytes, chunk: _Chunk) -> bytes | None:
        carries = self._follow(chunk)
        if chunk.choices and not carries:
            return None  # the new engine's opening role chunk (or an empty delta): already sent
        data = msgspec.json.decode(payload)
        data["id"] = self.response_id or data.get("id")
        if self.created:
            data["created"] = self.created
        usage = data.get("usage")
        if isinstance(usage, dict) and usage:
            data["usage"] = self._merge_usage(usage)
        return b"data: " + msgspec.json.encode(data) + b"\n\n"

    def _merge_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        # The continuation's prompt held the text already sent, which the first engine
        # generated: count those tokens (about one per streamed chunk) as completion.
        before = self._usage_before.get("completion_tokens", 0)
        completion = int(usage.get("completion_tokens") or 0) + before
        prompt = max(0, int(usage.get("prompt_tokens") or 0) - before)
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def start_segment(self) -> None:
        self.segment += 1
        self._usage_before = {"completion_tokens": self.content_chunks}

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


def continuation_body(body: bytes, kind: str, text: str, tokens_sent: int, engine: str) -> bytes | None:
    """The request that continues `text` on another engine; None when nothing is left to generate."""
    d = msgspec.json.decode(body)
    for key in ("max_completion_tokens", "max_tokens"):
        if d.get(key):
            left = int(d[key]) - tokens_sent
            if left <= 0:
                return None
            d[key] = left
    if not text:
        return msgspec.json.encode(d)
    if kind == "completion":
        d["prompt"] = d["prompt"] + text
        return msgspec.json.encode(d)
    messages = list(d["messages"])
    if d.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
        last = dict(messages[-1])
        last["content"] = (last.get("content") or "") + text
        messages[-1] = last
    else:
        messages.append({"role": "assistant", "content": text})
    d["messages"] = messages
    if not any(name in engine for name in _CONTINUES_TRAILING_ASSISTANT):
        d["continue_final_message"] = True
        d["add_generation_prompt"] = False
    return msgspec.json.encode(d)
