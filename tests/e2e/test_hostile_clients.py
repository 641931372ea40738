"""The hostile clients of scripts/bench_hostile.py (fleetgate_tools/hostile.py) against a real
gateway: its process, as the benchmark runs it, over loopback.

The `stalled` kind asks for streams from the benchmark's stub engine and reads none of them;
the gateway's send limit (send_timeout_s, 2 s here) must end every such connection, not any
other limit and not the client: each lasts the limit and a little (the time the writes take
to pause), every one is counted as `send_timeout` in fleetgate_front_refused_total and logged
`gateway.client_stalled`. With the send limit off (or far longer) no connection would end in
the run, and the test fails.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from fleetgate.net import free_port
from tests.conftest import Fleet, wait_until

SEND_S = 2.0  # send_timeout_s
SLACK_S = 2.0  # past the limit: the writes' pause (milliseconds), the client's 0.1 s poll, a loaded machine
STALLED = 3
RUN_S = 2 * SEND_S + 3.0  # every connection ended once at least, most twice


def _refused(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^fleetgate_front_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def test_stalled_clients_are_closed_by_the_send_limit(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> None:
    """Three non-reading connections, reopened as they end, for twice the limit and more: each
    one the gateway ended had its answer's 200 head and lasted from send_timeout_s to
    send_timeout_s plus the slack; the gateway counted each as send_timeout (and nothing else)
    and logged each as gateway.client_stalled."""
    fleet = fleet_factory()
    port = free_port()
    stub_url = f"http://127.0.0.1:{port}"
    fleet._spawn("stub", [sys.executable, "-m", "fleetgate_tools.overhead.stub", "--port", str(port)])
    wait_until(lambda: _up(stub_url), timeout=30)
    proc, url = fleet.gateway("--set", f"send_timeout_s={SEND_S}")
    fleet.worker("stub1", "--url", stub_url, "--flavor", "vllm", engine="external")
    fleet.wait_ready(url, "stub1")
    before = _refused(url)
    out = tmp_path / "hostile.json"
    plan = {"host": "127.0.0.1", "port": int(url.rsplit(":", 1)[1]), "big": 0, "slow": 0, "idle": 0,
            "stalled": STALLED}
    hostile = subprocess.Popen([sys.executable, "-m", "fleetgate_tools.hostile", json.dumps(plan), str(out)])
    try:
        time.sleep(RUN_S)
    finally:
        hostile.send_signal(signal.SIGTERM)
        assert hostile.wait(30) == 0
    stalled = json.loads(out.read_text())["stalled"]
    durations = stalled["durations_s"]
    print(f"stalled connections ended after {sorted(durations)} s (limit {SEND_S:g} s)")
    assert stalled["connect_errors"] == 0 and stalled["opened"] >= STALLED, stalled
    assert len(durations) >= STALLED, stalled  # the gateway ended each connection at least once
    assert all(SEND_S - 0.05 <= d <= SEND_S + SLACK_S for d in durations), durations
    assert stalled["statuses"] == {"200": len(durations)}, stalled  # a stream under way, not a refusal
    assert all(age < SEND_S + SLACK_S for age in stalled["open_at_stop_s"]), stalled
    counted = {r: n - before.get(r, 0) for r, n in _refused(url).items() if n != before.get(r, 0)}
    # (one ended after the client's last look is counted too)
    assert set(counted) == {"send_timeout"} and len(durations) <= counted["send_timeout"] <= stalled["opened"], counted
    logged = [line for line in proc.output().splitlines() if '"gateway.client_stalled"' in line]
    assert len(logged) == counted["send_timeout"], logged


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
