"""Reads held while a client reads nothing (issue 35, gateway/front/server.py), on every kind of
connection of the gateway's protocol: the gateway's own, whose parser callbacks are the front's
hooks, and those of an embedder's uvicorn told limit_concurrency, a root path or fresh
contextvars, which run uvicorn's own callbacks and pipeline instead ("hookless").

A client with a small receive window and a small segment size (TCP_MAXSEG, so the gateway's
kernel starts its send buffer small: on loopback it would start at megabytes) asks for one
embedding whose answer (~800 KB) is more than that buffer and the transport's high-water mark
hold, and reads none of it: the gateway's writes pause. A second, small request, pipelined behind the first or sent once the
writes have paused, must not reach the engine while the client still reads nothing; once the
client reads, both answers arrive, in order. Before the fix a hookless connection started the
second request at once (the first answer was complete, only unsent), so its engine served it.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial

import pytest

from fleetgate.net import free_port
from tests.conftest import ADMIN_TOKEN, Fleet, Proc, wait_healthy, wait_until
from tests.e2e.test_send_limit import EMBED, FAST, _answers, _engine, _paused, _post, _refused

# The gateway's protocol inside an embedder's uvicorn (as gateway/__main__.py builds it, less its options).
EMBEDDED = """
import functools, json, sys, uvicorn
from fleetgate.logs import configure_logging
from gateway.app import create_asgi
from gateway.front.front_limits import FrontGuard
from gateway.front.server import GatewayHttpProtocol
from gateway.settings_check import load_checked
port, redis_url, prefix, extra = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
settings = load_checked(None, {"port": port, "redis_url": redis_url, "redis_prefix": prefix, "send_timeout_s": 60})
configure_logging(settings.log_level, settings.log_json)
guard = FrontGuard.from_settings(settings)
asgi = create_asgi(settings, None, guard)
uvicorn.run(asgi, host="127.0.0.1", port=port, log_config=None, access_log=False,
            http=functools.partial(GatewayHttpProtocol, fast=asgi, guard=guard), **extra)
"""
HOOKLESS: dict[str, dict[str, object]] = {
    "limit_concurrency": {"limit_concurrency": 1000}, "root_path": {"root_path": "/gw"},
    "reset_contextvars": {"reset_contextvars": True}}
BIG_INPUTS, SMALL_INPUTS = 300, 3  # ~812 KB of answer, and ~8 KB


def _tiny_window(port: int) -> socket.socket:
    """A client socket with a few KB of receive window and 536-byte segments (both set before
    connecting): one answer of ~800 KB pauses the gateway's writes to it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    return sock


def _embedded_gateway(fleet: Fleet, uvicorn_args: dict[str, object]) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = fleet._spawn(f"embedded-{port}", [sys.executable, "-c", EMBEDDED, str(port), fleet.redis_url, fleet.prefix,
                                             json.dumps(uvicorn_args)], {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    wait_healthy(proc, url)
    return proc, url


def _paused_since(url: str, paused: float) -> bool:
    """The gateway's writes paused (once more) since it counted `paused` pauses."""
    return _paused(url) > paused


def _embedding(request_id: str, inputs: int) -> bytes:
    return _post("/v1/embeddings", request_id, {"model": EMBED, "input": ["hi"] * inputs})


@pytest.mark.parametrize("server", ["gateway", *HOOKLESS])
def test_no_next_request_reaches_the_engine_while_the_client_reads_nothing(
        fleet_factory: Callable[[], Fleet], server: str) -> None:
    """Pipelined, or sent after the writes paused: the second request is neither served by the
    engine while the client reads nothing (3 s), nor lost: once the client reads, both answers
    arrive whole and in order, and nothing is counted against a limit."""
    fleet = fleet_factory()
    if server == "gateway":
        proc, url = fleet.gateway("--set", "send_timeout_s=60")
    else:
        proc, url = _embedded_gateway(fleet, HOOKLESS[server])
    fleet.worker("e1", "--model", EMBED, "--max-model-len", "512", "--option", FAST, "--option", "runner=pooling",
                 "--option", "convert=embed")
    fleet.wait_ready(url, "e1")
    engine_url = str(fleet.workers(url)["e1"]["url"])
    port = int(url.rsplit(":", 1)[1])
    for pipelined in (True, False):
        paused, served = _paused(url), _engine(engine_url, "vllm:request_success_total")
        big, small = f"big-{uuid.uuid4().hex[:6]}", f"small-{uuid.uuid4().hex[:6]}"
        with _tiny_window(port) as sock:
            sock.sendall(_embedding(big, BIG_INPUTS) + (_embedding(small, SMALL_INPUTS) if pipelined else b""))
            wait_until(partial(_paused_since, url, paused), timeout=60, interval=0.1)  # the precondition
            if not pipelined:
                sock.sendall(_embedding(small, SMALL_INPUTS))
            time.sleep(3)  # the engine serves 3 inputs in milliseconds, were it asked
            # (the simulator counts an embedding's inputs as requests, as vLLM does its prompts)
            held = _engine(engine_url, "vllm:request_success_total") - served
            assert held == BIG_INPUTS, (server, pipelined, held)
            answers = _answers(sock, 2)
        assert _engine(engine_url, "vllm:request_success_total") - served == BIG_INPUTS + SMALL_INPUTS
        for request_id, inputs, (head, body) in zip((big, small), (BIG_INPUTS, SMALL_INPUTS), answers, strict=True):
            assert head.startswith(b"HTTP/1.1 200 ") and f"\r\nx-request-id: {request_id}".encode() in head.lower()
            assert len(json.loads(body)["data"]) == inputs
    assert not any(_refused(url).values()), _refused(url)
    assert proc.alive()
