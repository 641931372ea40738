"""The data plane as a raw ASGI app in front of Litestar.

The two proxied routes are the gateway's whole hot path, and Litestar's routing,
signature model, middleware and response objects cost about a third of the CPU of a
proxied request. This app answers POST /v1/chat/completions and /v1/completions
itself, with exactly the logic of the Litestar routes (`Proxy.serve`); everything
else (lifespan, admin, models, metrics, docs) goes to Litestar unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog
from litestar import Litestar

from gateway import front
from gateway.errors import GatewayError, InvalidRequest
from gateway.proxy import Reply
from gateway.requests import KINDS

log = structlog.get_logger("gateway.fastpath")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]


class TooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class FastPath:
    def __init__(self, app: Litestar) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = KINDS.get(scope.get("path", "")) if scope["type"] == "http" else None
        gw = self.app.state.get("gw") if kind is not None and scope["method"] == "POST" else None
        if gw is None:
            await self.app(scope, receive, send)  # type: ignore[arg-type]
            return
        try:
            reply, hangup = await self._serve(gw, scope, receive, kind)  # type: ignore[arg-type]
        except front.ClientGone:
            return  # nobody to answer; the engine's request was closed
        except GatewayError as exc:
            await _send_error(send, exc)
            return
        except Exception:
            log.exception("gateway.internal_error", path=scope.get("path"))
            await _send_error(send, GatewayError("Internal error in the gateway."))
            return
        headers = [(k.encode(), v.encode()) for k, v in reply.headers]
        if reply.stream is None:
            headers += [_JSON, (b"content-length", str(len(reply.body)).encode())]
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": reply.body})
            return
        await _stream(reply, headers + _SSE, hangup, send)

    async def _serve(self, gw: Any, scope: Scope, receive: Receive, kind: str) -> tuple[Reply, front.Hangup]:
        raw = scope["headers"]

        def header(name: str) -> str | None:
            key = name.encode()
            for k, v in raw:
                if k == key:
                    return v.decode("latin-1")
            return None

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
            raise TooLarge(f"The request body is over the gateway's limit of {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _stream(reply: Reply, headers: list[tuple[bytes, bytes]], hangup: front.Hangup, send: Send) -> None:
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
        await stream.aclose()  # type: ignore[attr-defined]


async def _send_error(send: Send, exc: GatewayError) -> None:
    body = exc.body()
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
