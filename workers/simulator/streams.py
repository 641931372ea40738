"""Answering a chat or completion request: one JSON body, or server-sent events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web

from workers.simulator.config import Faults
from workers.simulator.flavors import Flavor
from workers.simulator.requests import Prepared
from workers.simulator.seqs import Event, Seq
from workers.simulator.shapes import Shape


async def _outputs(seqs: Sequence[Seq]) -> AsyncIterator[Event]:
    """The events of one request's sequences (one queue they share), until each finished."""
    left = len(seqs)
    while left:
        event = await seqs[0].events.get()
        left -= event.finish is not None
        yield event


async def respond_json(flavor: Flavor, prep: Prepared, seqs: Sequence[Seq]) -> web.Response:
    parts: list[list[str]] = [[] for _ in seqs]
    finishes: list[str | None] = [None] * len(seqs)
    async for event in _outputs(seqs):
        parts[event.index].append(event.text)
        finishes[event.index] = event.finish or finishes[event.index]
    call = prep.tool_call
    outputs = [(call.text(len(p)) if call else "".join(p), f) for p, f in zip(parts, finishes, strict=True)]
    body = Shape(flavor, prep).whole(outputs, seqs)
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
    seqs: Sequence[Seq],
    faults: Faults,
    abort: Callable[[Seq], None],
) -> web.StreamResponse:
    """Chunks of the choices interleaved as their tokens come, each with its index and its
    own finish chunk; then one usage chunk if asked, then [DONE]."""
    shape = Shape(flavor, prep)

    def stall() -> None:
        for seq in seqs:
            abort(seq)

    if faults.hang_before_headers:
        stall()
        await _hang()
    out = await EventStream.open(request, faults, stall, "text/event-stream")

    async def send(data: dict[str, Any] | None) -> None:
        payload = (
            b"data: [DONE]\n\n" if data is None else b"data: " + msgspec.json.encode(data) + b"\n\n"
        )
        await out.write(payload)

    first = True
    call, sent = prep.tool_call, [0] * len(seqs)
    async for event in _outputs(seqs):
        if first and shape.chat:
            # vLLM sends every choice's role chunk with the first output, not before the
            # prefill.
            for index in range(len(seqs)):
                await send(shape.role_chunk(index))
        first = False
        if call is not None:
            piece = call.pieces[sent[event.index]] if sent[event.index] < len(call.pieces) else ""
            await send(shape.tool_chunk(event.index, piece, sent[event.index] == 0, event.finish))
            sent[event.index] += 1
            continue
        await send(shape.chunk(event.index, event.text, event.finish))
    if prep.include_usage:
        await send(shape.usage_chunk(seqs))
    await send(None)
    return await out.close()


async def _hang() -> None:
    """Hold the connection open, sending nothing, until the client gives up."""
    await asyncio.Event().wait()
