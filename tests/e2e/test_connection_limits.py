"""The limits on a client's connection (gateway/front/front_limits.py), hit with raw sockets.

A real gateway (with small limits, so each is hit in a second or two) and a simulator: a
request line, a head or a header count over its limit gets 414 / 431 and the connection
closes; a head that never ends is refused once over the limit, not read whole (the
gateway's memory stays flat under twenty of them); a connection silent from its start or a
head sent a line at a time is closed at its deadline; a body slower than the limit gets 408
on both request paths; a connection past max_connections gets 503. Each refusal is counted
in /metrics by reason. Honest clients near every limit are served, and malformed framing
(CL+TE, bad chunk sizes, obs-fold...) still gets 400.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Fleet

MODEL = "limits-model"
LINE = 2048  # max_request_line_bytes
HEAD = 8192  # max_header_bytes
HEADERS = 20  # max_headers
HEADER_S = 2.0  # header_timeout_s
IDLE_S = 2.0  # idle_timeout_s
BODY_S = 2.0  # body_timeout_s
RATE = 100  # body_min_rate, bytes a second
CONNECTIONS = 12  # max_connections
SLACK_S = 2.5  # a noisy machine's lateness on a deadline


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("limits"))
    try:
        proc, url = fleet.gateway(
            "--policy", "round_robin", "--set", f"max_request_line_bytes={LINE}", "--set", f"max_header_bytes={HEAD}",
            "--set", f"max_headers={HEADERS}", "--set", f"header_timeout_s={HEADER_S}",
            "--set", f"idle_timeout_s={IDLE_S}", "--set", f"body_timeout_s={BODY_S}",
            "--set", f"body_min_rate={RATE}", "--set", f"max_connections={CONNECTIONS}")
        fleet.worker("l1", "--model", MODEL)
        fleet.wait_ready(url, "l1")
        yield url, int(url.rsplit(":", 1)[1]), proc.pid
    finally:
        fleet.close()


def _refused(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^fleetgate_front_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


class Counted:
    """The refusals by reason since it was made."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = _refused(url)

    def delta(self) -> dict[str, float]:
        after = _refused(self.url)
        return {reason: n - self.before.get(reason, 0) for reason, n in after.items() if n != self.before.get(reason, 0)}


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, float | None]:
    """What the gateway sent, and the seconds until it closed the connection (None: still open)."""
    started = time.monotonic()
    sock.settimeout(within_s)
    data = b""
    try:
        while True:
            piece = sock.recv(65536)
            if not piece:
                return data, time.monotonic() - started
            data += piece
    except TimeoutError:
        return data, None
    except ConnectionResetError:
        return data, time.monotonic() - started


def _status(answer: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


def _completion(max_tokens: int = 2) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": max_tokens}).encode()


def _post(body: bytes, path: str = "/v1/completions", extra: bytes = b"") -> bytes:
    return (b"POST %b HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n"
            % (path.encode(), len(body), extra)) + body


@pytest.mark.parametrize(("name", "request_bytes", "status", "reason"), [
    ("request line", b"GET /health?q=" + b"a" * LINE + b" HTTP/1.1\r\nhost: t\r\n\r\n", 414, "request_line_too_long"),
    ("header block", b"GET /health HTTP/1.1\r\nhost: t\r\n"
     + b"".join(b"x-h%d: %b\r\n" % (i, b"v" * 1000) for i in range(10)) + b"\r\n", 431, "header_too_large"),
    ("header count", b"GET /health HTTP/1.1\r\nhost: t\r\n"
     + b"".join(b"x-h%d: v\r\n" % i for i in range(HEADERS + 1)) + b"\r\n", 431, "too_many_headers"),
    ("proxied route's header block", _post(_completion(), extra=b"x-big: " + b"v" * HEAD + b"\r\n"), 431,
     "header_too_large"),
])
def test_a_head_over_a_limit_is_refused_and_closed(
        gateway: tuple[str, int, int], name: str, request_bytes: bytes, status: int, reason: str) -> None:
    url, port, _ = gateway
    counted = Counted(url)
    with _connect(port) as sock:
        sock.sendall(request_bytes)
        answer, closed_after = _until_closed(sock, 5.0)
    got, headers, body = _status(answer)
    assert got == status and headers["connection"] == "close", (name, answer[:200])
    assert body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert closed_after is not None
    assert counted.delta() == {reason: 1}


def test_a_head_that_never_ends_is_refused_not_read_whole(gateway: tuple[str, int, int]) -> None:
    """Twenty connections each send up to 8 MB of one header line: each gets 431 once past
    the limit, and the gateway's memory stays flat (it grew by 1 GB on 20 x 50 MB before)."""
    url, port, pid = gateway
    counted = Counted(url)
    rss_before = _rss_mib(pid)
    answers: list[bytes] = []
    sent: list[int] = []

    def endless() -> None:
        with _connect(port) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-endless: ")
            total = 0
            try:
                while total < 8 * 2**20:
                    sock.sendall(b"v" * 65536)
                    total += 65536
            except OSError:  # the gateway closed: the rest is refused unread
                pass
            sent.append(total)
            answers.append(_until_closed(sock, 10.0)[0])

    threads = [threading.Thread(target=endless) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rss_after = _rss_mib(pid)
    assert len(answers) == 20
    # Every one refused; the answer may be lost to the reset of the unread rest, never a 200.
    assert all(a == b"" or a.startswith(b"HTTP/1.1 431 ") for a in answers), [a[:40] for a in answers]
    assert sum(a.startswith(b"HTTP/1.1 431 ") for a in answers) >= 1
    assert counted.delta() == {"header_too_large": 20}
    assert rss_after - rss_before < 30, (rss_before, rss_after, sent)


def test_a_silent_connection_is_closed_at_the_idle_limit(gateway: tuple[str, int, int]) -> None:
    url, port, _ = gateway
    counted = Counted(url)
    with _connect(port) as sock:
        answer, closed_after = _until_closed(sock, IDLE_S + 10)
    assert answer == b"" and closed_after is not None and IDLE_S - 0.3 <= closed_after <= IDLE_S + SLACK_S
    assert counted.delta() == {"idle_timeout": 1}


def test_a_head_sent_a_line_at_a_time_is_closed_at_the_header_limit(gateway: tuple[str, int, int]) -> None:
    """One header line every 0.3 s (each under the idle limit, every line whole): closed
    `header_timeout_s` after the head's first byte, with no answer."""
    url, port, _ = gateway
    counted = Counted(url)
    with _connect(port) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for i in range(int((HEADER_S + SLACK_S) / 0.3) + 5):
                sock.sendall(b"x-line-%d: v\r\n" % i)
                time.sleep(0.3)
        except OSError:
            pass
        answer, _ = _until_closed(sock, 5.0)
        closed_after = time.monotonic() - started
    assert answer == b"" and HEADER_S - 0.3 <= closed_after <= HEADER_S + SLACK_S, closed_after
    assert counted.delta() == {"header_timeout": 1}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions?via=asgi"])
def test_a_body_slower_than_the_limit_gets_408(gateway: tuple[str, int, int], path: str) -> None:
    """20 bytes a second against a limit of 100: 408 a little past body_timeout_s, on the
    fast path (an Exchange) and on the ASGI app's (a query string sends it there)."""
    url, port, _ = gateway
    counted = Counted(url)
    body = _completion() + b" " * 400
    with _connect(port) as sock:
        started = time.monotonic()
        request = _post(body, path)
        sock.sendall(request[: len(request) - len(body)])
        try:
            for i in range(0, len(body), 10):
                sock.sendall(body[i:i + 10])
                time.sleep(0.5)
        except OSError:
            pass
        answer, closed_after = _until_closed(sock, 10.0)
        took = time.monotonic() - started
    status, headers, error = _status(answer)
    assert status == 408 and headers["connection"] == "close" and closed_after is not None
    assert error["error"]["code"] == "request_timeout"  # type: ignore[index]
    assert BODY_S <= took <= BODY_S + 1.0 + SLACK_S, took
    assert counted.delta() == {"body_timeout": 1}


def test_a_connection_past_the_limit_gets_503_and_is_counted(gateway: tuple[str, int, int]) -> None:
    url, port, _ = gateway
    counted = Counted(url)
    held = [_connect(port) for _ in range(CONNECTIONS + 3)]  # well within the idle limit
    try:
        first: list[bytes | None] = []
        for sock in held:
            sock.settimeout(0.05)
            try:
                first.append(sock.recv(65536))
            except TimeoutError:
                first.append(None)  # accepted, waiting for a request
        refused = [answer for answer in first if answer is not None]
        assert len(first) - len(refused) <= CONNECTIONS and len(refused) >= 3, first
        for answer in refused:
            status, headers, body = _status(answer)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            assert body["error"]["code"] == "connection_limit"  # type: ignore[index]
    finally:
        for sock in held:
            sock.close()
    assert counted.delta() == {"connection_limit": len(refused)}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert f"fleetgate_front_connections_max {float(CONNECTIONS)}" in text


def test_honest_requests_near_every_limit_are_served(gateway: tuple[str, int, int]) -> None:
    """A long target, a head of nearly the limit in as many lines as allowed, and a body sent
    over longer than body_timeout_s but faster than body_min_rate: all answered 200."""
    url, port, _ = gateway
    counted = Counted(url)
    extra = b"".join(b"x-h%d: %b\r\n" % (i, b"v" * 250) for i in range(HEADERS - 4))
    long_path = "/v1/completions?" + "q" * (LINE - 100)  # the ASGI app's (it has a query string)
    for path in ("/v1/completions", long_path):
        with _connect(port) as sock:
            sock.sendall(_post(_completion(), path, extra))
            answer, _ = _until_closed(sock, 1.0)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    body = _completion() + b" " * 600  # 3 s at 300 bytes a second: due at 2 s + 6.6 s
    with _connect(port) as sock:
        request = _post(body)
        sock.sendall(request[: len(request) - len(body)])
        for i in range(0, len(body), 150):
            sock.sendall(body[i:i + 150])
            time.sleep(0.5)
        answer, _ = _until_closed(sock, 1.0)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert counted.delta() == {}


@pytest.mark.parametrize(("name", "request_bytes"), [
    ("CL and TE", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n"
                  b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n"
                            b"content-length: 6\r\n\r\nabcdef"),
    ("bad chunk size", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                       b"zz\r\nabc\r\n0\r\n\r\n"),
    ("chunked, identity", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\n"
                          b"transfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n"),
    ("obs-fold", b"GET /health HTTP/1.1\r\nhost: t\r\nx-a: b\r\n c\r\n\r\n"),
    ("bare LF", b"GET /health HTTP/1.1\nhost: t\n\n"),
    ("Content-Length: -5", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: -5\r\n\r\n"),
    ("Content-Length: +5", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: +5\r\n\r\nabcde"),
])
def test_malformed_framing_still_gets_400(gateway: tuple[str, int, int], name: str, request_bytes: bytes) -> None:
    _, port, _ = gateway
    with _connect(port) as sock:
        sock.sendall(request_bytes)
        answer, closed_after = _until_closed(sock, 5.0)
    assert answer.startswith(b"HTTP/1.1 400 ") and closed_after is not None, (name, answer[:100])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
