"""Hostile clients, in a process of their own: `python -m fleetgate_tools.hostile PLAN_JSON OUT_JSON`.

Four kinds of connection against one gateway (scripts/bench_hostile.py runs them beside
normal traffic), each reopened as soon as the gateway closes it, until SIGTERM:

- `big`: a head that never ends (one header line sent in 64 KiB pieces, up to 50 MB) or,
  every other time, one oversized head sent whole (1 MiB of header line, then its end);
  each waits a second before the next attempt;
- `slow`: a head sent one header line a second, never finished (slowloris);
- `idle`: a connection that never sends a byte;
- `stalled`: valid streamed completions (`STALL_STREAMS` pipelined, each of the stub engine's
  most chunks, fleetgate_tools/overhead/stub.py), of which it reads nothing: a receive
  buffer of a few KB and 536-byte segments, both set before connecting (the gateway's kernel
  then starts its send buffer small, where on loopback it would start at megabytes), so the
  gateway's writes pause within the first stream and the send limit (send_timeout_s) must
  close it. It reads nothing: it sees the end in the socket's TCP state (TCP_INFO, every
  `POLL_S`, after sending an empty line that draws the gateway's reset once it has closed),
  and the answer's status line with MSG_PEEK, which leaves the bytes unread.

For every connection the gateway ends it records how long it lasted (from its first byte
sent, from its opening for `idle`, from its requests sent for `stalled`), what status the
gateway answered (none: no answer), and for `big` how many bytes it had written when the
gateway stopped it. The summary goes to OUT_JSON. Plain asyncio protocols on uvloop keep the process's own CPU small: on a 2-core
machine it competes with the gateway under test.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

import uvloop

BIG_TOTAL = 50 * 2**20
PIECE = b"v" * 65536
# A stalled connection's requests: streams of the stub's most chunks (4,096 events of about
# 150 bytes: some 600 KB each), pipelined. One fills what a tiny window lets the gateway's
# kernel and transport hold; the gateway starts none of the others while its writes are paused.
STALL_TOKENS = 4096
STALL_STREAMS = 4
STALL_ANSWER_KIB = 640  # one stream's bytes at most (events under 160 bytes with their framing)
STALL_RCVBUF = 4096
STALL_MSS = 536
POLL_S = 0.1
_ESTABLISHED = 1  # tcpi_state, the first byte of struct tcp_info (Linux)


@dataclass
class Plan:
    host: str
    port: int
    big: int = 50
    slow: int = 1000
    idle: int = 5000
    stalled: int = 50
    ramp_per_s: float = 2000.0  # connections opened a second at start (the listen backlog is finite)
    api_key: str = ""  # for the stalled connections' completions (the gateway's key, if it asks for one)
    model: str = "stub"


@dataclass
class Kind:
    opened: int = 0
    connect_errors: int = 0
    open_now: int = 0
    # Ages (s) of the connections still open when the run stopped.
    open_at_stop_s: list[float] = field(default_factory=list)
    durations_s: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    sent_bytes: list[int] = field(default_factory=list)

    def ended(self, started: float, conn: _Conn | _Stalled, sent: int | None = None) -> None:
        self.durations_s.append(round(conn.ended_at - started, 4))
        answer = conn.answer
        status = answer[9:12].decode("ascii", "replace") if answer.startswith(b"HTTP/1.1 ") else "none"
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if sent is not None:
            self.sent_bytes.append(sent)


class _Conn(asyncio.Protocol):
    """A connection whose end (the gateway's close, or a reset) is awaited; keeps what it read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.answer = b""
        self.ended_at = 0.0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writable = asyncio.Event()
        self.writable.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if len(self.answer) < 4096:
            self.answer += data

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended_at = time.monotonic()
        self.writable.set()
        if not self.done.done():
            self.done.set_result(None)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()


class _Stalled:
    """A connection that reads none of its answer: its end is seen in its TCP state, its status
    line peeked at (every POLL_S), never read off the socket; `done` once the gateway closed or
    reset it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.answer = b""
        self.ended_at = 0.0
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self._timer: asyncio.TimerHandle | None = self.loop.call_later(POLL_S, self._poll)

    def _poll(self) -> None:
        sock = self.sock
        if len(self.answer) < 12:
            try:
                self.answer = sock.recv(12, socket.MSG_PEEK)
            except OSError:  # nothing yet (BlockingIOError), or reset
                pass
        try:
            # The gateway's reset, when it aborts the connection, rarely gets through a closed
            # window (its sequence number is past what the client took in), and a client that
            # sends nothing never learns of it: an empty line (which HTTP lets precede a
            # request, RFC 9112 2.2; the gateway reads none while its writes are paused) makes
            # the gateway's kernel answer with a reset the client takes.
            sock.send(b"\r\n")
            ended = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != _ESTABLISHED
        except BlockingIOError:
            ended = False
        except OSError:
            ended = True
        if not ended:
            self._timer = self.loop.call_later(POLL_S, self._poll)
            return
        self._timer = None
        self.ended_at = time.monotonic()
        self.done.set_result(None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.sock.close()


def stall_request(plan: Plan) -> bytes:
    """One valid streamed completion, for the stub engines of scripts/bench_hostile.py's stack:
    all of its events at once (no per-chunk delay), so the gateway has them to write."""
    body = json.dumps({"model": plan.model, "prompt": "hi", "max_tokens": STALL_TOKENS, "stream": True,
                       "stub_delay_ms": 0, "stub_chunk_delay_ms": 0}).encode()
    auth = f"authorization: Bearer {plan.api_key}\r\n" if plan.api_key else ""
    return (f"POST /v1/completions HTTP/1.1\r\nhost: hostile\r\ncontent-type: application/json\r\n{auth}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def tiny_window() -> socket.socket:
    """A non-blocking socket with a receive buffer of a few KB and small segments, set before
    it connects (they set the window and the segment size it announces)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALL_RCVBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, STALL_MSS)
    sock.setblocking(False)
    return sock


class Hostile:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.kinds = {"big": Kind(), "slow": Kind(), "idle": Kind(), "stalled": Kind()}
        self.stopping = False
        # Open connections: their kind, when they started.
        self._live: dict[_Conn | _Stalled, tuple[Kind, float]] = {}

    async def _hold(self, kind: Kind, conn: _Conn, started: float) -> None:
        self._live[conn] = (kind, started)
        kind.open_now += 1
        await conn.done
        kind.open_now -= 1
        del self._live[conn]

    async def _open(self, kind: Kind) -> _Conn | None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Conn, self.plan.host, self.plan.port)
        except OSError:
            kind.connect_errors += 1
            await asyncio.sleep(0.5)
            return None
        kind.opened += 1
        return conn

    async def idle(self) -> None:
        kind = self.kinds["idle"]
        while not self.stopping:
            conn = await self._open(kind)
            if conn is None:
                continue
            started = time.monotonic()
            await self._hold(kind, conn, started)
            kind.ended(started, conn)

    async def slow(self) -> None:
        kind = self.kinds["slow"]
        while not self.stopping:
            conn = await self._open(kind)
            if conn is None or conn.transport is None:
                continue
            started = time.monotonic()
            conn.transport.write(b"GET /health HTTP/1.1\r\nhost: hostile\r\n")
            self._live[conn] = (kind, started)
            kind.open_now += 1
            line = 0
            while not conn.done.done():
                await asyncio.sleep(1.0)
                line += 1
                if not conn.done.done():
                    conn.transport.write(b"x-slow-%d: %d\r\n" % (line, line))
            kind.open_now -= 1
            del self._live[conn]
            kind.ended(started, conn)

    async def big(self, whole: bool) -> None:
        kind = self.kinds["big"]
        while not self.stopping:
            conn = await self._open(kind)
            if conn is None or conn.transport is None:
                continue
            started = time.monotonic()
            self._live[conn] = (kind, started)
            kind.open_now += 1
            sent = 0
            transport = conn.transport
            transport.write(b"POST /v1/completions HTTP/1.1\r\nhost: hostile\r\nx-big: ")
            if whole:
                transport.write(b"v" * 2**20 + b"\r\n\r\n")
                sent = 2**20
            else:
                while sent < BIG_TOTAL and not conn.done.done():
                    await conn.writable.wait()
                    if conn.done.done():
                        break
                    transport.write(PIECE)
                    sent += len(PIECE)
            buffered = transport.get_write_buffer_size()
            await conn.done
            kind.open_now -= 1
            del self._live[conn]
            kind.ended(started, conn, sent - buffered)
            whole = not whole
            await asyncio.sleep(1.0)

    async def stalled(self) -> None:
        kind = self.kinds["stalled"]
        loop = asyncio.get_running_loop()
        requests = stall_request(self.plan) * STALL_STREAMS
        while not self.stopping:
            sock = tiny_window()
            try:
                await loop.sock_connect(sock, (self.plan.host, self.plan.port))
                await loop.sock_sendall(sock, requests)
            except OSError:
                sock.close()
                kind.connect_errors += 1
                await asyncio.sleep(0.5)
                continue
            kind.opened += 1
            conn = _Stalled(sock)
            started = time.monotonic()
            self._live[conn] = (kind, started)
            kind.open_now += 1
            try:
                await conn.done
            finally:
                kind.open_now -= 1
                self._live.pop(conn, None)
                conn.close()
            kind.ended(started, conn)

    async def run(self) -> None:
        plan = self.plan
        tasks: list[asyncio.Task[None]] = []
        makers = ([lambda i=i: self.big(i % 2 == 0) for i in range(plan.big)]
                  + [self.slow] * plan.slow + [self.idle] * plan.idle + [self.stalled] * plan.stalled)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        batch = max(1, round(plan.ramp_per_s / 100))  # every 10 ms
        for start in range(0, len(makers), batch):
            if stop.is_set():
                break
            tasks.extend(asyncio.create_task(make()) for make in makers[start:start + batch])  # type: ignore[operator]
            await asyncio.sleep(0.01)
        await stop.wait()
        self.stopping = True
        now = time.monotonic()
        for conn, (kind, started) in self._live.items():
            if conn.done.done():  # ended by the gateway; its task had not looked yet
                kind.ended(started, conn)
            else:
                kind.open_at_stop_s.append(round(now - started, 3))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def main() -> None:
    plan = Plan(**json.loads(sys.argv[1]))
    out = sys.argv[2]
    raise_nofile()
    hostile = Hostile(plan)
    uvloop.run(hostile.run())
    with open(out, "w") as f:
        json.dump({name: asdict(kind) for name, kind in hostile.kinds.items()}, f)


if __name__ == "__main__":
    main()
