"""Response bodies: OpenAI chat/completion objects, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from workers.simulator.config import Faults
from workers.simulator.flavors import Flavor
from workers.simulator.requests import Prepared
from workers.simulator.scheduler import Seq


def usage(seq: Seq) -> dict[str, Any]:
    return {
        "prompt_tokens": seq.num_prompt,
        "total_tokens": seq.num_prompt + seq.generated,
        "completion_tokens": seq.generated,
        "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
    }


class _Shape:
    """The id, object names and choice layout of one response."""

    def __init__(self, flavor: Flavor, prep: Prepared) -> None:
        self.flavor, self.prep = flavor, prep
        self.chat = prep.kind == "chat"
        self.id = flavor.chat_id() if self.chat else flavor.completion_id()
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.prep.model,
            "choices": choices,
        }

    def chunk(self, text: str, finish: str | None, *, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first or self.flavor.role_in_every_chunk:
                delta = {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self.envelope("chat.completion.chunk", [choice])
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        return self.envelope("text_completion", [choice])

    def whole(self, text: str, finish: str | None, seq: Seq) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text, "tool_calls": []}
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            body = self.envelope("chat.completion", [choice])
        else:
            choice = {
                "index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                "stop_reason": None, "prompt_logprobs": None,
            }  # fmt: skip
            body = self.envelope("text_completion", [choice])
        body["usage"] = usage(seq)
        return body


async def respond_json(flavor: Flavor, prep: Prepared, seq: Seq) -> web.Response:
    parts: list[str] = []
    while True:
        event = await seq.events.get()
        parts.append(event.text)
        if event.finish:
            break
    body = _Shape(flavor, prep).whole("".join(parts), event.finish, seq)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


class EventStream:
    """An open server-sent event stream whose writes obey the stall fault."""

    def __init__(self, resp: web.StreamResponse, faults: Faults, stall: Callable[[], None]) -> None:
        self.resp, self.faults, self.stall = resp, faults, stall
        self.sent = 0

    @classmethod
    async def open(
        cls, request: web.Request, faults: Faults, stall: Callable[[], None], content_type: str
    ) -> EventStream:
        resp = web.StreamResponse(
            headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        return cls(resp, faults, stall)

    async def write(self, payload: bytes) -> None:
        if (
            self.faults.stall_after_chunks is not None
            and self.sent >= self.faults.stall_after_chunks
        ):
            # Like an engine stopping mid-stream: the sequence is gone, the socket stays.
            self.stall()
            await _hang()
        await self.resp.write(payload)
        self.sent += 1

    async def close(self) -> web.StreamResponse:
        await self.resp.write_eof()
        return self.resp


async def respond_stream(
    request: web.Request,
    flavor: Flavor,
    prep: Prepared,
    seq: Seq,
    faults: Faults,
    abort: Callable[[Seq], None],
) -> web.StreamResponse:
    shape = _Shape(flavor, prep)
    out = await EventStream.open(request, faults, lambda: abort(seq), "text/event-stream")

    async def send(data: dict[str, Any] | None) -> None:
        payload = (
            b"data: [DONE]\n\n" if data is None else b"data: " + msgspec.json.encode(data) + b"\n\n"
        )
        await out.write(payload)

    first = True
    while True:
        event = await seq.events.get()
        if first and shape.chat:
            # vLLM sends the role chunk with the first output, not before the prefill.
            await send(shape.chunk("", None, first=True))
        first = False
        await send(shape.chunk(event.text, event.finish))
        if event.finish:
            break
    if prep.include_usage:
        tail = shape.envelope(shape.chunk("", None)["object"], [])
        tail["usage"] = usage(seq)
        await send(tail)
    await send(None)
    return await out.close()


async def _hang() -> None:
    """Hold the connection open, sending nothing, until the client gives up."""
    await asyncio.Event().wait()
