"""The data plane's HTTP client: aiohttp, one pooled session for every engine.

httpx costs milliseconds of CPU per proxied request under concurrency (its pool is
scanned on every request); aiohttp's connector costs a fraction of that. This is
the only module that talks to engines on the request path, and the only place
aiohttp's exceptions are translated into the gateway's error tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
import msgspec
from yarl import URL

from gateway.errors import UpstreamError, UpstreamTimeout

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class Upstream:
    def __init__(self, connect_timeout_s: float) -> None:
        self._connect = connect_timeout_s
        # Streams time their reads themselves (first event, then stalls): see proxy._relay;
        # their headers are timed in post().
        self._stream = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=None)
        self._plain: dict[float, aiohttp.ClientTimeout] = {}
        self._urls: dict[str, URL] = {}
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=60, enable_cleanup_closed=True,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _plain_timeout(self, first_byte_s: float) -> aiohttp.ClientTimeout:
        # A handful of distinct values (rounded), so these are built once and reused.
        key = float(round(first_byte_s))
        timeout = self._plain.get(key)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect, sock_read=max(key, 1.0))
            if len(self._plain) < 256:
                self._plain[key] = timeout
        return timeout

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], stream: bool, first_byte_s: float,
    ) -> aiohttp.ClientResponse:
        """Send a request and return once the engine's response headers arrived."""
        assert self.session is not None
        parsed = self._urls.get(url)
        if parsed is None:  # parsing a URL costs more than the rest of the call's setup
            parsed = URL(url)
            if len(self._urls) < 4096:
                self._urls[url] = parsed
        try:
            if stream:
                # A stream's response headers within the first-byte limit too: an engine hung
                # before answering holds no byte of the client's, so the request goes elsewhere.
                async with asyncio.timeout(first_byte_s):
                    return await self.session.post(parsed, data=body, headers=headers, timeout=self._stream)
            return await self.session.post(parsed, data=body, headers=headers,
                                           timeout=self._plain_timeout(first_byte_s))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _unreachable(url, exc) from exc

    async def call(self, method: str, url: str, timeout_s: float) -> tuple[int, str, bytes]:
        """A small request with no body (a retrieve, a cancel): status, content type, whole answer."""
        assert self.session is not None
        try:
            async with self.session.request(method, url, timeout=self._plain_timeout(timeout_s)) as resp:
                return resp.status, resp.content_type, await self.read(resp)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _unreachable(url, exc) from exc

    @staticmethod
    async def read(resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout("engine stopped answering mid-response") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"engine connection broke: {type(exc).__name__}") from exc


def _unreachable(url: str, exc: BaseException) -> UpstreamError:
    """aiohttp's failure to reach an engine, as the gateway's error."""
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeout(f"engine at {url} did not answer in time")
    return UpstreamError(f"engine at {url} is unreachable: {type(exc).__name__}")


class _Flat(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: int | str | None = None


class _Nested(msgspec.Struct):
    error: _Flat | str | None = None
    detail: str | list[object] | None = None
    message: str | None = None
    type: str | None = None
    param: str | None = None
    code: int | str | None = None


def openai_error_body(status: int, data: bytes) -> bytes:
    """An engine's error answer in OpenAI's nested shape.

    vLLM already answers that way; LMDeploy and ms-swift answer flat
    (`{"message", "type", "code", "object": "error"}`), FastAPI with `{"detail"}`.
    """
    try:
        parsed = msgspec.json.decode(data, type=_Nested)
    except msgspec.DecodeError:
        text = data.decode(errors="replace").strip()[:500]
        return _encode(text or f"engine answered {status}", status, None)
    if isinstance(parsed.error, _Flat):
        return data
    if isinstance(parsed.error, str):
        return _encode(parsed.error, status, parsed.param)
    if parsed.message:
        return _encode(parsed.message, status, parsed.param, parsed.type)
    if parsed.detail is not None:
        return _encode(str(parsed.detail), status, None)
    return _encode(f"engine answered {status}", status, None)


def _encode(message: str, status: int, param: str | None, type_: str | None = None) -> bytes:
    kind = type_ or ("invalid_request_error" if 400 <= status < 500 else "upstream_error")
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def sse_error(message: str, code: str = "stream_interrupted") -> bytes:
    """An OpenAI-style error event followed by [DONE]: how a stream that cannot go on ends."""
    payload = msgspec.json.encode(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    )
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
