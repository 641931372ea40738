"""The autoscaler reaches the gateway through the one admin client (fleetgate_tools/admin_client.py):
an unreachable gateway, an error answer or an answer that is not the scaling signal is a failed
read or a failed admin call, logged, never an exception out of the loop. Over real HTTP: a
closed port, and a small server answering as a broken gateway would."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from fleetgate.net import free_port
from fleetgate_tools.autoscale_loop import Autoscaler, Options


class _Broken(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str]] = []

    def _answer(self, status: int, body: bytes) -> None:
        self.seen.append((self.command, self.path, self.headers.get("authorization", "")))
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/admin/scaling":
            self._answer(200, b'{"object": "list", "data": "not a list"}')
        else:
            self._answer(200, b'{"status": "ok"}')

    def do_POST(self) -> None:
        error = {"error": {"message": "No worker `w9` is registered.", "type": "not_found_error"}}
        self._answer(404, json.dumps(error).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def broken() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Broken.seen = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _scaler(gateway: str, tmp_path: Path) -> Autoscaler:
    return Autoscaler(Options(gateway=gateway, token="t0k", policies={}, log_dir=tmp_path))


def test_an_unreachable_gateway_is_a_failed_read_and_a_failed_call(tmp_path: Path) -> None:
    scaler = _scaler(f"http://127.0.0.1:{free_port()}", tmp_path)
    try:
        with capture_logs() as logs:
            assert scaler.read() is None
            assert scaler._admin("POST", "/admin/workers/w9/drain") is False
    finally:
        scaler.admin.close()
    events = [e["event"] for e in logs]
    assert "autoscale.signal_failed" in events and "autoscale.admin_failed" in events
    failed = next(e for e in logs if e["event"] == "autoscale.admin_failed")
    assert "cannot reach the gateway" in failed["error"]


def test_a_gateways_error_and_a_bad_signal_are_failures_with_the_gateways_message(
    broken: str, tmp_path: Path,
) -> None:
    scaler = _scaler(broken, tmp_path)
    try:
        with capture_logs() as logs:
            assert scaler.read() is None  # "data" is not a list: not the scaling signal
            assert scaler._admin("POST", "/admin/workers/w9/drain") is False
    finally:
        scaler.admin.close()
    failed = next(e for e in logs if e["event"] == "autoscale.admin_failed")
    assert failed["path"] == "/admin/workers/w9/drain" and "No worker `w9` is registered." in failed["error"]
    assert any(e["event"] == "autoscale.signal_failed" for e in logs)
    # Both calls carried the admin token.
    assert [(m, p) for m, p, _ in _Broken.seen] == [("GET", "/admin/scaling"), ("POST", "/admin/workers/w9/drain")]
    assert {auth for _, _, auth in _Broken.seen} == {"Bearer t0k"}
