"""gateway/front/front_limits.py: the connection cap within the file descriptors, refusals counted
and logged once per period, answers that close, settings that cannot work refused."""

from __future__ import annotations

import json

from structlog.testing import capture_logs

from gateway.front.front_limits import LOG_EVERY_S, FrontGuard, FrontLimits, problems
from gateway.settings import GatewaySettings
from gateway.settings_check import check


def _limits(**changes: object) -> FrontLimits:
    return FrontLimits.from_settings(GatewaySettings(**changes))  # type: ignore[arg-type]


def test_the_connection_cap_keeps_half_the_descriptors_for_engines() -> None:
    assert FrontGuard(_limits(), nofile=1024).max_connections == (1024 - 256) // 2
    assert FrontGuard(_limits(), nofile=1_000_000).max_connections == 10_000
    assert FrontGuard(_limits(max_connections=50), nofile=1_000_000).max_connections == 50


def test_refusals_are_counted_every_time_and_logged_once_per_period() -> None:
    now = [100.0]
    guard = FrontGuard(_limits(), nofile=65536, clock=lambda: now[0])
    with capture_logs() as logs:
        for _ in range(5):
            guard.refuse("header_timeout")
            guard.refuse("connection_limit")
        now[0] += LOG_EVERY_S
        guard.refuse("idle_timeout")
        guard.refuse("connection_limit")
    assert guard.refused["header_timeout"] == 5 and guard.refused["connection_limit"] == 6
    refused = [e for e in logs if e["event"] == "gateway.front_refused"]
    full = [e for e in logs if e["event"] == "gateway.front_connections_full"]
    assert [e.get("header_timeout") for e in refused] == [1, 4]  # the first at once, then the rest with the next
    assert refused[1]["idle_timeout"] == 1
    assert [e["refused"] for e in full] == [1, 5]


def test_a_refusals_answer_is_an_openai_error_that_closes_the_connection() -> None:
    guard = FrontGuard(_limits(), nofile=65536)
    answer = guard.refuse("header_too_large")
    assert answer is not None
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n") and b"\r\nconnection: close" in head
    assert json.loads(body)["error"]["code"] == "request_header_too_large"
    assert guard.refuse("header_timeout") is None  # closed without an answer
    busy = guard.refuse("connection_limit")
    assert busy is not None and b"\r\nretry-after: 1" in busy
    assert guard.error("body_timeout") is not guard.error("body_timeout")  # a request id may be set on one


def test_a_limit_that_cannot_work_is_refused_at_start() -> None:
    assert problems(_limits()) == []
    assert check(GatewaySettings(max_headers=0, header_timeout_s=-1)) == [
        "`max_headers` must be above 0, got 0", "`header_timeout_s` must be above 0, got -1"]
    assert check(GatewaySettings(send_timeout_s=0)) == ["`send_timeout_s` must be above 0, got 0"]
