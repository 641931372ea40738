"""The uvicorn internals the gateway's front connection relies on (gateway/front/server.py,
gateway/front/hooks.py, gateway/front/fastpath.py), named one by one, and the httptools behaviour its
limits on a head rely on (gateway/front/front_limits.py).

uvicorn and httptools are pinned to the tested minor versions in pyproject.toml; a release
that renames, drops or reshapes one of these fails here, loudly, rather than in production.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import httptools
import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway.front.server import GatewayHttpProtocol, _Coalescing

# The versions every test ran with; pyproject.toml admits only these minors.
TESTED = {"uvicorn": "0.54.", "httptools": "0.9."}

# Methods of HttpToolsProtocol that GatewayHttpProtocol overrides or calls, with their parameters.
METHODS = {
    "__init__": ["self", "config", "server_state", "app_state", "_loop"],
    "_start_asgi_task": ["self", "cycle", "app"],
    "_unset_keepalive_if_required": ["self"],
    "timeout_keep_alive_handler": ["self"],
    "on_response_complete": ["self"],
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "send_400_response": ["self", "msg"],
    "_should_upgrade": ["self"],
    "handle_websocket_upgrade": ["self"],
    "_unsupported_upgrade_warning": ["self"],
    "data_received": ["self", "data"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
}
# Attributes of a connected protocol that the hooks and the exchange read or replace.
PROTOCOL_ATTRIBUTES = (
    "cycle", "pipeline", "flow", "timeout_keep_alive_task", "timeout_keep_alive", "server_state", "tasks",
    "scope", "headers", "expect_100_continue", "limit_concurrency", "root_path", "config", "client",
    "scheme", "parser", "transport", "loop", "logger",
)
# What `Exchange` imitates of uvicorn's request cycle (uvicorn's protocol reads and sets these).
CYCLE_PARAMETERS = ["self", "scope", "transport", "flow", "logger", "access_logger", "access_log",
                    "default_headers", "message_event", "expect_100_continue", "keep_alive", "on_response"]
CYCLE_ATTRIBUTES = ("disconnected", "keep_alive", "response_started", "response_complete", "waiting_for_100_continue",
                    "flow", "transport", "default_headers", "message_event", "on_response")


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


async def _app(scope: Any, receive: Any, send: Any) -> None:
    return None


def test_the_pinned_versions_are_the_tested_ones() -> None:
    assert uvicorn.__version__.startswith(TESTED["uvicorn"]), uvicorn.__version__
    assert httptools.__version__.startswith(TESTED["httptools"]), httptools.__version__


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_protocol_method_relied_on_has_its_shape(name: str) -> None:
    method = getattr(HttpToolsProtocol, name, None)
    assert method is not None, f"uvicorn's HttpToolsProtocol lost {name}"
    assert list(inspect.signature(method).parameters) == METHODS[name]


def test_the_request_cycle_that_exchange_imitates_has_its_shape() -> None:
    assert list(inspect.signature(RequestResponseCycle.__init__).parameters) == CYCLE_PARAMETERS
    transport = _Transport()
    cycle = RequestResponseCycle(
        {"type": "http"}, transport, FlowControl(transport), logging.getLogger("t"), logging.getLogger("t"),  # type: ignore[typeddict-item]
        False, [], asyncio.Event(), False, True, lambda: None,
    )
    missing = [a for a in CYCLE_ATTRIBUTES if not hasattr(cycle, a)]
    assert not missing, missing


async def test_a_connected_protocol_has_every_attribute_the_hooks_touch() -> None:
    config = Config(app=_app, http="httptools")
    config.load()
    protocol = HttpToolsProtocol(config, ServerState(), {})
    protocol.connection_made(_Transport())
    missing = [a for a in PROTOCOL_ATTRIBUTES if not hasattr(protocol, a)]
    assert not missing, missing
    assert hasattr(protocol.flow, "drain") and hasattr(protocol.flow, "resume_reading")
    protocol.connection_lost(None)
    # begin_asgi hands uvicorn a parsed head through these, as its own parser callbacks would.
    head = inspect.getsource(HttpToolsProtocol.on_headers_complete)
    assert all(f"self.{a}" in head for a in ("url", "expect_100_continue", "scope", "parser", "cycle", "pipeline"))


async def test_uvicorn_writes_a_whole_answers_head_as_the_coalescing_transport_recognises_it() -> None:
    """_Coalescing holds back a head by its bytes: uvicorn's status line and lower-case
    content-length header, written apart from the body. Driven through uvicorn's own cycle."""
    raw = _Transport()
    transport = _Coalescing(raw)
    cycle = RequestResponseCycle(
        {"type": "http", "method": "GET", "path": "/", "http_version": "1.1", "headers": []},  # type: ignore[typeddict-item]
        transport, FlowControl(raw), logging.getLogger("t"), logging.getLogger("t"),  # type: ignore[arg-type]
        False, [], asyncio.Event(), False, True, lambda: None,
    )
    await cycle.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    assert raw.written == []  # held: uvicorn wrote exactly the head _Coalescing recognises
    await cycle.send({"type": "http.response.body", "body": b"ok"})
    [written] = raw.written  # the head and the body in one write
    assert written.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\ncontent-length: 2\r\n" in written
    assert written.endswith(b"\r\n\r\nok")


def test_the_gateway_protocol_still_subclasses_uvicorns() -> None:
    assert issubclass(GatewayHttpProtocol, HttpToolsProtocol)


async def test_a_cycle_marked_disconnected_reads_a_disconnect_and_writes_nothing() -> None:
    """An ASGI request whose body comes too slowly: gateway/front/server.py answers 408 itself and
    marks uvicorn's cycle disconnected, so its app reads a disconnect and its answer is dropped."""
    raw = _Transport()
    cycle = RequestResponseCycle(
        {"type": "http", "method": "POST", "path": "/", "http_version": "1.1", "headers": []},  # type: ignore[typeddict-item]
        raw, FlowControl(raw), logging.getLogger("t"), logging.getLogger("t"),
        False, [], asyncio.Event(), False, True, lambda: None,
    )
    cycle.disconnected = True
    cycle.message_event.set()
    assert await cycle.receive() == {"type": "http.disconnect"}
    await cycle.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await cycle.send({"type": "http.response.body", "body": b"ok"})
    assert raw.written == []


def test_the_idle_limit_reaches_the_protocol_as_its_keep_alive_timeout() -> None:
    """gateway/__main__.py passes idle_timeout_s (a float) as uvicorn's timeout_keep_alive."""
    config = Config(app=_app, http="httptools", timeout_keep_alive=1.5)  # type: ignore[arg-type]
    config.load()
    # A loop of its own: with none given the protocol asks for the current one, which an
    # asyncio.run() earlier in this process (another test) leaves unset.
    loop = asyncio.new_event_loop()
    try:
        assert HttpToolsProtocol(config, ServerState(), {}, _loop=loop).timeout_keep_alive == 1.5
    finally:
        loop.close()


class _Callbacks:
    def __init__(self) -> None:
        self.urls: list[bytes] = []
        self.headers = 0

    def on_url(self, url: bytes) -> None:
        self.urls.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers += 1
        raise LookupError("a limit")


def test_httptools_hands_over_a_partial_target_and_stops_at_a_callbacks_exception() -> None:
    """gateway/front/hooks.py refuses a target over its limit before the line ends (the parser hands
    over what it has at the end of each read), and stops the parser by raising in a callback
    (which feed_data raises as an HttpParserError, the callback's exception its context)."""
    callbacks = _Callbacks()
    parser = httptools.HttpRequestParser(callbacks)
    parser.feed_data(b"GET /abc")
    parser.feed_data(b"def")
    assert callbacks.urls == [b"/abc", b"def"]
    with pytest.raises(httptools.HttpParserError) as raised:
        parser.feed_data(b" HTTP/1.1\r\na: 1\r\nb: 2\r\nc: 3\r\n\r\n")
    assert isinstance(raised.value.__context__, LookupError)
    assert callbacks.headers == 1  # no callback after the one that raised
