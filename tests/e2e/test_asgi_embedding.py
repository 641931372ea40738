"""The gateway as a plain ASGI app in someone else's server: `create_asgi(settings)` under
stock uvicorn (no fleetgate protocol), so the proxied routes take `FastPath.__call__`, the
ASGI fast path, rather than `serve_cycle`."""

from __future__ import annotations

import sys
from collections.abc import Callable

import httpx
import openai

from fleetgate.net import free_port
from tests.conftest import ADMIN_TOKEN, Fleet, wait_healthy, wait_until

MODEL = "demo-model"
FAST = ("--model", MODEL, "--option", "time_scale=0.05")

SERVE = """
import sys, uvicorn
from gateway.app import create_asgi
from gateway.settings_check import load_checked
from fleetgate.logs import configure_logging
port, redis_url, prefix = int(sys.argv[1]), sys.argv[2], sys.argv[3]
settings = load_checked(None, {"port": port, "redis_url": redis_url, "redis_prefix": prefix,
                               "max_body_bytes": 4096})
configure_logging(settings.log_level, settings.log_json)
uvicorn.run(create_asgi(settings), host="127.0.0.1", port=port, http="httptools", log_config=None)
"""


def test_the_asgi_app_under_stock_uvicorn_proxies_whole_and_streamed_answers(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """Served by stock uvicorn, the official client gets a whole answer and a stream, and bad
    requests get OpenAI-style errors (404/400, 413 over the body limit)."""
    fleet = fleet_factory()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = fleet._spawn("asgi-gateway", [sys.executable, "-c", SERVE, str(port), fleet.redis_url, fleet.prefix],
                        {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    wait_healthy(proc, url)
    fleet.worker("w", *FAST)
    fleet.wait_ready(url, "w")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert whole.choices[0].message.content and whole.usage is not None and whole.usage.completion_tokens == 5
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="hi", max_tokens=6,
                                                                     stream=True) if c.choices]
    assert len("".join(pieces)) > 0 and len(pieces) >= 2
    missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "no-such-model", "messages": []}, timeout=10)
    assert missing.status_code in (400, 404) and missing.json()["error"]["message"]
    too_big = httpx.post(f"{url}/v1/completions", content=b"x" * 8192, timeout=30,
                         headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


OWN_PROTOCOL_LIMITED = """
import functools, sys, uvicorn
from gateway.app import create_asgi
from gateway.front.server import GatewayHttpProtocol
from gateway.settings_check import load_checked
from fleetgate.logs import configure_logging
port, redis_url, prefix = int(sys.argv[1]), sys.argv[2], sys.argv[3]
settings = load_checked(None, {"port": port, "redis_url": redis_url, "redis_prefix": prefix})
configure_logging(settings.log_level, settings.log_json)
asgi = create_asgi(settings)
uvicorn.run(asgi, host="127.0.0.1", port=port, log_config=None, limit_concurrency=1,
            http=functools.partial(GatewayHttpProtocol, fast=asgi))
"""


def test_the_gateway_protocol_keeps_uvicorns_503_under_limit_concurrency(fleet_factory: Callable[[], Fleet]) -> None:
    """An embedder who sets uvicorn's limit_concurrency gets uvicorn's 503 on the proxied routes
    too: the fleetgate protocol serves a request itself only when uvicorn hands it the app."""
    fleet = fleet_factory()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = fleet._spawn("limited-gateway", [sys.executable, "-c", OWN_PROTOCOL_LIMITED, str(port), fleet.redis_url,
                                            fleet.prefix], {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN})

    def up() -> bool:
        assert proc.alive(), proc.output()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 503  # one connection is the limit
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30)
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = httpx.post(url + path, json={"model": MODEL, "prompt": "hi", "messages": []}, timeout=10)
        assert resp.status_code == 503 and resp.text == "Service Unavailable"
