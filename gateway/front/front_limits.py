"""Limits on a client's connection: what one client may hold of a gateway process.

Without them one unauthenticated client could take a process's memory and file descriptors
(issue 35): a header line read on without end, connections opened and never used, a head or
a body trickled in a byte at a time. The connection protocol (gateway/front/server.py) and its
parser hooks (gateway/front/hooks.py) apply them; every refusal is counted here, by reason, and
exposed in /metrics as `fleetgate_front_refused_total{reason}`:

    reason                 what the client did                                    answer
    request_line_too_long  a request target longer than max_request_line_bytes   414, close
    header_too_large       a head (target and header lines) over max_header_bytes 431, close
    too_many_headers       more than max_headers header lines                     431, close
    header_timeout         a head not whole header_timeout_s after its first byte close
    idle_timeout           a new connection that sent nothing for idle_timeout_s  close
    body_timeout           a body slower than body_timeout_s (from the request's  408, close
                           first byte) plus one second per body_min_rate bytes
    send_timeout           a client that read none of its answer for send_timeout_s close
                           (the gateway's writes to it paused throughout)
    connection_limit       a connection past max_connections open in the process  503, close

A keep-alive connection closed after idle_timeout_s without a next request is the ordinary
end of a connection, not counted. A refusal's answer goes out only when no other answer is
under way on the connection (one cannot be cut into another's bytes); the connection closes
either way. Refusals are logged once per `LOG_EVERY_S` with their counts, never once per
connection: under attack that log would be the attacker's.

Memory: a head is held by the parser only until it is over max_header_bytes, read by read,
so a connection holds at most that plus one read of the transport (uvloop reads up to
256 KiB at once) before it is refused, two where the head began in a read after the end of
another request; a body at most max_body_bytes (413 beyond); an answer the client does not
read, what was written before the writes paused, for at most send_timeout_s.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.errors import (
    GatewayBusy,
    GatewayError,
    HeaderTooLarge,
    RequestLineTooLong,
    RequestTimeout,
)

log = structlog.get_logger("gateway.front")

REASONS = ("request_line_too_long", "header_too_large", "too_many_headers", "header_timeout", "idle_timeout",
           "body_timeout", "send_timeout", "connection_limit")
# Descriptors kept out of the client connections' share: the listening sockets, Redis, the
# log, tokenizer files. The rest is halved: a client connection with a request in flight
# holds a second descriptor, its engine connection.
RESERVED_FDS = 256
LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """The limits, as gateway/settings.py names them (their defaults and reasons are there)."""

    max_request_line_bytes: int
    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    idle_timeout_s: float
    body_timeout_s: float
    body_min_rate: int
    send_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Any) -> FrontLimits:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


def problems(limits: FrontLimits) -> list[str]:
    """Each limit that cannot work, one line each (gateway/settings_check.py)."""
    return [f"`{f.name}` must be above 0, got {getattr(limits, f.name)}"
            for f in fields(limits) if not getattr(limits, f.name) > 0]


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, as Go's runtime and
    nginx's worker_rlimit_nofile do (the soft limit is often 1,024 while the hard one allows
    far more); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def answer(error: GatewayError) -> bytes:
    """A whole answer that closes its connection, for a client the server refuses itself."""
    body = error.body()
    lines = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in error.headers().items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class FrontGuard:
    """One process's limits, its open client connections, and what it refused, by reason."""

    def __init__(self, limits: FrontLimits, nofile: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        nofile = fd_limit() if nofile is None else nofile
        self.max_connections = max(1, min(limits.max_connections, (nofile - RESERVED_FDS) // 2))
        self.open = 0  # client connections of this process (gateway/front/server.py counts them)
        self.refused = dict.fromkeys(REASONS, 0)
        self.send_paused = 0  # times a client read slower than its answer came (gateway/front/server.py)
        self._clock = clock
        self._unlogged = dict.fromkeys(REASONS, 0)
        self._logged_at = {"refused": -LOG_EVERY_S, "full": -LOG_EVERY_S}
        self._errors: dict[str, Callable[[], GatewayError]] = {
            "request_line_too_long": lambda: RequestLineTooLong(
                f"The request line is over the gateway's limit of {limits.max_request_line_bytes} bytes."),
            "header_too_large": lambda: HeaderTooLarge(
                f"The request's headers are over the gateway's limit of {limits.max_header_bytes} bytes."),
            "too_many_headers": lambda: HeaderTooLarge(
                f"The request has more than the gateway's limit of {limits.max_headers} headers."),
            "body_timeout": lambda: RequestTimeout(
                f"The request body came slower than the gateway allows ({limits.body_timeout_s:g} s, plus "
                f"a second per {limits.body_min_rate} bytes)."),
            "connection_limit": lambda: GatewayBusy(
                "The gateway holds as many connections as it may; try again shortly.", retry_after=1),
        }
        self._answers = {reason: answer(error()) for reason, error in self._errors.items()}

    def error(self, reason: str) -> GatewayError:
        """The error a refusal answers (a new one: a request's id may be set on it)."""
        return self._errors[reason]()

    @classmethod
    def from_settings(cls, settings: Any, nofile: int | None = None) -> FrontGuard:
        return cls(FrontLimits.from_settings(settings), nofile)

    def refuse(self, reason: str) -> bytes | None:
        """Count a refusal; the answer it gets (None: the connection just closes)."""
        self.refused[reason] += 1
        self._unlogged[reason] += 1
        now = self._clock()
        if reason == "connection_limit":
            if now - self._logged_at["full"] >= LOG_EVERY_S:
                self._logged_at["full"] = now
                log.warning("gateway.front_connections_full", max_connections=self.max_connections,
                            open=self.open, refused=self._unlogged["connection_limit"], every_s=LOG_EVERY_S)
                self._unlogged["connection_limit"] = 0
        elif now - self._logged_at["refused"] >= LOG_EVERY_S:
            self._logged_at["refused"] = now
            counts = {r: n for r, n in self._unlogged.items() if n and r != "connection_limit"}
            log.info("gateway.front_refused", every_s=LOG_EVERY_S, open=self.open, **counts)
            for r in counts:
                self._unlogged[r] = 0
        return self._answers.get(reason)

    def collector(self) -> Collector:
        return _FrontCollector(self)


class _FrontCollector(Collector):
    def __init__(self, guard: FrontGuard) -> None:
        self.guard = guard

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        guard = self.guard
        refused = CounterMetricFamily(
            "fleetgate_front_refused", "Client connections refused or closed by a limit of this gateway "
            "process (gateway/front/front_limits.py), by reason.", labels=["reason"])
        for reason, count in guard.refused.items():
            refused.add_metric([reason], count)
        yield refused
        yield CounterMetricFamily(
            "fleetgate_front_send_paused", "Times this gateway process's writes to a client paused: the client "
            "read slower than its answer came. A pause that lasts send_timeout_s closes the connection "
            "(fleetgate_front_refused_total{reason=\"send_timeout\"}).", value=guard.send_paused)
        yield GaugeMetricFamily("fleetgate_front_connections", "Client connections this gateway process holds "
                                "open.", value=guard.open)
        yield GaugeMetricFamily("fleetgate_front_connections_max", "Client connections this gateway process "
                                "accepts at most (max_connections, within its file-descriptor limit).",
                                value=guard.max_connections)
