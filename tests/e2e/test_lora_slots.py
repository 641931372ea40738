"""LoRA placement by the slots the engines report (issue 36), end to end: two simulated vLLM
engines attached `--engine external --flavor sim` (the agents get no slot flag), more adapters
than a whole engine has slots, one gateway."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate_tools.redis_server import free_port
from tests.conftest import Fleet, Proc, wait_until

BASE = "base"
SLOTS = 2
ADAPTERS = [f"lo{i}" for i in range(6)]
CLIENTS = 4  # sequential clients: at most 4 adapters live at once, the fleet's 2 x 2 slots


def engine(fleet: Fleet, name: str, adapter_dir: Path) -> str:
    """A simulated vLLM with 2 LoRA slots and every adapter registered, started by hand."""
    port = free_port()
    argv = [sys.executable, "-m", "workers.simulator", "--port", str(port), "--served-model-name", BASE,
            "--time-scale", "0.25", "--enable-lora", "--max-loras", str(SLOTS), "--max-cpu-loras", "8",
            "--lora-modules", *(f"{a}={adapter_dir}" for a in ADAPTERS)]
    fleet.procs.append(Proc(argv, fleet.tmp / f"{name}.log"))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30)
    return url


@pytest.fixture
def lora_fleet(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> Iterator[tuple[Fleet, str, dict[str, str]]]:
    fleet = fleet_factory()
    (tmp_path / "adapter_config.json").write_text("{}")
    engines = {wid: engine(fleet, f"engine-{wid}", tmp_path) for wid in ("a", "b")}
    _, url = fleet.gateway()
    for wid, engine_url in engines.items():
        fleet.worker(wid, "--url", engine_url, "--flavor", "sim", engine="external")
    fleet.wait_ready(url, *engines)
    yield fleet, url, engines


class Watch(threading.Thread):
    """Reads each engine's adapters with requests in it (/sim/state) every few milliseconds."""

    def __init__(self, engines: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.engines = engines
        self.samples: list[dict[str, tuple[str, ...]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.done.is_set():
                self.samples.append({wid: tuple(client.get(f"{u}/sim/state").json()["lora_adapters"])
                                     for wid, u in self.engines.items()})
                time.sleep(0.01)


def test_adapters_fill_the_slots_the_engines_report(lora_fleet: tuple[Fleet, str, dict[str, str]]) -> None:
    """Slots read from the engines reach the registry, and with more adapters than an engine has
    slots no engine is given more distinct adapters than its slots while the other has room;
    no request is lost."""
    fleet, url, engines = lora_fleet
    workers = fleet.workers(url)
    # The agents were given no slot count: it comes from the engines' lora_requests_info.
    assert {wid: w["lora"]["slots"] for wid, w in workers.items()} == {"a": SLOTS, "b": SLOTS}
    assert {wid: w["lora"]["registered"] for wid, w in workers.items()} == {"a": SLOTS, "b": SLOTS}
    watch = Watch(engines)
    watch.start()
    results: list[tuple[str, int, int]] = []  # (adapter, status, chunks)
    errors: list[BaseException] = []
    seen_active: set[str] = set()

    def client(i: int) -> None:
        try:
            with httpx.Client(timeout=60) as http:
                for phase in range(5):  # each client moves on to another adapter every few requests
                    adapter = ADAPTERS[(i + 2 * phase) % len(ADAPTERS)]
                    for _ in range(3):
                        body = {"model": adapter, "stream": True, "max_tokens": 24, "ignore_eos": True,
                                "messages": [{"role": "user", "content": f"client {i} says hello"}]}
                        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                            chunks = sum(1 for line in resp.iter_lines() if line.startswith("data: {"))
                            results.append((adapter, resp.status_code, chunks))
                        time.sleep(0.05)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for w in fleet.workers(url).values():
            seen_active.update(w["lora"]["active"])
        time.sleep(0.3)
    for t in threads:
        t.join()
    watch.done.set()
    watch.join()
    assert not errors, errors
    assert len(results) == CLIENTS * 5 * 3
    assert all(status == 200 and chunks >= 24 for _, status, chunks in results), results
    # The engines' live adapters reached the registry while they served.
    assert seen_active & set(ADAPTERS)
    overfull = [s for s in watch.samples
                if any(len(s[w]) > SLOTS and any(len(s[o]) < SLOTS for o in s if o != w) for w in s)]
    assert not overfull, overfull[:5]
    assert max(len(names) for s in watch.samples for names in s.values()) >= SLOTS  # slots were used
    # The placer's counters are on /metrics (its slot waits, by adapter, as /admin/workers has them).
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    assert "fleetgate_adapter_slot_waits" in families and "fleetgate_adapter_loads" in families
    waits = {s.labels["adapter"]: s.value for s in families["fleetgate_adapter_slot_waits"].samples
             if s.name.endswith("_total")}
    with fleet.admin(url) as admin:
        listed = admin.get("/admin/workers").json()["adapter_slot_waits"]
    assert waits == {a: float(n) for a, n in listed.items()}
    # Every adapter ran on some engine: more adapters than one engine's slots were placed.
    assert {a for s in watch.samples for names in s.values() for a in names} == set(ADAPTERS)
