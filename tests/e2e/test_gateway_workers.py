"""`python -m gateway --workers 2`: two gateway processes on one port, one supervisor.

Real processes: the supervisor, its two children (each a whole gateway bound with
SO_REUSEPORT), a simulated engine behind an agent, real Redis.
"""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.conftest import Fleet, children, wait_until

MODEL = "demo-model"


def _served_by(output: str) -> dict[int, int]:
    """gateway_pid -> requests logged, from the JSON lines of the gateway's log."""
    counts: dict[int, int] = {}
    for line in output.splitlines():
        try:  # two processes share the log file: a long line of one may be cut by the other's
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "gateway.request" and "gateway_pid" in event:
            counts[event["gateway_pid"]] = counts.get(event["gateway_pid"], 0) + 1
    return counts


def test_two_worker_processes_share_the_port_and_stop_on_sigterm(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """Both processes answer requests on the one port (fresh connections spread over them), and
    SIGTERM to the supervisor stops both children and itself, cleanly."""
    fleet: Fleet = fleet_factory()
    proc, url = fleet.gateway("--workers", "2")
    fleet.worker("w1", "--model", MODEL, "--option", "time_scale=0.02")
    pids = wait_until(lambda: len(children(proc.pid)) == 2 and children(proc.pid), timeout=30)
    fleet.wait_ready(url, "w1")
    # Each child refreshes its own snapshot from Redis: wait until every one routes.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def both_serve() -> dict[int, int] | None:
        for _ in range(20):  # one connection each: the kernel picks a child per connection
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert resp.status_code in (200, 503), resp.text
        served = _served_by(proc.output())
        return served if len(served) == 2 else None

    served = wait_until(both_serve, timeout=60, interval=0.2)
    assert set(served) == set(pids), (served, pids)  # type: ignore[arg-type]
    stream = {**body, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=30) as resp:
        assert resp.status_code == 200
        assert any(line == "data: [DONE]" for line in resp.iter_lines())

    proc.send(signal.SIGTERM)
    assert proc.popen.wait(30) == 0
    time.sleep(0.2)
    output = proc.output()
    assert output.count('"gateway.stopped"') == 2, output[-3000:]
    for pid in pids:  # type: ignore[union-attr]
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
