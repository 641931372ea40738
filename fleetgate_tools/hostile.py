"""Hostile clients, in a process of their own: `python -m fleetgate_tools.hostile PLAN_JSON OUT_JSON`.

Three kinds of connection against one gateway (scripts/bench_hostile.py runs them beside
normal traffic), each reopened as soon as the gateway closes it, until SIGTERM:

- `big`: a head that never ends (one header line sent in 64 KiB pieces, up to 50 MB) or,
  every other time, one oversized head sent whole (1 MiB of header line, then its end);
  each waits a second before the next attempt;
- `slow`: a head sent one header line a second, never finished (slowloris);
- `idle`: a connection that never sends a byte.

For every connection the gateway ends it records how long it lasted (from its first byte
sent, or from its opening for `idle`), what status the gateway answered (0: none), and for
`big` how many bytes it had written when the gateway stopped it. The summary goes to
OUT_JSON. Plain asyncio protocols on uvloop keep the process's own CPU small: on a 2-core
machine it competes with the gateway under test.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import uvloop

BIG_TOTAL = 50 * 2**20
PIECE = b"v" * 65536


@dataclass
class Plan:
    host: str
    port: int
    big: int = 50
    slow: int = 1000
    idle: int = 5000
    ramp_per_s: float = 2000.0  # connections opened a second at start (the listen backlog is finite)


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

    def ended(self, started: float, conn: _Conn, sent: int | None = None) -> None:
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


class Hostile:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.kinds = {"big": Kind(), "slow": Kind(), "idle": Kind()}
        self.stopping = False
        self._live: dict[_Conn, tuple[Kind, float]] = {}  # open connections: their kind, when they started

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

    async def run(self) -> None:
        plan = self.plan
        tasks: list[asyncio.Task[None]] = []
        makers = ([lambda i=i: self.big(i % 2 == 0) for i in range(plan.big)]
                  + [self.slow] * plan.slow + [self.idle] * plan.idle)
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
