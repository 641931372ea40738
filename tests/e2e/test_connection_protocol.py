"""The gateway's own connection protocol (gateway/front/server.py) as a client's socket sees it.

A proxied request is an `Exchange` served straight off the connection, every other request
uvicorn's ASGI cycle: both must keep HTTP/1.1's rules on one connection. Pipelined requests
of either kind are answered in order; a body over the limit gets a 413 and the connection
closes; `Expect: 100-continue` gets its interim answer; a chunked body is read whole; a
client that leaves mid-body costs nothing; the keep-alive timer closes an idle connection
`timeout_keep_alive` after its last answer (uvicorn's 5 s), never one with a request in
flight. Raw sockets against a real gateway and simulator; h11 reads the answers.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest

from tests.conftest import Fleet, wait_until

MODEL = "proto-model"
LIMIT = 4096  # max_body_bytes
KEEP_ALIVE_S = 5.0  # uvicorn's timeout_keep_alive, which the gateway keeps
FAST_MODEL = "proto-fast"  # a simulator 1000x faster than real time
# A stream of several MB: more than the kernel's socket buffers on loopback hold (4 MB each way).
SLOW_READER_TOKENS = 40_000
BUSY_TOKENS = 200  # a stream of about 2 s on the simulator's default profile (~10 ms a token)


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("proto"))
    try:
        proc, url = fleet.gateway("--policy", "round_robin", "--set", f"max_body_bytes={LIMIT}")
        fleet.worker("p1", "--model", MODEL)
        fleet.worker("f1", "--model", FAST_MODEL, "--max-model-len", str(SLOW_READER_TOKENS + 64),
                     "--option", "time_scale=0.001")
        fleet.wait_ready(url, "p1", "f1")
        yield url, int(url.rsplit(":", 1)[1]), Path(proc.log_path)
    finally:
        fleet.close()


def _completion(max_tokens: int = 4, stream: bool = False) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": stream}).encode()


def _post(body: bytes, path: str = "/v1/completions", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Reader:
    """Answers off a socket, in order, with h11."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        """The next whole answer (an interim 1xx comes back on its own, body b"")."""
        status, headers, body = 0, {}, bytearray()  # a stream's body comes an event a chunk: 40,000 of them
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
                continue
            if isinstance(event, h11.InformationalResponse):
                return event.status_code, {}, b""
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.conn.our_state is h11.DONE:
                    self.conn.start_next_cycle()
                return status, headers, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before an answer")

    def send(self, data: bytes) -> None:
        """Raw bytes, as written (`_expect` tells h11 a request went out before reading its answer)."""
        self.sock.sendall(data)


def _expect(reader: Reader, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    out = []
    for _ in range(n):
        # h11 wants to have sent a request before it reads an answer: tell it one went out.
        reader.conn.send(h11.Request(method="POST", target="/", headers=[("host", "t"), ("content-length", "0")]))
        reader.conn.send(h11.EndOfMessage())
        out.append(reader.answer())
    return out


def _closed(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the peer closed the socket (None: still open after `within_s`)."""
    started = time.monotonic()
    sock.settimeout(within_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return time.monotonic() - started
    except TimeoutError:
        return None
    except ConnectionResetError:
        return time.monotonic() - started


def test_pipelined_requests_of_both_kinds_are_answered_in_order(gateway: tuple[str, int, Path]) -> None:
    _, port, _ = gateway
    with _connect(port) as sock:
        reader = Reader(sock)
        reader.send(_post(_completion(3)) + b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n" + _post(_completion(5))
                    + _post(b"{not json"))
        (s1, h1, b1), (s2, _, b2), (s3, h3, b3), (s4, _, b4) = _expect(reader, 4)
    assert s1 == 200 and json.loads(b1)["usage"]["completion_tokens"] == 3 and h1["x-fleetgate-worker"] == "p1"
    assert s2 == 200 and json.loads(b2)
    assert s3 == 200 and json.loads(b3)["usage"]["completion_tokens"] == 5
    assert h1["x-request-id"] != h3["x-request-id"]
    assert s4 == 400 and json.loads(b4)["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_gets_413_and_the_connection_closes(gateway: tuple[str, int, Path]) -> None:
    _, port, _ = gateway
    body = b'{"model": "' + b"x" * (LIMIT * 4) + b'"}'
    with _connect(port) as sock:
        reader = Reader(sock)
        head, rest = _post(body).split(b"\r\n\r\n", 1)
        reader.send(head + b"\r\n\r\n" + rest[: LIMIT * 2])  # the gateway answers before the rest arrives
        [(status, headers, answer)] = _expect(reader, 1)
        assert status == 413 and json.loads(answer)["error"]["code"] == "request_too_large"
        assert headers.get("connection") == "close"
        assert _closed(sock, 5.0) is not None
    # Under the limit, on a new connection: served.
    ok = httpx.post(f"{gateway[0]}/v1/completions", content=_completion(2), timeout=30,
                    headers={"content-type": "application/json"})
    assert ok.status_code == 200


def test_expect_100_continue_gets_its_interim_answer_then_the_answer(gateway: tuple[str, int, Path]) -> None:
    _, port, _ = gateway
    body = _completion(2)
    with _connect(port) as sock:
        reader = Reader(sock)
        head = _post(b"", extra="expect: 100-continue\r\n").replace(b"content-length: 0",
                                                                     f"content-length: {len(body)}".encode())
        reader.send(head)
        [(interim, _, _)] = _expect(reader, 1)
        assert interim == 100
        reader.send(body)
        status, _, answer = reader.answer()
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2


def test_a_chunked_body_is_read_whole(gateway: tuple[str, int, Path]) -> None:
    _, port, _ = gateway
    body = _completion(3)
    half = len(body) // 2
    with _connect(port) as sock:
        reader = Reader(sock)
        reader.send(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                    b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%b\r\n" % (half, body[:half]))
        time.sleep(0.2)  # the rest in a later packet
        reader.send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body) - half, body[half:]))
        [(status, _, answer)] = _expect(reader, 1)
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 3


def test_a_client_that_leaves_mid_body_costs_nothing(gateway: tuple[str, int, Path]) -> None:
    url, port, log_path = gateway
    for _ in range(5):
        with _connect(port) as sock:
            body = _completion(2)
            sock.sendall(_post(body)[: -len(body) // 2])
            time.sleep(0.05)
    resp = httpx.post(f"{url}/v1/completions", content=_completion(2), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 200
    assert "internal_error" not in log_path.read_text()


def test_keep_alive_closes_an_idle_connection_but_never_a_busy_one(gateway: tuple[str, int, Path]) -> None:
    """`idle`: answers at 0 s and 2 s, then nothing: closed 5 s after the second answer (not 5 s
    after the first). `busy`: an answer at 0 s, then at 4 s a stream that runs past the 5 s
    mark: it is answered whole, and the connection still serves after it."""
    _, port, _ = gateway
    results: dict[str, Any] = {}

    def idle() -> None:
        with _connect(port) as sock:
            reader = Reader(sock)
            reader.send(_post(_completion(1)))
            assert _expect(reader, 1)[0][0] == 200
            time.sleep(2.0)
            reader.send(_post(_completion(1)))
            assert _expect(reader, 1)[0][0] == 200
            results["idle_closed_after"] = _closed(sock, 10.0)

    def busy() -> None:
        with _connect(port) as sock:
            reader = Reader(sock)
            reader.send(_post(_completion(1)))
            assert _expect(reader, 1)[0][0] == 200
            time.sleep(4.0)
            started = time.monotonic()
            reader.send(_post(_completion(BUSY_TOKENS, stream=True)))
            [(status, _, answer)] = _expect(reader, 1)
            results["busy_answer"] = (status, answer.count(b"data: "), time.monotonic() - started)
            reader.send(_post(_completion(1)))
            results["busy_after"] = _expect(reader, 1)[0][0]

    threads = [threading.Thread(target=idle), threading.Thread(target=busy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    closed_after = results.get("idle_closed_after")
    assert isinstance(closed_after, float) and KEEP_ALIVE_S - 0.5 <= closed_after <= KEEP_ALIVE_S + 3.0, results
    status, events, took = results["busy_answer"]
    assert status == 200 and events >= BUSY_TOKENS and took > 1.2, results  # it ran past the 5 s mark
    assert results.get("busy_after") == 200, results


def _read_slowly(port: int, pause_s: float) -> None:
    """A long stream to a client with a small receive window that reads nothing for `pause_s`,
    then everything: every event arrives, and the writes did back up meanwhile."""
    tokens = SLOW_READER_TOKENS
    body = json.dumps({"model": FAST_MODEL, "prompt": "hi", "max_tokens": tokens, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    with sock:
        reader = Reader(sock)
        reader.send(_post(body))
        time.sleep(pause_s)  # the answer backs up in the gateway (and then the engine's connection)
        [(status, _, answer)] = _expect(reader, 1)
    events = [line for line in answer.split(b"\n\n") if line.startswith(b"data: ")]
    assert status == 200 and events[-1] == b"data: [DONE]"
    text = [json.loads(e[6:]) for e in events[:-1]]
    assert len(text) >= tokens and text[-1]["choices"][0]["finish_reason"] == "length"
    assert len(answer) > 5 * 2**20  # more than the socket buffers hold: the writes did back up


def test_a_stream_to_a_client_that_reads_slowly_waits_for_it_and_loses_nothing(
        gateway: tuple[str, int, Path]) -> None:
    """A client with a small receive window that reads nothing for a few seconds: the gateway's
    writes back up (the transport pauses it), the relay waits for the client, and every
    event arrives once the client reads."""
    _read_slowly(gateway[1], 3.0)


def test_a_client_paused_past_the_stall_limit_is_waited_for_not_cut_off(fleet_factory: Any) -> None:
    """The stall limit is the engine's silence while the gateway waits on it: a client that
    reads nothing for longer (here 3 s against a 1 s limit) holds the stream at its own pace
    and gets all of it; the gateway's books say it completed, with no stall and no resume.
    (Before, the limit also ran while the relay waited for the client: at 1.1 s the stream was
    cut off and logged as the client's hang-up.)"""
    fleet = fleet_factory()
    proc, url = fleet.gateway("--set", "stall_timeout_s=1")
    fleet.worker("f1", "--model", FAST_MODEL, "--max-model-len", str(SLOW_READER_TOKENS + 64),
                 "--option", "time_scale=0.001")
    fleet.wait_ready(url, "f1")
    _read_slowly(int(url.rsplit(":", 1)[1]), 3.0)
    # the gateway writes its line as the stream ends, just after the client's last byte
    log = str(wait_until(lambda: '"gateway.request"' in proc.output() and proc.output(), timeout=10))
    [done] = [json.loads(line) for line in log.splitlines() if '"gateway.request"' in line]
    assert (done["outcome"], done["resumes"], done["final_worker"]) == ("completed", 0, "f1"), done
    assert "gateway.stream_broke" not in log
