"""The worker agent as a real process: lifecycle, drain on SIGTERM, engine death, external engines."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from fleetgate.redis_server import free_port
from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerView
from tests.conftest import ROOT, Fleet, Proc, children, wait_until

MODEL = "agent-model"


def test_sigterm_drains_finishes_in_flight_stops_engine_and_deregisters(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """SIGTERM: the worker turns draining, its in-flight request still completes, then it leaves."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    agent = fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.5")
    fleet.wait_ready(url, "w")
    [engine_pid] = children(agent.pid)
    result: dict[str, object] = {}

    def slow_request() -> None:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 80, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        result["status"] = resp.status_code
        result["tokens"] = resp.json()["usage"]["completion_tokens"]

    thread = threading.Thread(target=slow_request)
    thread.start()
    wait_until(lambda: fleet.workers(url)["w"]["load"]["running"] >= 1, timeout=5)
    agent.send(signal.SIGTERM)
    wait_until(lambda: fleet.workers(url).get("w", {}).get("state") == "draining", timeout=3)
    thread.join(60)
    assert result == {"status": 200, "tokens": 80}
    assert agent.popen.wait(30) == 0
    assert "w" not in fleet.workers(url)
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
    assert "agent.drained" in agent.output()


def test_engine_death_deregisters_and_exits_nonzero(fleet_factory: Callable[[], Fleet]) -> None:
    """If the engine dies under the agent, the agent removes the worker and exits with an error."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    agent = fleet.worker("w", "--model", MODEL)
    fleet.wait_ready(url, "w")
    [engine_pid] = children(agent.pid)
    os.kill(engine_pid, signal.SIGKILL)
    assert agent.popen.wait(15) == 1
    assert "w" not in fleet.workers(url)
    assert "agent.engine_died" in agent.output()


def test_engine_stops_when_the_agent_is_killed(fleet_factory: Callable[[], Fleet]) -> None:
    """SIGKILL of the agent alone does not leave an orphan engine holding the GPU."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    agent = fleet.worker("w", "--model", MODEL)
    fleet.wait_ready(url, "w")
    [engine_pid] = children(agent.pid)
    agent.send(signal.SIGKILL)

    def engine_gone() -> bool:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{engine_pid}/stat").read_text().split()[2] == "Z"

    wait_until(engine_gone, timeout=10)


def test_operator_remove_stops_a_running_agent(fleet_factory: Callable[[], Fleet]) -> None:
    """DELETE /admin/workers/{id} takes the worker out for good: its agent stops its engine and exits."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    agent = fleet.worker("w", "--model", MODEL)
    fleet.wait_ready(url, "w")
    with fleet.admin(url) as admin:
        assert admin.delete("/admin/workers/w").status_code == 200
    assert agent.popen.wait(15) == 0
    assert "agent.removed" in agent.output()
    assert "w" not in fleet.workers(url)


def test_agent_registers_again_after_redis_loses_its_record(fleet_factory: Callable[[], Fleet]) -> None:
    """A Redis restart loses every record; the next heartbeat notices and registers again."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", "--model", MODEL)
    fleet.wait_ready(url, "w")

    async def wipe() -> None:
        redis = connect(fleet.redis_url)
        reg = Registry(redis, fleet.prefix)
        await redis.delete(reg.keys.worker("w"), reg.keys.workers)
        await redis.aclose()

    asyncio.run(wipe())
    wait_until(lambda: fleet.workers(url).get("w", {}).get("state") == "ready", timeout=5)


def test_agent_registers_the_engines_kv_cache_size(fleet_factory: Callable[[], Fleet]) -> None:
    """WorkerInfo.kv_tokens is num_gpu_blocks x block_size as the engine's /metrics states it."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", "--model", MODEL, "--option", "num_gpu_blocks=2106", "--option", "block_size=16")
    fleet.wait_ready(url, "w")
    view = asyncio.run(read_view(fleet, "w"))
    assert view is not None and (view.info.kv_tokens, view.info.block_size) == (33_696, 16)


async def read_view(fleet: Fleet, worker_id: str) -> WorkerView | None:
    """The worker's record straight from Redis (the admin JSON shows only part of it)."""
    redis = connect(fleet.redis_url)
    try:
        return await Registry(redis, fleet.prefix).read(worker_id)
    finally:
        await redis.aclose()


@pytest.fixture
def external(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> Iterator[tuple[Fleet, str, Proc, Proc, str]]:
    """A simulator started by the test (not by fleetgate) and an agent attached to it."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    engine = Proc([sys.executable, "-m", "workers.simulator", "--port", str(port),
                   "--served-model-name", "ext-model", "--time-scale", "0.05"], tmp_path / "engine.log")
    try:
        wait_until(lambda: _up(f"{engine_url}/health"), timeout=20)
        agent = fleet.worker("ext", "--url", engine_url, engine="external")
        fleet.wait_ready(url, "ext")
        yield fleet, url, engine, agent, engine_url
    finally:
        engine.stop()


def test_external_engine_is_attached_not_started_and_dropped_when_it_dies(external) -> None:  # type: ignore[no-untyped-def]
    """--engine external: the agent registers a running engine, and deregisters it when it dies."""
    fleet, url, engine, agent, _ = external
    worker = fleet.workers(url)["ext"]
    assert worker["engine"] == "external:vllm" and worker["model"] == "ext-model"
    resp = httpx.post(f"{url}/v1/completions", json={"model": "ext-model", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "ext"
    engine.kill_group()
    assert agent.popen.wait(20) == 1
    assert "ext" not in fleet.workers(url)


def test_sigterm_to_external_agent_leaves_the_engine_running(external) -> None:  # type: ignore[no-untyped-def]
    """Stopping an agent that attached an external engine never stops that engine."""
    _, _, _, agent, engine_url = external
    agent.send(signal.SIGTERM)
    assert agent.popen.wait(20) == 0
    assert _up(f"{engine_url}/health")


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_spawn_worker_starts_in_background_and_prints_the_id(
    fleet_factory: Callable[[], Fleet], tmp_path: Path,
) -> None:
    """scripts/spawn_worker.sh prints the worker id, leaves a pid file, and the worker serves."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    out = subprocess.run(
        ["bash", "scripts/spawn_worker.sh", "--gpu", "1", "--engine", "sim", "--model", MODEL,
         "--redis-url", fleet.redis_url, "--redis-prefix", fleet.prefix, "--run-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "FLEETGATE_PYTHON": sys.executable},
    )
    worker_id = out.stdout.strip()
    assert worker_id.endswith(tuple("0123456789")) and "-gpu1-sim-" in worker_id
    pid = int((tmp_path / f"{worker_id}.pid").read_text())
    try:
        fleet.wait_ready(url, worker_id)
        resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert resp.headers["x-fleetgate-worker"] == worker_id
    finally:
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: worker_id not in fleet.workers(url), timeout=15)


def test_spawn_worker_dry_run_without_gpu_says_so_and_uses_the_simulator() -> None:
    """--engine auto on a machine without nvidia-smi explains that it falls back to the simulator."""
    out = subprocess.run(
        ["bash", "scripts/spawn_worker.sh", "--gpu", "1", "--dry-run", "--port", "9123"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "FLEETGATE_PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert "no GPU 1 found by nvidia-smi: using the simulator" in out.stdout
    assert "-m workers.simulator" in out.stdout and "--port 9123" in out.stdout


def test_dry_run_for_two_gpus_plans_tensor_parallel_on_both() -> None:
    """--gpu 0,1 gives one vLLM engine over both cards (tensor parallel), shown by --dry-run."""
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--engine", "vllm", "--model", "/models/m", "--gpu", "0,1",
         "--port", "8100", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    )
    assert "--tensor-parallel-size 2" in out.stdout
    assert "CUDA_VISIBLE_DEVICES=0,1" in out.stdout
