"""A whole answer's bookkeeping runs once the answer is written (`Reply.after`, gateway/request/reply.py)."""

from __future__ import annotations

import json
import time

import structlog
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import RequestTrace
from gateway.request.reply import Answered, Reply

PAYLOAD = json.dumps({"id": "c1", "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}}).encode()


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_bookkeeping_records_the_answer_as_it_was_when_written() -> None:
    """Metrics, tokens and the log line carry the elapsed time to the answer, not to the bookkeeping."""
    metrics = GatewayMetrics()
    fields: dict[str, object] = {"request_id": "r1", "model": "m", "worker": "w1", "stream": False}
    done = Answered(metrics, None, "m", "w1", 200, 0.0123, PAYLOAD, fields, RequestTrace({}))
    assert _sample(metrics, "fleetgate_requests_total", worker="w1") is None  # nothing before it runs
    time.sleep(0.02)
    with structlog.testing.capture_logs() as logs:
        done.run()
    assert _sample(metrics, "fleetgate_requests_total", model="m", worker="w1", status="200") == 1
    assert _sample(metrics, "fleetgate_request_duration_seconds_sum", model="m", stream="false") == 0.0123
    assert _sample(metrics, "fleetgate_tokens_total", model="m", kind="completion") == 5
    [line] = [e for e in logs if e["event"] == "gateway.request"]
    assert line["ms"] == 12.3 and line["status"] == 200 and line["error"] is None
    assert (line["prompt_tokens"], line["completion_tokens"]) == (11, 5)


def test_an_engine_error_is_logged_with_its_code_and_no_usage() -> None:
    metrics = GatewayMetrics()
    body = json.dumps({"error": {"message": "no", "type": "BadRequestError", "code": "bad_thing"}}).encode()
    done = Answered(metrics, None, "m", "w1", 400, 0.001, body, {"request_id": "r2"}, RequestTrace({}))
    with structlog.testing.capture_logs() as logs:
        done.run()
    [line] = [e for e in logs if e["event"] == "gateway.request"]
    assert line["status"] == 400 and line["error"] is not None
    assert (line["prompt_tokens"], line["completion_tokens"]) == (0, 0)


def test_a_failing_bookkeeping_is_logged_and_the_answer_stands() -> None:
    calls: list[str] = []

    def broken() -> None:
        calls.append("ran")
        raise RuntimeError("bug")

    with structlog.testing.capture_logs() as logs:
        Reply(200, [], body=b"{}", after=broken).written()
        Reply(200, [], body=b"{}").written()  # none to run
    assert calls == ["ran"]
    assert [(e["event"], e.get("stage")) for e in logs] == [("gateway.internal_error", "after_answer")]
