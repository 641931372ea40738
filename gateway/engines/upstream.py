"""The gateway's one HTTP client to the engines, and the translation of its failures.

The connections themselves are gateway/engines/engine_conn.py's (keep-alive HTTP/1.1 over
httptools' parser, pooled per engine). This is the only module that talks to engines: the
request path (`post`, `body_of`), a stored response's retrieve or cancel (`call`), and the
control plane's JSON requests (`post_json`: a circuit's probe, an adapter's load or unload);
and the only place their connection errors and timeouts become the gateway's error tree
(`UpstreamError`, `UpstreamTimeout`).
"""

from __future__ import annotations

from collections.abc import Collection, Coroutine, Mapping
from typing import Any

import msgspec

from gateway.engines.engine_conn import Pool, Response, Target
from gateway.engines.patience import Patience
from gateway.errors import EngineUnreachable, UpstreamError, UpstreamTimeout
from gateway.wire import EngineError, NestedError

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})

__all__ = ["RETRYABLE_STATUS", "Patience", "Response", "Upstream", "is_json", "json_object", "openai_error_body", "sse_error"]

_JSON = {"content-type": "application/json"}
# Validates JSON without building it (msgspec skips a Raw value's contents, checking them).
_raw = msgspec.json.Decoder(msgspec.Raw)


def json_object(data: bytes) -> bool:
    """Whether `data` is one whole JSON object, as every engine's 200 answer is."""
    return data.lstrip()[:1] == b"{" and is_json(data)


def is_json(data: bytes) -> bool:
    """Whether an engine's bytes are one whole JSON value (checked, not built): a whole answer's
    body, or a stream event's data."""
    try:
        _raw.decode(data)
    except msgspec.DecodeError:
        return False
    return True


def header_lines(headers: Collection[tuple[str, str]]) -> str:
    """`name: value` lines; a value holding CR or LF (it would split the head) is left out."""
    text = "".join([f"{k}: {v}\r\n" for k, v in headers])
    n = len(headers)
    if text.count("\n") == n and text.count("\r") == n:  # the usual case: no value holds either
        return text
    return "".join([f"{k}: {v}\r\n" for k, v in headers if "\n" not in v and "\r" not in v])


class Upstream:
    def __init__(self, connect_timeout_s: float) -> None:
        self._connect = connect_timeout_s
        self._targets: dict[str, Target] = {}
        self._pool: Pool | None = None

    async def start(self) -> None:
        self._pool = Pool(self._connect)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _target(self, url: str) -> Target:
        target = self._targets.get(url)
        if target is None:  # parsing a URL costs more than the rest of the call's setup
            target = Target(url)
            if len(self._targets) < 4096:
                self._targets[url] = target
        return target

    @staticmethod
    def _head(method: bytes, target: Target, headers: Mapping[str, str], length: int) -> bytes:
        # Values come from the gateway or from the client's already-parsed headers; a CR or LF
        # would split the head, so a value holding one is left out.
        lines = header_lines(headers.items())
        return b"".join((method, target.prefix, lines.encode("latin-1"), b"content-length: ",
                         str(length).encode(), b"\r\n\r\n"))

    def post(
        self, url: str, body: bytes, headers: Mapping[str, str], stream: bool, first_byte_s: float,
        patience: Patience | None = None,
    ) -> Coroutine[Any, Any, Response]:
        """Send a request and return once the engine's response status and headers arrived:
        a stream within `first_byte_s` of sending (an engine hung before answering holds no
        byte of the client's, so the request can go elsewhere); a whole answer may take
        `first_byte_s` (at least 1 s) for its head and for each wait for more of its body.
        `patience`: the head's wait is cut sooner unless it says the engine is busy.
        The sending coroutine itself, with none around it (one coroutine less on every request)."""
        target = self._target(url)
        head = self._head(b"POST", target, headers, len(body))
        limit = first_byte_s if stream else max(float(round(first_byte_s)), 1.0)
        return self._send(url, target, head, body, limit, None if stream else limit, patience)

    async def _send(self, url: str, target: Target, head: bytes, body: bytes, limit: float,
                    read_timeout: float | None, patience: Patience | None = None) -> Response:
        assert self._pool is not None
        pool = self._pool
        fresh = False
        while True:
            conn = None if fresh else pool.take(target)
            reused = conn is not None
            try:
                if conn is None:
                    conn = await pool.connect(target)
                resp = conn.write_request(head, body)
                resp.timeout = read_timeout
                await resp.head(limit, patience)
                return resp
            except TimeoutError as exc:  # before OSError, its base class: a timeout is never sent again
                if conn is not None:
                    conn.abort()
                if patience is not None and patience.cut:
                    raise UpstreamTimeout("The engine did not answer in time.",
                                          detail="no whole answer in time, and its engine reports no queue") from exc
                raise _unreachable(url, exc) from exc
            except (ConnectionError, OSError) as exc:
                if conn is not None:
                    conn.abort()
                if reused and conn is not None and not conn.got_bytes:
                    # A keep-alive connection the engine closed as the request went out: the
                    # engine saw none of it, so it goes again, once, on a new connection.
                    fresh = True
                    continue
                raise _unreachable(url, exc) from exc
            except BaseException:  # cancelled: the client hung up; closing aborts the engine's request
                if conn is not None:
                    conn.abort()
                raise

    async def call(self, method: str, url: str, timeout_s: float) -> tuple[int, str, bytes]:
        """A small request with no body (a retrieve, a cancel): status, content type, whole answer."""
        target = self._target(url)
        head = self._head(method.upper().encode(), target, {}, 0)
        resp = await self._send(url, target, head, b"", timeout_s, timeout_s)
        return resp.status, resp.content_type, await self.body_of(resp)

    async def post_json(self, url: str, body: Mapping[str, object], timeout_s: float) -> tuple[int, bytes]:
        """A control-plane request (a circuit's probe, an adapter's load or unload): a JSON body,
        its status and whole answer, each within `timeout_s`; on the request path's connections."""
        resp = await self.post(url, msgspec.json.encode(body), _JSON, False, timeout_s)
        return resp.status, await self.body_of(resp)

    async def body_of(self, resp: Response) -> bytes:
        """A whole answer's body; its connection goes back (or closes) either way."""
        try:
            return await self.read(resp)
        finally:
            resp.release()

    @staticmethod
    async def read(resp: Response) -> bytes:
        try:
            return await resp.read(resp.timeout)
        except TimeoutError as exc:  # before OSError, its base class
            raise UpstreamTimeout("engine stopped answering mid-response") from exc
        except (ConnectionError, OSError) as exc:
            raise UpstreamError(f"engine connection broke: {type(exc).__name__}") from exc


def _unreachable(url: str, exc: BaseException) -> UpstreamError:
    """A failure to reach an engine, as the gateway's error: the client's message names no
    address, the detail (the log's, the operator's) does."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout("The engine did not answer in time.",
                               detail=f"engine at {url} did not answer in time")
    return EngineUnreachable(f"The engine is unreachable ({type(exc).__name__}).",
                             detail=f"engine at {url} is unreachable: {type(exc).__name__}")


def openai_error_body(status: int, data: bytes) -> bytes:
    """An engine's error answer in OpenAI's nested shape.

    vLLM already answers that way; LMDeploy and ms-swift answer flat
    (`{"message", "type", "code", "object": "error"}`), FastAPI with `{"detail"}`.
    """
    try:
        parsed = msgspec.json.decode(data, type=EngineError)
    except msgspec.DecodeError:
        text = data.decode(errors="replace").strip()[:500]
        return _encode(text or f"engine answered {status}", status, None)
    if isinstance(parsed.error, NestedError):  # all four fields, as the gateway's own errors have them
        nested = parsed.error
        if nested.type and nested.message and _complete(data):
            return data
        return _encode(nested.message or f"engine answered {status}", status, nested.param, nested.type,
                       status if nested.code is None else nested.code)
    if isinstance(parsed.error, str):
        return _encode(parsed.error, status, parsed.param)
    if parsed.message:
        return _encode(parsed.message, status, parsed.param, parsed.type)
    if parsed.detail is not None:
        return _encode(str(parsed.detail), status, None)
    return _encode(f"engine answered {status}", status, None)


def _encode(message: str, status: int, param: str | None, type_: str | None = None,
            code: int | str | None = None) -> bytes:
    kind = type_ or ("invalid_request_error" if 400 <= status < 500 else "upstream_error")
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": status if code is None else code}}
    )


def _complete(data: bytes) -> bool:
    """Whether an engine's nested error has all four fields (vLLM's do): relayed as it is."""
    error = msgspec.json.decode(data).get("error")
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


def sse_error(message: str, code: str = "stream_interrupted") -> bytes:
    """An OpenAI-style error event followed by [DONE]: how a stream that cannot go on ends."""
    payload = msgspec.json.encode(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    )
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
