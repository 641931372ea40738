"""An engine that hangs at the start of a stream, before its first event: after its response
headers (the simulator's `stall_after_chunks=0`) or before them (`hang_before_headers=1`).

Either way no byte reached the client's body yet: the request is done again on another
worker once the first-event limit (`first_byte_timeout_s`, plus its share per 1k prompt
tokens) has passed, not after `stall_timeout_s` (meant for a stream that stops after it
began) nor never. Real gateway, agents, simulators and Redis.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import Fleet, children, wait_until

MODEL = "hang-model"
FIRST_EVENT_S = 1.0
STALL_S = 20.0  # far longer: a retry that waited for it would fail the timing check


@pytest.fixture
def hanging_pair(fleet_factory: Callable[[], Fleet]) -> Iterator[tuple[Fleet, str, str]]:
    """A gateway (round robin, so one of two requests starts on `a`) over two simulated workers."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--policy", "round_robin", "--set", f"first_byte_timeout_s={FIRST_EVENT_S}",
                           "--set", "first_byte_per_1k_tokens_s=0", "--set", f"stall_timeout_s={STALL_S}",
                           "--set", "breaker_threshold=100")
    for wid in ("a", "b"):
        fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.05")
    fleet.wait_ready(url, "a", "b")
    yield fleet, url, str(fleet.workers(url)["a"]["url"])


def _stream(url: str, request_id: str = "") -> tuple[str, float, list[dict[str, object]], bool]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "ignore_eos": True, "stream": True}
    headers = {"x-request-id": request_id} if request_id else {}
    started = time.monotonic()
    events, done = [], False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers,
                      timeout=STALL_S * 2) as resp:
        assert resp.status_code == 200
        first = resp.headers["x-fleetgate-worker"]
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return first, time.monotonic() - started, events, done


def _request_logs(fleet: Fleet, ids: list[str]) -> dict[str, dict[str, object]]:
    """The gateway's `gateway.request` line of each of `ids` (it is written as the stream ends)."""
    def lines() -> dict[str, dict[str, object]]:
        log = next(p for p in fleet.procs if "gateway" in p.log_path.name).output()
        found = {}
        for line in log.splitlines():
            if '"gateway.request"' in line and (event := json.loads(line)).get("request_id") in ids:
                found[event["request_id"]] = event
        return found if len(found) == len(ids) else {}
    return wait_until(lines, timeout=10)  # type: ignore[return-value]


@pytest.mark.parametrize("fault", [{"stall_after_chunks": 0}, {"hang_before_headers": 1}],
                         ids=["after-headers", "before-headers"])
def test_a_stream_hung_before_its_first_event_is_done_again_elsewhere(
    hanging_pair: tuple[Fleet, str, str], fault: dict[str, int],
) -> None:
    """The request that went to the hung engine is answered whole by the other worker, after
    the first-event limit and well before the stall limit; the other request is not delayed."""
    fleet, url, a_url = hanging_pair
    assert httpx.post(f"{a_url}/sim/faults", json=fault).status_code == 200
    if "stall_after_chunks" in fault:  # the fault as meant: headers, then nothing
        with httpx.Client(timeout=httpx.Timeout(5, read=0.5)) as client, client.stream(
            "POST", f"{a_url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True},
        ) as direct:
            assert direct.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                next(direct.iter_raw())
    ids = ["hang-0", "hang-1"]
    results = dict(zip(ids, (_stream(url, rid) for rid in ids), strict=True))
    # Which request met the hang is read from the gateway's own account of each, not from their
    # times (on a loaded machine a healthy request can take most of the first-event limit too):
    # the hung one started on `a` and was answered by `b` (after headers: a resumed stream, its
    # client's headers name `a`; before them: a second attempt); the other went to `b` at once.
    logs = _request_logs(fleet, ids)
    moved = [rid for rid in ids if logs[rid]["attempts"] != 1 or logs[rid]["final_worker"] != logs[rid]["worker"]]
    assert len(moved) == 1, logs
    [other_id] = [rid for rid in ids if rid not in moved]
    assert (logs[other_id]["worker"], logs[other_id]["final_worker"], logs[other_id]["attempts"]) == ("b", "b", 1)
    assert logs[moved[0]]["final_worker"] == "b", logs[moved[0]]
    hung = [results[moved[0]]]
    assert FIRST_EVENT_S * 0.9 < hung[0][1] < FIRST_EVENT_S + 4, hung[0][1]
    assert hung[0][0] == ("a" if "stall_after_chunks" in fault else "b")
    for _, _, events, done in results.values():
        content = [c for e in events for c in e["choices"] if c["delta"].get("content")]  # type: ignore[index, union-attr]
        finishes = [c for e in events for c in e["choices"] if c.get("finish_reason")]  # type: ignore[index, union-attr]
        assert done and len(content) == 12 and len(finishes) == 1 and len({e["id"] for e in events}) == 1
        assert not any("error" in e for e in events)
    log = next(p for p in fleet.procs if "gateway" in p.log_path.name).output()
    print(f"hang[{next(iter(fault))}]: answered after {hung[0][1]:.2f} s "
          f"(first-event limit {FIRST_EVENT_S} s, stall limit {STALL_S} s)")
    broke = [json.loads(line) for line in log.splitlines()
             if '"gateway.stream_broke"' in line or '"gateway.attempt_failed"' in line]
    assert [e["worker"] for e in broke] == ["a"], broke
    if "stall_after_chunks" in fault:
        assert broke[0]["event"] == "gateway.stream_broke" and broke[0]["sent_chunks"] == 0


def test_a_stream_waiting_for_its_first_event_leaves_an_engine_that_turns_unhealthy(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """The engine sent a stream's headers, then hangs (SIGSTOP): once its agent publishes it
    unhealthy (a few seconds) the stream is done again on the other worker, long before the
    first-event limit (20 s here) would have run out."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--policy", "round_robin", "--set", "first_byte_timeout_s=20",
                           "--set", f"stall_timeout_s={STALL_S}", "--set", "breaker_threshold=100")
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.05") for wid in ("a", "b")}
    fleet.wait_ready(url, "a", "b")
    [engine] = children(agents["a"].pid)
    a_url = str(fleet.workers(url)["a"]["url"])
    assert httpx.post(f"{a_url}/sim/faults", json={"stall_after_chunks": 0}).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "ignore_eos": True, "stream": True}
    stopped = None
    try:
        for _ in range(2):  # round robin: one of two starts on `a`
            pieces, done = 0, False
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
                if resp.headers["x-fleetgate-worker"] == "a":
                    os.kill(engine, signal.SIGSTOP)
                    stopped = time.monotonic()
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        pieces += sum(bool(c["delta"].get("content")) for c in event["choices"])
            assert done and pieces == 12
            if stopped is not None:
                break
        assert stopped is not None
        after_s = time.monotonic() - stopped
    finally:
        os.kill(engine, signal.SIGCONT)
    print(f"hang[after-headers, then unhealthy]: answered {after_s:.2f} s after SIGSTOP (first-event limit 20 s)")
    assert after_s < 10, after_s
    log = next(p for p in fleet.procs if "gateway" in p.log_path.name).output()
    assert "gateway.waiting_interrupted" in log


STALL_AFTER_S = 1.0


def test_a_stream_that_stalls_midway_is_given_up_after_the_stall_limit_not_before(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """An engine that stops after a few events: the gateway waits `stall_timeout_s` of silence
    (never less; at most a tenth more, gateway/request/relay.py's STALL_MARGIN) and then the stream goes
    on on the other worker, the client seeing one stream with a gap of about that length."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--policy", "round_robin", "--set", f"stall_timeout_s={STALL_AFTER_S}",
                           "--set", "breaker_threshold=100")
    for wid in ("a", "b"):
        fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.05")
    fleet.wait_ready(url, "a", "b")
    a_url = str(fleet.workers(url)["a"]["url"])
    assert httpx.post(f"{a_url}/sim/faults", json={"stall_after_chunks": 3}).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "ignore_eos": True, "stream": True}
    for _ in range(2):  # round robin: one of the two starts on `a`
        arrivals: list[float] = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            first = resp.headers["x-fleetgate-worker"]
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    assert "error" not in line, line
        if first == "a":
            break
    assert first == "a"
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert STALL_AFTER_S * 0.99 <= max(gaps) < STALL_AFTER_S * 1.1 + 2.0, gaps
    assert arrivals and sum(g > 0.5 for g in gaps) == 1, gaps  # one stall, then the stream went on


def test_a_stream_queued_in_its_engine_keeps_its_place_past_the_first_event_limit(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """One worker with one seat, taken by a long stream: a second stream waits in the engine's
    queue longer than the first-event limit. The engine's reports say it is waiting there
    (alive, queue 1), so it keeps its place and is answered whole; nothing is sent again and
    the worker's circuit breaker (opened by one failure here) is not charged."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "first_byte_timeout_s=2", "--set", "first_byte_per_1k_tokens_s=0",
                           "--set", f"stall_timeout_s={STALL_S}", "--set", "breaker_threshold=1")
    fleet.worker("q", "--model", MODEL, "--option", "max_num_seqs=1", "--option", "time_scale=1.0")
    fleet.wait_ready(url, "q")
    q_url = str(fleet.workers(url)["q"]["url"])
    long_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                 "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_body, timeout=60) as seat:
        assert seat.status_code == 200
        lines = seat.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs: the seat is taken
        # Another client's request queues in the engine first, and the gateway has the engine's
        # report of it before its stream is sent: reports take a second or two to arrive, as
        # long as the first-event limit itself, so the gateway must not be left to race them.
        other = threading.Thread(target=lambda: httpx.post(
            f"{q_url}/v1/chat/completions", timeout=60,
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}))
        other.start()
        wait_until(lambda: int(fleet.workers(url)["q"]["load"]["waiting"]) >= 1, timeout=10)  # type: ignore[index]
        results: list[tuple[str, float, list[dict[str, object]], bool]] = []
        waiter = threading.Thread(target=lambda: results.append(_stream(url)))
        waiter.start()
        # The precondition, from the engine itself: the gateway's stream waits in its queue too.
        deadline = time.monotonic() + 10
        while httpx.get(f"{q_url}/sim/state").json()["waiting"] < 2:
            assert time.monotonic() < deadline, "the second request never queued in the engine"
            time.sleep(0.05)
        time.sleep(4.5)  # past two first-event limits, waiting in the queue
        assert waiter.is_alive() and not results
    # Closing the long stream frees the seat; the queued ones run.
    other.join(30)
    waiter.join(30)
    [(worker, elapsed, events, done)] = results
    content = [c for e in events for c in e["choices"] if c["delta"].get("content")]  # type: ignore[index, union-attr]
    assert worker == "q" and done and len(content) == 12, (worker, done, events[-1:])
    assert not any("error" in e for e in events)
    assert elapsed > 4
    log = next(p for p in fleet.procs if "gateway" in p.log_path.name).output()
    assert "gateway.first_event_queued" in log
    assert "gateway.stream_broke" not in log and "gateway.attempt_failed" not in log
    assert fleet.workers(url)["q"]["circuit"]["state"] == "closed"
