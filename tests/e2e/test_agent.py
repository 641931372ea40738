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

from fleetgate.net import free_port
from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerView
from tests.conftest import ROOT, Fleet, Proc, children, wait_until
from workers.timing import PROFILES, relative_speed

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


def test_agent_registers_whether_its_engine_continues_a_trailing_assistant_message(
    fleet_factory: Callable[[], Fleet], tmp_path: Path,
) -> None:
    """The record says what the engine file declares: the simulator in vLLM's flavour needs
    continue_final_message (False), in LMDeploy's it continues by itself (True); an attached
    LMDeploy-flavoured simulator is declared by --flavor lmdeploy."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    engine, engine_url = _simulator(tmp_path, "--flavor", "lmdeploy", "--time-scale", "0.05")
    try:
        fleet.worker("vl", "--model", MODEL, "--option", "time_scale=0.05")
        fleet.worker("lm", "--model", MODEL, "--option", "time_scale=0.05", "--option", "flavor=lmdeploy")
        fleet.worker("ext", "--url", engine_url, "--flavor", "lmdeploy", engine="external")
        fleet.wait_ready(url, "vl", "lm", "ext")
        views = {w: asyncio.run(read_view(fleet, w)) for w in ("vl", "lm", "ext")}
        declared = {w: (v.info.engine, v.info.continues_trailing_assistant) for w, v in views.items() if v}
        assert declared == {"vl": ("sim", False), "lm": ("sim", True), "ext": ("external:lmdeploy", True)}
    finally:
        engine.stop()


async def read_view(fleet: Fleet, worker_id: str) -> WorkerView | None:
    """The worker's record straight from Redis (the admin JSON shows only part of it)."""
    redis = connect(fleet.redis_url)
    try:
        return await Registry(redis, fleet.prefix).read(worker_id)
    finally:
        await redis.aclose()


def test_operator_remove_of_a_starting_worker_is_not_undone(fleet_factory: Callable[[], Fleet]) -> None:
    """Removing a worker that is still starting stops its agent; it never registers again."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    # Nothing listens there: the agent stays `starting`, beating while it waits for /health.
    agent = fleet.worker("w", "--url", f"http://127.0.0.1:{free_port()}", engine="external")
    wait_until(lambda: fleet.workers(url).get("w", {}).get("state") == "starting", timeout=15)
    with fleet.admin(url) as admin:
        assert admin.delete("/admin/workers/w").status_code == 200
    assert agent.popen.wait(10) == 0
    assert "agent.removed" in agent.output() and "agent.reregister" not in agent.output()
    assert "w" not in fleet.workers(url)


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


def _simulator(tmp_path: Path, *args: str) -> tuple[Proc, str]:
    """A simulator started by the test (an engine fleetgate did not start), once healthy."""
    port = free_port()
    engine = Proc([sys.executable, "-m", "workers.simulator", "--port", str(port),
                   "--served-model-name", "ext-model", *args], tmp_path / f"engine-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _up(f"{url}/health"), timeout=20)
    return engine, url


def test_external_engine_speed_is_measured_not_a_default(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> None:
    """--engine external: no card profile, so a probe batch is timed against the reference card;
    a simulated T4 at time scale 0.25 measures near its profile's speed / 0.25 (not 0.548)."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    engine, engine_url = _simulator(tmp_path, "--profile", "t4-7b", "--time-scale", "0.25")
    try:
        agent = fleet.worker("ext", "--url", engine_url, engine="external")
        fleet.wait_ready(url, "ext")
        view = asyncio.run(read_view(fleet, "ext"))
        assert view is not None and view.info.speed_source == "measured"
        expected = relative_speed(PROFILES["t4-7b"]) / 0.25
        assert 0.6 * expected <= view.info.speed <= 1.4 * expected, (view.info.speed, expected)
        assert "reference_s" in agent.output() and "measured_s" in agent.output()
    finally:
        engine.stop()


def test_declared_speed_wins_and_a_simulated_card_keeps_its_profile(
    fleet_factory: Callable[[], Fleet], tmp_path: Path,
) -> None:
    """--speed X is registered as declared (no probe is sent); a simulated card's speed is its profile's."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    engine, engine_url = _simulator(tmp_path, "--time-scale", "0.05")
    try:
        declared = fleet.worker("ext", "--url", engine_url, "--speed", "0.7", engine="external")
        fleet.worker("sim", "--model", MODEL, "--sim-profile", "t4-7b")
        fleet.wait_ready(url, "ext", "sim")
        ext, sim = (asyncio.run(read_view(fleet, w)) for w in ("ext", "sim"))
        assert ext is not None and (ext.info.speed, ext.info.speed_source) == (0.7, "declared")
        assert sim is not None and (sim.info.speed, sim.info.speed_source) == (0.24, "profile")
        assert "reference_s" not in declared.output()
    finally:
        engine.stop()


def test_failed_warmup_is_a_failed_start(fleet_factory: Callable[[], Fleet]) -> None:
    """An engine that answers /health but fails every request: the agent retries the warm-up,
    then exits non-zero with the engine's last log lines; the worker is never ready."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    agent = fleet.worker("w", "--model", MODEL, "--option", "faults=error_rate=1.0")
    states: set[object] = set()

    def exited() -> bool:
        states.add(fleet.workers(url).get("w", {}).get("state"))
        return not agent.alive()

    wait_until(exited, timeout=30, interval=0.1)
    assert agent.popen.returncode == 1
    assert "ready" not in states and "w" not in fleet.workers(url)
    out = agent.output()
    assert out.count("agent.start_retry") == 2 and "agent.start_failed" in out and "agent.ready" not in out
    assert "warm-up failed 3 times" in out and "Simulated engine failure" in out
    assert "--- the last" in out and "--- end of the engine's log ---" in out


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


@pytest.mark.parametrize(
    ("smi", "gpu", "problem"),
    [
        ("none.txt", "0", "no GPU 0 (nvidia-smi is missing or finds no card)"),
        ("h200.txt", "3", "GPU 3 not found by nvidia-smi (it lists 0)"),
        ("h200.txt", "", "--engine auto needs the card to run on (--gpu N)"),
    ],
    ids=["no-gpu", "gpu-beyond-the-cards", "no-gpu-given"],
)
def test_engine_auto_without_a_usable_gpu_fails_and_suggests_the_simulator(
    smi: str, gpu: str, problem: str, tmp_path: Path,
) -> None:
    """--engine auto never runs the simulator under a real model's name: without the card it
    fails, saying so and how to run a demo; nothing is started."""
    env = {**os.environ, "FLEETGATE_PYTHON": sys.executable,
           "FLEETGATE_NVIDIA_SMI_FILE": str(ROOT / "tests" / "data" / "nvidia-smi" / smi)}
    gpu_args = ["--gpu", gpu] if gpu else []
    for extra in (["--dry-run"], ["--run-dir", str(tmp_path)]):
        out = subprocess.run(
            ["bash", "scripts/spawn_worker.sh", *gpu_args, "--model", "/models/qwen2.5-7b-instruct",
             "--port", "9123", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
        )
        assert out.returncode == 1 and out.stdout == ""
        assert problem in out.stderr and "--engine sim" in out.stderr
    assert list(tmp_path.iterdir()) == []
    out = subprocess.run(
        ["bash", "scripts/spawn_worker.sh", *gpu_args, "--engine", "sim", "--model", "/models/qwen2.5-7b-instruct",
         "--port", "9123", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=True,
    )
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
