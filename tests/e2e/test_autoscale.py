"""`fleetgate autoscale` on real processes: a gateway, one simulated worker, the autoscaler.

Load rises (closed-loop clients) -> it adds workers; load falls -> it drains them and stops
them once idle; no request fails on the way, and none even needs a retry."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from fleetgate_tools.autoscale_loop import DEFAULT_START
from tests.conftest import ADMIN_TOKEN, Fleet, Proc, wait_until

MODEL = "scale-model"
# A small, slow-ish batch: a handful of clients fills it. Shed at 2x slots, then queued.
SIM = ("--option", "max_num_seqs=4", "--option", "time_scale=0.5")


@dataclass
class Clients:
    """Closed-loop clients: each sends its next request when the last one is answered."""

    url: str
    max_tokens: int = 24
    sent: int = 0
    failed: list[str] = field(default_factory=list)
    _want: int = 0
    _stop: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def set(self, n: int) -> None:
        self._want = n
        while len(self._threads) < n:
            index = len(self._threads)
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop:
                if index >= self._want:
                    time.sleep(0.05)
                    continue
                body = {"model": MODEL, "prompt": f"client {index} says hello", "max_tokens": self.max_tokens}
                try:
                    resp = client.post("/v1/completions", json=body)
                    ok = resp.status_code == 200 and resp.json()["choices"][0]["text"]
                    why = f"{resp.status_code} {resp.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                with self._lock:
                    self.sent += 1
                    if not ok:
                        self.failed.append(why)

    def close(self) -> None:
        self._stop = True
        for thread in self._threads:
            thread.join(70)


def _signal(admin: httpx.Client) -> dict[str, object]:
    data = admin.get("/admin/scaling").json()["data"]
    return next((m for m in data if m["model"] == MODEL), {})


def _workers(admin: httpx.Client) -> dict[str, str]:
    return {str(w["id"]): str(w["state"]) for w in _signal(admin).get("workers", [])}  # type: ignore[attr-defined]


def _events(proc: Proc) -> list[dict[str, object]]:
    out = []
    for line in proc.output().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_autoscaler_adds_workers_under_load_and_retires_them_after(fleet_factory: Callable[[], Fleet],
                                                                   tmp_path: Path) -> None:
    """Ten closed-loop clients saturate one 4-slot worker: the autoscaler adds two workers
    (max 3); when load drops to two clients it drains both and stops them once idle, the base
    worker (not its own) stays; 0 of the requests fail and the gateway retried none."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("base", "--model", MODEL, *SIM)
    fleet.wait_ready(url, "base")
    start = " ".join([
        shlex.quote(sys.executable), "-m", "workers", "--engine", "sim", "--model", "{model}",
        "--id", "{worker_id}", "--port", "{port}", "--redis-url", shlex.quote(fleet.redis_url),
        "--redis-prefix", fleet.prefix, *SIM,
    ])
    scaler = fleet._spawn("autoscale", [
        sys.executable, "-m", "fleetgate_tools.cli", "autoscale", "--gateway", url, "--model", f"{MODEL}=1:3",
        "--start", start, "--up-saturation", "0.75", "--down-saturation", "0.3", "--up-cooldown", "1",
        "--down-after", "2", "--down-cooldown", "2", "--interval", "0.5", "--settle", "1",
        "--log-dir", str(tmp_path / "autoscale"), "--json",
    ], {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    clients = Clients(url)
    timeline: list[tuple[float, int, int, float]] = []
    began = time.monotonic()
    sampling = True

    def sample() -> None:
        with fleet.admin(url) as admin:
            while sampling:
                model = _signal(admin)
                states = [str(w["state"]) for w in model.get("workers", [])]  # type: ignore[attr-defined]
                timeline.append((time.monotonic() - began, states.count("ready"), len(states),
                                 float(model.get("saturation") or 0.0)))  # type: ignore[arg-type]
                time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with fleet.admin(url) as admin:
            clients.set(1)
            time.sleep(3)
            assert list(_workers(admin)) == ["base"], "one client is no reason to scale"
            clients.set(10)
            wait_until(lambda: list(_workers(admin).values()).count("ready") == 3, timeout=45, interval=0.5)
            up_at = time.monotonic() - began
            time.sleep(3)
            assert len(_workers(admin)) == 3, "never past --max"
            clients.set(2)
            wait_until(lambda: list(_workers(admin)) == ["base"], timeout=45, interval=0.5)
            down_at = time.monotonic() - began
            time.sleep(1)
        clients.set(0)
        clients.close()
        sampling = False
        sampler.join(5)
        retries = _retries(url)
        wait_until(lambda: sum(e["event"] == "autoscale.worker_retired" for e in _events(scaler)) == 2, timeout=5)
        events = _events(scaler)
        names = [str(e["event"]) for e in events]
        print(f"\nautoscale: sent {clients.sent}, failed {len(clients.failed)}, gateway retries {retries:g}; "
              f"3 workers ready at {up_at:.1f}s, back to 1 at {down_at:.1f}s")
        print("t(s) ready registered saturation: " + ", ".join(
            f"{t:.0f}:{r}/{n}/{s:.2f}" for t, r, n, s in timeline))
        for e in events:
            if str(e["event"]).startswith("autoscale.") and e["event"] != "autoscale.started":
                print("  ", e["event"], {k: v for k, v in e.items() if k in ("worker", "reason", "how", "s", "exit", "inflight")})
    finally:
        sampling = False
        clients.close()
    assert clients.failed == [], clients.failed[:5]
    assert clients.sent > 50
    assert retries == 0
    assert names.count("autoscale.worker_ready") == 2
    assert names.count("autoscale.worker_draining") == 2
    assert names.count("autoscale.worker_retired") == 2
    retired = [e for e in events if e["event"] == "autoscale.worker_retired"]
    assert all(e["how"] == "sigterm" and e["exit"] == 0 for e in retired), retired
    assert scaler.alive()


def _retries(url: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith("fleetgate_retries_total"))


# How a detached worker is stopped: the agent told through the admin API (the default), or a
# stop command that SIGKILLs agent and engine at once, so only the autoscaler's own wait for
# an idle worker stands between a cut request and the client.
KILL = ('a=$(cat {run}/{{worker_id}}.pid); for e in $(pgrep -P "$a"); do kill -9 -- -"$e"; done; kill -9 "$a"')


@pytest.mark.parametrize("stop", ["admin", "kill"])
def test_default_spawner_detaches_and_is_stopped_after_its_drain(fleet_factory: Callable[[], Fleet],
                                                                 tmp_path: Path, stop: str) -> None:
    """The default start command (scripts/spawn_worker.sh --wait) detaches the agent, so the
    autoscaler holds no process of it: it retires it through the admin API's drain?stop=true
    (the agent drains and exits itself) or a --stop command; even a SIGKILL stop loses
    nothing, as it comes only once the drained worker is idle: no request fails or is retried."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("base", "--model", MODEL, *SIM)
    fleet.wait_ready(url, "base")
    run_dir = tmp_path / "run"
    start = DEFAULT_START + " " + " ".join([
        "--redis-url", shlex.quote(fleet.redis_url), "--redis-prefix", fleet.prefix,
        "--run-dir", shlex.quote(str(run_dir)), *SIM,
    ])
    stop_args = ["--stop", KILL.format(run=shlex.quote(str(run_dir)))] if stop == "kill" else []
    # Requests of a few seconds: a stop that did not wait for the drained worker's one would cut it.
    scaler = fleet._spawn("autoscale", [
        sys.executable, "-m", "fleetgate_tools.cli", "autoscale", "--gateway", url, "--model", f"{MODEL}=1:2",
        "--start", start, *stop_args, "--up-saturation", "0.75", "--up-cooldown", "1", "--down-after", "2",
        "--down-cooldown", "2", "--interval", "0.5", "--log-dir", str(tmp_path / "autoscale"), "--json",
    ], {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN, "FLEETGATE_PYTHON": sys.executable})
    clients = Clients(url, max_tokens=150)
    try:
        with fleet.admin(url) as admin:
            clients.set(8)
            wait_until(lambda: list(_workers(admin).values()).count("ready") == 2, timeout=45, interval=0.5)
            clients.set(2)  # one request on each worker, most of the time: the drain has work to wait for
            wait_until(lambda: list(_workers(admin)) == ["base"], timeout=45, interval=0.5)
        clients.set(0)
    finally:
        clients.close()
        for pidfile in run_dir.glob("*.pid") if run_dir.exists() else []:  # a failed test leaves none behind
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
    retries = _retries(url)
    # The registry lists only `base`: the autoscaler says so at its next poll.
    wait_until(lambda: any(e["event"] == "autoscale.worker_retired" for e in _events(scaler)), timeout=5)
    events = _events(scaler)
    draining = [e.get("inflight") for e in events if e["event"] == "autoscale.worker_draining"]
    retired = [e.get("how") for e in events if e["event"] == "autoscale.worker_retired"]
    print(f"\nautoscale (spawn_worker.sh, stop={stop}): sent {clients.sent}, failed {len(clients.failed)}, "
          f"gateway retries {retries:g}, in flight at the drain {draining}, retired by {retired}")
    assert clients.failed == [], clients.failed[:5]
    assert retries == 0
    assert retired == ["admin stop" if stop == "admin" else "stop command"]
    pid = int(next(run_dir.glob("*.pid")).read_text())
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or
               Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z", timeout=10)
