"""Answering a proxied request over plain ASGI: the fast path's other way in (gateway/front/fastpath.py).

The gateway's own connection protocol hands a proxied request to `FastPath.serve_exchange`,
which writes the answer onto the connection itself. A proxied request that reaches the ASGI app
instead (a query string or %-escapes in its path, or another server in front) is answered here,
with the same logic (`front.serve`) through ASGI messages. Not on the measured request path, so
not compiled (scripts/compile.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog

from gateway.errors import GatewayError, InvalidRequest, RequestTooLarge
from gateway.front import front
from gateway.request.reply import Reply
from gateway.request.requests import header_reader, headers_by_name

log = structlog.get_logger("gateway.asgi_answer")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_STALLED = front.STALLED
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]


async def answer(gw: Any, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
    """Answer one proxied request of `kind` through `send`."""
    try:
        reply, hangup = await _serve(gw, scope, receive, kind)
    except front.ClientGone:
        return  # nobody to answer; the engine's request was closed
    except GatewayError as exc:
        await _send_error(send, exc)
        return
    except Exception:
        log.exception("gateway.internal_error", path=scope.get("path"))
        await _send_error(send, GatewayError("Internal error in the gateway."))
        return
    front.answering(scope, reply)
    headers = [(k.encode(), v.encode()) for k, v in reply.headers]
    if reply.stream is None:
        headers += [_JSON, (b"content-length", str(len(reply.body)).encode())]
        try:
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": reply.body})
        finally:
            reply.written()
        return
    await _stream(reply, headers + _SSE, hangup, send, scope)


async def _serve(gw: Any, scope: Scope, receive: Receive, kind: str) -> tuple[Reply, front.Hangup]:
    header = header_reader(headers_by_name(scope["headers"]))
    client = scope.get("client")
    return await front.serve(
        gw, header, client[0] if client else None, lambda: _read_body(receive, gw.settings.max_body_bytes),
        receive, scope["path"], kind,
    )


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("The client went away before sending the whole body.")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge.over(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _stream(reply: Reply, headers: list[tuple[bytes, bytes]], hangup: front.Hangup, send: Send,
                  scope: Scope) -> None:
    """Relay an SSE stream; a client that hangs up cancels it (which closes the engine's request)."""
    assert reply.stream is not None
    stream = reply.stream
    try:
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        hangup.finish()
        await send({"type": "http.response.body", "body": b""})
    except asyncio.CancelledError:
        hangup.finish()
        if hangup.absorb():  # the generator's cleanup closed the engine's request; end quietly
            return
        raise
    finally:
        await hangup.stop()
        if _STALLED in scope:
            await front.tell_stalled(stream)
        await stream.aclose()  # type: ignore[attr-defined]


async def _send_error(send: Send, exc: GatewayError) -> None:
    body = exc.body()
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["answer"]
