"""A closed connection leaves no garbage for the cycle collector.

The gateway raises the collector's thresholds (gateway/front/gctune.py), so objects kept alive
only by reference cycles wait long for a full collection. A client that opens a connection
per request (no keep-alive pool) would otherwise leave a protocol, its request cycle or
exchange, transport wrapper and flow control behind each time. Here the gateway runs in
this process under the collector switched off: after each connection closes, its protocol
must be freed by reference counting alone. Real uvicorn, real Redis, real sockets.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import weakref
from collections.abc import Iterator

import pytest
import uvicorn

from fleetgate.net import free_port
from gateway.app import create_asgi
from gateway.front.fastpath import FastPath
from gateway.front.hooks import Hooks
from gateway.front.server import GatewayHttpProtocol
from gateway.settings_check import load_checked
from tests.conftest import wait_until


@pytest.fixture
def served(redis_url: str, prefix: str) -> Iterator[tuple[int, list[weakref.ref[GatewayHttpProtocol]]]]:
    port = free_port()
    settings = load_checked(None, {"port": port, "redis_url": redis_url, "redis_prefix": prefix})
    asgi = create_asgi(settings)
    assert isinstance(asgi, FastPath)
    made: list[weakref.ref[GatewayHttpProtocol]] = []

    def protocol(*args: object, **kwargs: object) -> GatewayHttpProtocol:
        proto = GatewayHttpProtocol(*args, fast=asgi, **kwargs)  # type: ignore[arg-type]
        # The parser and the transport's reads go to the compiled hooks (gateway/front/hooks.py),
        # which hold the protocol: connection_lost must let go of it for this test to pass.
        assert proto.hooks is not None and proto.parser is proto.hooks.parser
        assert proto.data_received.__self__ is proto.hooks  # type: ignore[attr-defined]
        made.append(weakref.ref(proto))
        return proto

    config = uvicorn.Config(asgi, host="127.0.0.1", port=port, log_config=None, access_log=False,
                            server_header=False, http=protocol)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30)
    try:
        yield port, made
    finally:
        server.should_exit = True
        thread.join(30)


def _closed_hooks() -> list[Hooks]:
    return [o for o in gc.get_objects() if type(o) is Hooks and o.protocol is None]


def _one(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        return answer


def test_a_closed_connection_is_freed_without_the_cycle_collector(
        served: tuple[int, list[weakref.ref[GatewayHttpProtocol]]]) -> None:
    port, made = served
    body = b'{"model": "nobody-serves-this", "prompt": "hi"}'
    proxied = (b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%b" % (len(body), body))
    asgi = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            assert _one(port, proxied).startswith(b"HTTP/1.1 404 ")  # an Exchange, answered by the gateway
            assert _one(port, asgi).startswith(b"HTTP/1.1 ")  # a uvicorn request cycle for the ASGI app
        try:
            wait_until(lambda: sum(r() is not None for r in made) == 0, timeout=5)
        except AssertionError:
            alive = sum(r() is not None for r in made)
            pytest.fail(f"{alive} of {len(made)} closed connections' protocols are still alive without the collector")
        try:
            # The compiled hooks take no weak references: look for a closed connection's among the
            # objects the collector tracks (its parser holds its callbacks, and it holds the parser).
            wait_until(lambda: not _closed_hooks(), timeout=5)
        except AssertionError:
            pytest.fail(f"{len(_closed_hooks())} closed connections' parser hooks are still alive without the collector")
    finally:
        gc.enable()
    assert len(made) >= 20

