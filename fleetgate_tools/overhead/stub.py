"""A fast OpenAI-compatible stub engine: `python -m fleetgate_tools.overhead.stub --port 9001`.

A raw asyncio protocol on uvloop with httptools' parser: no web framework, responses
pre-encoded at start-up, so one stub answers tens of thousands of requests a second
on one core and the benchmark measures the proxy, not the engine.

- `POST /v1/chat/completions`, `POST /v1/completions`: the answer after `--delay`
  seconds; with `"stream": true`, `max_tokens` chunks (default `--chunks`), one
  every `--chunk-delay` seconds, then `[DONE]`. A request may override both delays
  with the non-standard body fields `stub_delay_ms` and `stub_chunk_delay_ms`
  (proxies forward the body untouched, so one pair of stubs serves every run). Like
  vLLM, a stream with `"stream_options": {"include_usage": true}` (the gateway asks
  for it on every stream, to count tokens) ends with a usage chunk (`"choices": []`).
- `GET /health`, `GET /v1/models`, `GET /metrics` (vLLM's gauge names, all zero).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass

import httptools
import msgspec

DEFAULT_CHUNKS = 64
MAX_CHUNKS = 4096


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Body(msgspec.Struct):
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = None
    stub_delay_ms: float | None = None
    stub_chunk_delay_ms: float | None = None


_decode_body = msgspec.json.Decoder(_Body).decode

_METRICS = b"".join(
    b"# TYPE %s gauge\n%s{model_name=\"stub\"} 0\n" % (name, name)
    for name in (
        b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc",
    )
) + b"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{model_name=\"stub\"} 0\n"


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass(frozen=True)
class StubConfig:
    model: str = "stub"
    delay_s: float = 0.0
    chunks: int = DEFAULT_CHUNKS
    chunk_delay_s: float = 0.0
    max_model_len: int = 32768


class Answers:
    """Every response the stub sends, encoded once."""

    def __init__(self, cfg: StubConfig) -> None:
        m = cfg.model
        usage = {"prompt_tokens": 16, "completion_tokens": cfg.chunks, "total_tokens": 16 + cfg.chunks}
        chat = {
            "id": "chatcmpl-stub", "object": "chat.completion", "created": 1700000000, "model": m,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from the stub."},
                         "finish_reason": "stop"}],
            "usage": usage,
        }
        text = {
            "id": "cmpl-stub", "object": "text_completion", "created": 1700000000, "model": m,
            "choices": [{"index": 0, "text": "Hello from the stub.", "finish_reason": "stop"}],
            "usage": usage,
        }
        json_t = b"application/json"
        self.chat = _response(b"200 OK", json_t, msgspec.json.encode(chat))
        self.text = _response(b"200 OK", json_t, msgspec.json.encode(text))
        self.health = _response(b"200 OK", b"text/plain", b"")
        self.metrics = _response(b"200 OK", b"text/plain; version=0.0.4", _METRICS)
        models = {"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "stub", "max_model_len": cfg.max_model_len},
        ]}
        self.models = _response(b"200 OK", json_t, msgspec.json.encode(models))
        self.not_found = _response(b"404 Not Found", json_t, b'{"error":{"message":"not found"}}')
        self.bad = _response(b"400 Bad Request", json_t, b'{"error":{"message":"bad request"}}')
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self.stream_end = _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        # vLLM's include_usage chunk (its completion_tokens: the default chunk count).
        self.chat_usage = _chunked(b"data: " + msgspec.json.encode({
            "id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1700000000, "model": m,
            "choices": [], "usage": usage}) + b"\n\n")
        self.text_usage = _chunked(b"data: " + msgspec.json.encode({
            "id": "cmpl-stub", "object": "text_completion", "created": 1700000000, "model": m,
            "choices": [], "usage": usage}) + b"\n\n")
        # Raw events (for stamped streams) and their chunked frames (for the fast path).
        self.chat_events = self._events(m, "chat")
        self.text_events = self._events(m, "text")
        self.chat_chunks = tuple(map(_chunked, self.chat_events))
        self.text_chunks = tuple(map(_chunked, self.text_events))

    @staticmethod
    def _events(model: str, kind: str) -> tuple[bytes, bytes, bytes]:
        """(first, middle, last) SSE events; a stream is first, middle x (n-2), last."""
        def event(piece: str, finish: str | None, role: bool = False) -> bytes:
            if kind == "chat":
                delta: dict[str, str] = {"role": "assistant", "content": piece} if role else {"content": piece}
                choice: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish}
                obj = "text_completion"
            data = {"id": "chatcmpl-stub", "object": obj, "created": 1700000000, "model": model,
                    "choices": [choice]}
            return b"data: " + msgspec.json.encode(data) + b"\n\n"

        return event("Hello", None, role=True), event(" tok", None), event(".", "stop")


class _Conn(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    __slots__ = ("answers", "body", "cfg", "closed", "loop", "parser", "transport", "url")

    def __init__(self, cfg: StubConfig, answers: Answers) -> None:
        self.cfg = cfg
        self.answers = answers
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:  # uvloop sets TCP_NODELAY itself; asyncio does too since 3.7
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(self.answers.bad)
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        assert transport is not None
        a = self.answers
        path = self.url.split(b"?", 1)[0]
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            self._complete(path == b"/v1/chat/completions")
            return
        out = {b"/health": a.health, b"/v1/models": a.models, b"/metrics": a.metrics}.get(path, a.not_found)
        transport.write(out)
        if not self.parser.should_keep_alive():
            transport.close()

    def _complete(self, chat: bool) -> None:
        assert self.transport is not None
        try:
            req = _decode_body(b"".join(self.body))
        except msgspec.DecodeError:
            self.transport.write(self.answers.bad)
            return
        cfg = self.cfg
        delay = cfg.delay_s if req.stub_delay_ms is None else req.stub_delay_ms / 1000
        keep = self.parser.should_keep_alive()
        if req.stream:
            chunk_delay = cfg.chunk_delay_s if req.stub_chunk_delay_ms is None else req.stub_chunk_delay_ms / 1000
            n = min(max(req.max_tokens or cfg.chunks, 2), MAX_CHUNKS)
            usage = req.stream_options is not None and req.stream_options.include_usage
            self.loop.create_task(self._stream(chat, n, delay, chunk_delay, keep, usage))
            return
        out = self.answers.chat if chat else self.answers.text
        if delay > 0:
            self.loop.call_later(delay, self._write_later, out, keep)
        else:
            self._write_later(out, keep)

    def _write_later(self, out: bytes, keep: bool) -> None:
        if self.closed or self.transport is None:
            return
        self.transport.write(out)
        if not keep:
            self.transport.close()

    async def _stream(self, chat: bool, n: int, delay: float, chunk_delay: float, keep: bool, usage: bool) -> None:
        transport = self.transport
        assert transport is not None
        a = self.answers
        if delay > 0:
            await asyncio.sleep(delay)
        transport.write(a.stream_head)
        if chunk_delay > 0:
            await self._paced(a.chat_events if chat else a.text_events, n, chunk_delay)
        else:
            self._at_once(a.chat_chunks if chat else a.text_chunks, n)
        if not self.closed:
            if usage:
                transport.write(a.chat_usage if chat else a.text_usage)
            transport.write(a.stream_end)
            if not keep:
                transport.close()

    async def _paced(self, events: tuple[bytes, bytes, bytes], n: int, chunk_delay: float) -> None:
        """Chunks `chunk_delay` apart, each carrying its send time (CLOCK_MONOTONIC, shared by
        every process on the host), so a client measures each chunk's transit, free of the
        pacing's jitter."""
        assert self.transport is not None
        write = self.transport.write
        for i in range(n):
            if i:
                await asyncio.sleep(chunk_delay)
            if self.closed:
                return
            event = events[0] if i == 0 else events[2] if i == n - 1 else events[1]
            write(_chunked(b'data: {"stub_sent":%.6f,%s' % (time.monotonic(), event[7:])))

    def _at_once(self, chunks: tuple[bytes, ...], n: int) -> None:
        """One write per chunk, as an engine emits them (separate segments under TCP_NODELAY)."""
        assert self.transport is not None
        write = self.transport.write
        first, middle, last = chunks
        for i in range(n):
            if self.closed:
                return
            write(first if i == 0 else last if i == n - 1 else middle)


async def serve(cfg: StubConfig, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    answers = Answers(cfg)
    server = await loop.create_server(lambda: _Conn(cfg, answers), host, port, backlog=2048, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fleetgate_tools.overhead.stub", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stub")
    p.add_argument("--delay", type=float, default=0.0, help="seconds before an answer (or first chunk)")
    p.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS, help="chunks per stream without max_tokens")
    p.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between streamed chunks")
    p.add_argument("--max-model-len", type=int, default=32768)
    args = p.parse_args(argv)
    cfg = StubConfig(args.model, args.delay, args.chunks, args.chunk_delay, args.max_model_len)
    try:
        import uvloop

        uvloop.run(serve(cfg, args.host, args.port))
    except ImportError:
        asyncio.run(serve(cfg, args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
