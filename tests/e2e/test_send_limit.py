"""The send limit (send_timeout_s, gateway/front/server.py): a client that stops reading its answer.

A real gateway with a 3 s limit and a simulator whose streams last long after a small
client's buffers are full. A client with a small receive window (SO_RCVBUF) that stops
reading makes the gateway's writes pause; past the limit the gateway closes it, counts
`send_timeout` in fleetgate_front_refused_total, logs `gateway.client_stalled` with the
request's id and the bytes it could not send, and, for a stream, cancels the engine's request
(the simulator's running count returns to 0 and it counts no finished request): on the fast
path, on its ASGI way in, on Litestar's routes (fast_path off), and for whole answers. A client
that stops reading and then hangs up before the limit cancels its engine's request at once. A
client that pauses for less than the limit and reads on gets its whole stream, and nothing is
counted.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import Fleet, Proc, wait_until

SEND_S = 3.0  # send_timeout_s
MODEL = "send-model"
# A stream of about 15 MB that the simulator generates over ~10 s (0.1 ms a token): far more
# than a stalled client's socket buffers hold, and still running when the limit closes it.
TOKENS = 100_000
SLOW = "time_scale=0.01"
FAST = "time_scale=0.0001"
FAST_MODEL = "send-fast-model"  # a 20,000-token stream (~5 MB) in about a second
EMBED = "send-embed-model"
# Whole answers larger than the socket buffers (the kernel's send buffer on loopback grows to
# 4 MB): eight pipelined embeddings of 300 inputs, about 800 KB each, in well under a second.
EMBED_INPUTS, PIPELINED = 300, 8


@dataclass
class Gateway:
    url: str
    port: int
    proc: Proc
    engine_url: str


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("send"))
    try:
        proc, url = fleet.gateway("--set", f"send_timeout_s={SEND_S}")
        fleet.worker("s1", "--model", MODEL, "--max-model-len", str(TOKENS + 64), "--option", SLOW)
        fleet.worker("s2", "--model", FAST_MODEL, "--max-model-len", "20064", "--option", FAST)
        fleet.worker("e1", "--model", EMBED, "--max-model-len", "512", "--option", FAST, "--option", "runner=pooling",
                     "--option", "convert=embed")
        fleet.wait_ready(url, "s1", "s2", "e1")
        yield Gateway(url, int(url.rsplit(":", 1)[1]), proc, str(fleet.workers(url)["s1"]["url"]))
    finally:
        fleet.close()


def _refused(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^fleetgate_front_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def _paused(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^fleetgate_front_send_paused_total (\S+)$", text, re.M)[1])  # type: ignore[index]


def _engine(engine_url: str, name: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _request(model: str, tokens: int, stream: bool, request_id: str, path: str) -> bytes:
    return _post(path, request_id, {"model": model, "prompt": "hi", "max_tokens": tokens, "ignore_eos": True,
                                    "stream": stream})


def _post(path: str, request_id: str, payload: dict[str, object]) -> bytes:
    body = json.dumps(payload).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\nx-request-id: {request_id}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _small_window(port: int) -> socket.socket:
    """A client socket whose receive buffer holds a few KB (set before connecting: it sets the window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def _drain(sock: socket.socket) -> tuple[bytes, str]:
    """What is left to read, and how the connection ended ("reset" or "closed")."""
    sock.settimeout(30)
    got = bytearray()
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        return bytes(got), "reset"
    return bytes(got), "closed"


def _events(log: str, event: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.splitlines() if f'"{event}"' in line]


def _stalled(gw: Gateway, request_id: str) -> dict[str, object]:
    """The gateway's `gateway.client_stalled` line for `request_id`, once it is written."""
    def line() -> dict[str, object] | None:
        found = [e for e in _events(gw.proc.output(), "gateway.client_stalled") if e.get("request_id") == request_id]
        return found[0] if found else None
    # The writes pause once the client's buffers are full (a second or two), then SEND_S: a
    # generous bound for a loaded machine, not a measure of the limit.
    found = wait_until(line, timeout=60, interval=0.2)
    assert isinstance(found, dict)
    return found


def _stall_a_stream(gw: Gateway, path: str) -> str:
    """A stream whose client reads nothing: closed at the limit with its writes paused, counted
    once, its engine's request aborted rather than finished; the outcome its summary line says."""
    before = _refused(gw.url)
    finished = _engine(gw.engine_url, "vllm:request_success_total")
    request_id = f"stall-{uuid.uuid4().hex[:8]}"
    with _small_window(gw.port) as sock:
        sock.sendall(_request(MODEL, TOKENS, True, request_id, path))
        wait_until(lambda: _engine(gw.engine_url, "vllm:num_requests_running") == 1, timeout=30)
        stalled = _stalled(gw, request_id)  # the client has read nothing
        # The writes were paused: bytes of the answer were still waiting to go out at the limit.
        assert stalled["answering"] is True and isinstance(stalled["unsent_bytes"], int), stalled
        assert stalled["unsent_bytes"] > 0 and stalled["send_timeout_s"] == SEND_S, stalled
        answer, ended = _drain(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in answer, answer[-200:]
    assert ended in ("reset", "closed")
    wait_until(lambda: _engine(gw.engine_url, "vllm:num_requests_running") == 0, timeout=10)
    assert _engine(gw.engine_url, "vllm:request_success_total") == finished  # aborted, not run to its end
    after = _refused(gw.url)
    assert {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)} == {"send_timeout": 1}
    done = wait_until(lambda: [e for e in _events(gw.proc.output(), "gateway.request")
                               if e.get("request_id") == request_id], timeout=10)
    assert isinstance(done, list) and len(done) == 1, done
    return str(done[0]["outcome"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions?via=asgi"], ids=["fast-path", "asgi-path"])
def test_a_client_that_stops_reading_a_stream_is_closed_and_its_engine_request_cancelled(
        gateway: Gateway, path: str) -> None:
    """The fast path (a raw path) and its ASGI way in (a query string) alike: the writes pause,
    the limit closes the connection, the engine's request is aborted, not finished, and the
    request's summary line says it was the client's stall."""
    assert _stall_a_stream(gateway, path) == "client_stalled"


def test_the_limit_holds_on_litestars_routes_too(fleet_factory: Callable[[], Fleet]) -> None:
    """With fast_path off, Litestar's route hands the request to the one answer path (its ASGI
    writer, through uvicorn's request cycle): the same limit closes a client that reads nothing
    and aborts its engine's request, and the summary line says it was the client's stall, as on
    the other paths (Litestar's own streaming, before issue 33, ended it as a hang-up: client_gone)."""
    fleet = fleet_factory()
    proc, url = fleet.gateway("--set", f"send_timeout_s={SEND_S}", "--set", "fast_path=false")
    fleet.worker("s1", "--model", MODEL, "--max-model-len", str(TOKENS + 64), "--option", SLOW)
    fleet.wait_ready(url, "s1")
    gw = Gateway(url, int(url.rsplit(":", 1)[1]), proc, str(fleet.workers(url)["s1"]["url"]))
    assert _stall_a_stream(gw, "/v1/completions") == "client_stalled"


def test_whole_answers_the_client_never_reads_are_closed_at_the_limit(gateway: Gateway) -> None:
    """Whole answers (pipelined, more of them than the client's buffers hold): the engine is
    done with them, but the connection and the answers' bytes in the gateway are let go of at
    the limit."""
    before = _refused(gateway.url)
    ids = [f"stall-whole-{uuid.uuid4().hex[:8]}" for _ in range(PIPELINED)]
    with _small_window(gateway.port) as sock:
        sock.sendall(b"".join(_post("/v1/embeddings", i, {"model": EMBED, "input": ["hi"] * EMBED_INPUTS})
                              for i in ids))
        def line() -> list[dict[str, object]]:
            return [e for e in _events(gateway.proc.output(), "gateway.client_stalled") if e.get("request_id") in ids]
        [stalled] = wait_until(line, timeout=60, interval=0.2)  # type: ignore[misc]
        assert stalled["answering"] is False and isinstance(stalled["unsent_bytes"], int), stalled
        assert stalled["unsent_bytes"] > 0, stalled
        answer, _ = _drain(sock)
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.count(b"HTTP/1.1 200 ") < PIPELINED or not answer.endswith(b"}")  # cut off: never all of it
    after = _refused(gateway.url)
    assert after["send_timeout"] - before.get("send_timeout", 0) == 1


def test_a_client_that_hangs_up_while_the_writes_are_paused_cancels_its_engine_request(gateway: Gateway) -> None:
    """A client that stops reading, then leaves before the limit: its engine's request is
    aborted at once (the relay waits on the paused writes when the connection goes), and the
    stream ends as the client's hang-up, not as a stall."""
    before, paused = _refused(gateway.url), _paused(gateway.url)
    finished = _engine(gateway.engine_url, "vllm:request_success_total")
    request_id = f"leave-{uuid.uuid4().hex[:8]}"
    with _small_window(gateway.port) as sock:
        sock.sendall(_request(MODEL, TOKENS, True, request_id, "/v1/completions"))
        wait_until(lambda: _paused(gateway.url) > paused, timeout=60, interval=0.1)
        # (unread bytes in its buffer: the close is a reset)
    wait_until(lambda: _engine(gateway.engine_url, "vllm:num_requests_running") == 0, timeout=10)
    assert _engine(gateway.engine_url, "vllm:request_success_total") == finished
    done = wait_until(lambda: [e for e in _events(gateway.proc.output(), "gateway.request")
                               if e.get("request_id") == request_id], timeout=10)
    assert isinstance(done, list) and [e["outcome"] for e in done] == ["client_gone"], done
    assert _refused(gateway.url).get("send_timeout", 0) == before.get("send_timeout", 0)


def test_a_client_that_pauses_for_less_than_the_limit_gets_its_whole_stream(gateway: Gateway) -> None:
    """Paused for a third of the limit, with the writes backed up meanwhile, then read on:
    every event arrives and nothing is counted against the limit."""
    before, paused = _refused(gateway.url), _paused(gateway.url)
    tokens = 20_000
    request_id = f"pause-{uuid.uuid4().hex[:8]}"
    with _small_window(gateway.port) as sock:
        sock.sendall(_request(FAST_MODEL, tokens, True, request_id, "/v1/completions"))
        wait_until(lambda: _paused(gateway.url) > paused, timeout=30, interval=0.1)  # the writes paused
        time.sleep(SEND_S / 3)  # and stay so a while, well within the limit
        sock.settimeout(30)
        got = bytearray()
        while not got.endswith(b"\r\n0\r\n\r\n"):  # the stream's last chunk (the connection stays open)
            chunk = sock.recv(65536)
            assert chunk, bytes(got[-200:])
            got += chunk
    answer = bytes(got)
    events = [e for e in answer.split(b"\n\n") if b"data: {" in e]
    assert len(events) >= tokens and answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), answer[-200:]
    assert _refused(gateway.url).get("send_timeout", 0) == before.get("send_timeout", 0)
    assert not [e for e in _events(gateway.proc.output(), "gateway.client_stalled") if e.get("request_id") == request_id]


def _answers(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """`count` whole answers (content-length) read off `sock` in order: (head, body) each."""
    sock.settimeout(60)
    buf = bytearray()
    answers: list[tuple[bytes, bytes]] = []
    while len(answers) < count:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end])
            length = int(re.search(rb"\r\ncontent-length: (\d+)", head)[1])  # type: ignore[index]
            if len(buf) >= end + 4 + length:
                answers.append((head, bytes(buf[end + 4:end + 4 + length])))
                del buf[:end + 4 + length]
                continue
        chunk = sock.recv(1 << 20)
        assert chunk, f"closed after {len(answers)} answers"
        buf += chunk
    return answers


def test_pipelined_requests_wait_while_the_client_reads_nothing(fleet_factory: Callable[[], Fleet]) -> None:
    """Issue 35: a client pipelines 20 embeddings (~800 KB of answer each, 16 MB in all) and
    reads nothing. Once the gateway's writes pause it reads no further request from that
    connection: the engine serves only those whose answers the kernel's send buffer took
    before the pause (at most its largest size, tcp_wmem's third figure, plus the transport's
    64 KiB high-water mark, rounded up to whole answers), not the rest, while the client does
    not read (the send limit is a minute here, far beyond the wait). Then the client reads,
    and all twenty answers arrive, whole and in order."""
    count, inputs, answer_bytes = 20, EMBED_INPUTS, 800_000  # (812 KB, measured)
    with open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
        most = -(-(int(wmem.read().split()[2]) + 65536) // answer_bytes)
    assert most < count // 2, most
    fleet = fleet_factory()
    proc, url = fleet.gateway("--set", "send_timeout_s=60")
    fleet.worker("e1", "--model", EMBED, "--max-model-len", "512", "--option", FAST, "--option", "runner=pooling",
                 "--option", "convert=embed")
    fleet.wait_ready(url, "e1")
    engine_url = str(fleet.workers(url)["e1"]["url"])
    paused, served = _paused(url), _engine(engine_url, "vllm:request_success_total")
    ids = [f"pipe-{n:02d}-{uuid.uuid4().hex[:6]}" for n in range(count)]
    with _small_window(int(url.rsplit(":", 1)[1])) as sock:
        sock.sendall(b"".join(_post("/v1/embeddings", i, {"model": EMBED, "input": ["hi"] * inputs}) for i in ids))
        wait_until(lambda: _paused(url) > paused, timeout=60, interval=0.1)  # the precondition: writes paused
        # Time enough for the engine to serve all twenty (well under a second, as it did before
        # the fix): it serves those written before the pause, and then nothing more.
        time.sleep(5)
        # (the simulator counts an embedding's inputs as requests, as vLLM does its prompts)
        held = (_engine(engine_url, "vllm:request_success_total") - served) / inputs
        print(f"served while the client read nothing: {held:g} of {count} (at most {most})")
        assert 1 <= held <= most, (held, most)
        answers = _answers(sock, count)
    assert _engine(engine_url, "vllm:request_success_total") - served == count * inputs
    for request_id, (head, body) in zip(ids, answers, strict=True):
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert f"\r\nx-request-id: {request_id}".encode() in head.lower(), head
        assert len(json.loads(body)["data"]) == inputs
    assert _refused(url).get("send_timeout", 0) == 0
    assert proc.alive()


def test_held_reads_are_not_an_idle_or_slow_header_connection(fleet_factory: Callable[[], Fleet]) -> None:
    """The reads held for paused writes are not the client's slowness: 8 pipelined embeddings
    and the first half of a ninth request's head, then nothing read for three times the idle
    and header timeouts (2 s each). The connection is neither closed as idle nor refused as a
    slow header; once the client reads, it gets the eight answers, sends the rest of the head
    and gets the ninth."""
    fleet = fleet_factory()
    proc, url = fleet.gateway("--set", "send_timeout_s=60", "--set", "header_timeout_s=2", "--set",
                              "idle_timeout_s=2")
    fleet.worker("e1", "--model", EMBED, "--max-model-len", "512", "--option", FAST, "--option", "runner=pooling",
                 "--option", "convert=embed")
    fleet.wait_ready(url, "e1")
    paused = _paused(url)
    ids = [f"held-{n}-{uuid.uuid4().hex[:6]}" for n in range(PIPELINED + 1)]
    last = _post("/v1/embeddings", ids[-1], {"model": EMBED, "input": ["hi"] * 3})
    half = last.index(b"x-request-id")
    with _small_window(int(url.rsplit(":", 1)[1])) as sock:
        sock.sendall(b"".join(_post("/v1/embeddings", i, {"model": EMBED, "input": ["hi"] * EMBED_INPUTS})
                              for i in ids[:-1]) + last[:half])
        wait_until(lambda: _paused(url) > paused, timeout=60, interval=0.1)  # the precondition: writes paused
        time.sleep(6)
        answers = _answers(sock, PIPELINED)
        sock.sendall(last[half:])
        [(head, body)] = _answers(sock, 1)
    for request_id, (h, _) in zip(ids, [*answers, (head, body)], strict=True):
        assert h.startswith(b"HTTP/1.1 200 ") and f"\r\nx-request-id: {request_id}".encode() in h.lower(), h
    assert len(json.loads(body)["data"]) == 3
    assert not any(_refused(url).values()), _refused(url)  # no idle, header or send timeout
    assert proc.alive()
