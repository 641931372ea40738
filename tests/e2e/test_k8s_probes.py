"""The chart's probes and preStop hook, run for real: the rendered containers' commands,
args and environment as real processes on loopback (no cluster: the pod IP is 127.0.0.1).

The worker is the chart's simulator pool (tests/data/k8s/values-full.yaml), the gateway
its gateway Deployment. Readiness (`python -m workers.health`) turns true once the agent
registers ready; liveness and the gateway's probes answer 200 on their paths and ports;
the preStop hook drains the agent through its SIGTERM path while a request is in flight,
and the request completes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from conftest import ADMIN_TOKEN, Proc, wait_until
from test_k8s import container, expand, of_kind, rendered
from test_k8s import helm as helm  # the fixture, re-exported

from fleetgate.net import free_port
from fleetgate.schema import Load, WorkerInfo, WorkerView
from workers.health import verdict

ROOT = Path(__file__).resolve().parents[2]
SECRET = "k8s-registration-secret"


def with_port(args: list[str], port: int) -> list[str]:
    """The args with --port's value replaced (the manifests' fixed port may be taken here)."""
    out = list(args)
    out[out.index("--port") + 1] = str(port)
    return out


def local(command: list[str]) -> list[str]:
    """A container command run with this test's Python (the image's `python`)."""
    return [sys.executable, *command[1:]] if command[0] == "python" else command


def pod_env(c: dict[str, Any], values: dict[str, str]) -> dict[str, str]:
    """The container's env with fieldRef/secretKeyRef entries filled from `values` (all must be given)."""
    env = {}
    for e in c["env"]:
        if e["name"] in values:
            env[e["name"]] = values[e["name"]]
        elif "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            assert e["valueFrom"].get("secretKeyRef", {}).get("optional"), f"nothing given for {e['name']}"
    return env


def probe(c: dict[str, Any], name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(local(c[name]["exec"]["command"]), capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=30)


def test_readiness_verdict_reads_the_agents_record() -> None:
    """workers.health is ready only for a fresh `ready` record whose engine passes its probes."""
    info = WorkerInfo(id="w", url="http://10.0.0.1:8001", engine="sim", model="m")
    now = time.time()
    ready = WorkerView(info=info, state="ready", last_heartbeat=now)
    assert verdict(ready, now) == ""
    assert verdict(None, now).startswith("no registry record")
    assert verdict(WorkerView(info=info, state="starting", last_heartbeat=now), now) == "state starting"
    assert verdict(WorkerView(info=info, state="draining", last_heartbeat=now), now) == "state draining"
    assert "probes" in verdict(WorkerView(info=info, state="ready", load=Load(unhealthy=True), last_heartbeat=now), now)
    assert "heartbeat" in verdict(WorkerView(info=info, state="ready", last_heartbeat=now - 30), now)


def test_probes_and_prestop_drain_on_the_rendered_containers(
    helm: str, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """Rendered sim worker + gateway: readiness follows the registry, liveness and /health answer,
    and preStop drains the agent with a request in flight (it completes; the agent exits 0)."""
    docs = rendered(helm, "full")
    (sts,) = [d for d in of_kind(docs, "StatefulSet") if d["metadata"]["labels"]["fleetgate.io/pool"] == "sim"]
    (gw,) = [d for d in of_kind(docs, "Deployment") if container(d)["name"] == "gateway"]
    worker, gateway = container(sts), container(gw)
    worker_id = f"{prefix}-sim-0"
    secrets = {"FLEETGATE_REDIS_URL": redis_url, "FLEETGATE_REDIS_PREFIX": prefix,
               "FLEETGATE_REGISTRATION_SECRET": SECRET, "FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    wenv = pod_env(worker, {**secrets, "POD_IP": "127.0.0.1", "FLEETGATE_WORKER_ID": worker_id})
    genv = pod_env(gateway, secrets)
    engine_port, gateway_port = free_port(), free_port()
    agent = Proc(local([*worker["command"], *with_port(expand(worker["args"], wenv), engine_port)]),
                 tmp_path / "agent.log", wenv)
    gw_proc = Proc(local([*gateway["command"], *with_port(gateway["args"], gateway_port)]), tmp_path / "gw.log", genv)
    reaper = threading.Thread(target=agent.popen.wait, daemon=True)  # kill -0 must not see a zombie
    reaper.start()
    try:
        def ready() -> bool:
            assert agent.alive(), agent.output()
            return probe(worker, "readinessProbe", wenv).returncode == 0

        wait_until(ready, timeout=60, interval=0.5)
        assert probe(worker, "startupProbe", wenv).stdout.strip() == f"worker {worker_id}: ready"
        wrong = probe(worker, "readinessProbe", {**wenv, "FLEETGATE_REGISTRATION_SECRET": "another"})
        assert wrong.returncode == 1 and "signature" in wrong.stdout  # the gateways would not route to it
        live = worker["livenessProbe"]["httpGet"]
        assert httpx.get(f"http://127.0.0.1:{engine_port}{live['path']}", timeout=5).status_code == 200

        base = f"http://127.0.0.1:{gateway_port}"
        gw_path = gateway["readinessProbe"]["httpGet"]["path"]

        def gateway_sees_worker() -> bool:
            assert gw_proc.alive(), gw_proc.output()
            try:
                health = httpx.get(base + gw_path, timeout=2)
            except httpx.HTTPError:
                return False
            return health.status_code == 200 and health.json()["ready_workers"] == 1

        wait_until(gateway_sees_worker, timeout=30, interval=0.3)

        result: dict[str, Any] = {}

        def long_request() -> None:
            body = {"model": "fleetgate-demo-7b", "prompt": "x", "max_tokens": 120, "ignore_eos": True}
            result["response"] = httpx.post(base + "/v1/completions", json=body, timeout=60)

        client = threading.Thread(target=long_request)
        client.start()
        wait_until(lambda: _inflight(base) > 0, timeout=10, interval=0.05)
        hook = " ".join(worker["lifecycle"]["preStop"]["exec"]["command"][2:])
        hook = hook.replace("kill -TERM 1", f"kill -TERM {agent.pid}").replace("kill -0 1", f"kill -0 {agent.pid}")
        started = time.monotonic()
        subprocess.run(["sh", "-c", hook], timeout=sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
                       check=True)
        took = time.monotonic() - started
        client.join(30)
        response = result["response"]
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 120
        assert agent.popen.returncode == 0, agent.output()
        log = agent.output()
        assert "agent.draining" in log and "agent.drained" in log and "agent.deregistered" in log
        assert took < float(worker["args"][worker["args"].index("--drain-grace") + 1])
        after = probe(worker, "readinessProbe", wenv)
        assert after.returncode == 1 and "no registry record" in after.stdout
    finally:
        agent.stop()
        gw_proc.stop()


def _inflight(base: str) -> int:
    try:
        workers = httpx.get(base + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                            timeout=2).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return 0
    return sum(int(w["load"]["inflight"]) for w in workers)
