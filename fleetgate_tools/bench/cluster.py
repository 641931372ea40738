"""Real processes for a benchmark: Redis, gateways (one per policy) and sim worker agents.

Every child runs in its own session with its output in a log file under the run folder;
`Cluster` stops them all (SIGTERM, then SIGKILL to the group) when its `with` block ends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import httpx

from fleetgate_tools.bench import variants
from fleetgate_tools.bench.fleet import FleetSpec
from fleetgate_tools.redis_server import EmbeddedRedis, free_port, ping

ROOT = Path(__file__).resolve().parents[2]


class StartupError(RuntimeError):
    """A gateway or worker did not come up; the message ends with its log's tail."""


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log
        self._log = open(log, "wb")
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd or ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
        )  # fmt: skip

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self._log.close()


def wait_for(what: str, check: Callable[[], bool], procs: list[Proc], timeout: float = 60.0) -> None:
    """Poll `check` until it holds; fail at once, with their log tails, if a process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise StartupError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.tail(800)}" for p in procs)
    raise StartupError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def redis_url_from_env() -> str | None:
    url = os.environ.get("FLEETGATE_REDIS_URL")
    if url:
        return url
    return "redis://127.0.0.1:6379/0" if ping("127.0.0.1", 6379) else None


class Gateway:
    def __init__(self, proc: Proc, url: str, policy: str, routing_ignored: list[str] | None = None) -> None:
        self.proc, self.url, self.policy = proc, url, policy
        # Routing options of the strategy's name this gateway does not know (not given to it).
        self.routing_ignored = routing_ignored or []


class Cluster:
    """Redis (found or embedded), the fleet's workers, and gateways on demand."""

    def __init__(self, spec: FleetSpec, run_dir: Path, *, redis_url: str | None = None) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.prefix = f"fgbench-{uuid.uuid4().hex[:8]}"
        self.admin_token = secrets.token_hex(12)
        self._redis_url = redis_url
        self._embedded: EmbeddedRedis | None = None
        self.workers: list[Proc] = []
        self.gateways: list[Gateway] = []

    @property
    def redis_url(self) -> str:
        assert self._redis_url is not None
        return self._redis_url

    def __enter__(self) -> Cluster:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._redis_url is None:
            self._redis_url = redis_url_from_env()
        if self._redis_url is None:
            self._embedded = EmbeddedRedis().start()
            self._redis_url = self._embedded.url
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.close()

    def close(self) -> None:
        for gw in self.gateways:
            gw.proc.stop()
        self.gateways.clear()
        for w in reversed(self.workers):
            w.stop()
        self.workers.clear()
        if self._embedded:
            self._embedded.stop()
            self._embedded = None

    # ------------------------------------------------------------ workers
    def start_workers(self) -> None:
        adapter_dir = self.run_dir / "adapters"
        for name in self.spec.adapters:
            (adapter_dir / name).mkdir(parents=True, exist_ok=True)
            (adapter_dir / name / "adapter_config.json").write_text('{"r": 8}')
        for w in self.spec.workers:
            argv = [sys.executable, "-m", "workers", *self.spec.worker_argv(w, adapter_dir),
                    "--redis-url", self.redis_url, "--redis-prefix", self.prefix,
                    "--log-level", "warning",
                    "--engine-log", str(self.run_dir / f"{w.id}-engine.log")]  # fmt: skip
            self.workers.append(Proc(w.id, argv, self.run_dir / f"{w.id}.log"))

    # ------------------------------------------------------------ gateways
    def start_gateways(self, policies: list[str]) -> list[Gateway]:
        """One gateway per policy, started together; returns when all see every worker ready.
        A policy with routing options (`fleet+kv_events=false`) starts with them
        (fleetgate_tools/bench/variants.py); options it does not know are left out, with a warning."""
        started = []
        for policy in policies:
            port = free_port()
            how = variants.gateway_args(policy)
            for key in how.ignored:
                warnings.warn(f"{policy}: routing option {key!r} is unknown to this gateway: left out", stacklevel=2)
            argv = [sys.executable, "-m", "gateway", "--port", str(port),
                    "--redis-url", self.redis_url, "--redis-prefix", self.prefix,
                    "--policy", how.policy, *how.args,
                    "--log-level", os.environ.get("FLEETGATE_BENCH_LOG_LEVEL", "warning")]  # fmt: skip
            name = variants.label_file(policy)
            proc = Proc(f"gateway-{name}", argv, self.run_dir / f"gateway-{name}-{port}.log",
                        {"FLEETGATE_ADMIN_TOKEN": self.admin_token})  # fmt: skip
            started.append(Gateway(proc, f"http://127.0.0.1:{port}", policy, how.ignored))
        self.gateways.extend(started)
        n = len(self.spec.workers)
        for gw in started:
            wait_for(f"{gw.proc.name} with {n} ready workers", lambda gw=gw: _ready(gw.url, n),  # type: ignore[misc]
                  timeout=90, procs=[gw.proc, *self.workers])  # fmt: skip
        return started

    def stop_gateways(self, gateways: list[Gateway]) -> None:
        for gw in gateways:
            gw.proc.stop()
            self.gateways.remove(gw)


def _ready(url: str, n: int) -> bool:
    body = httpx.get(url + "/health", timeout=2).json()
    return bool(body.get("ready_workers", 0) >= n)


@contextlib.contextmanager
def running(spec: FleetSpec, run_dir: Path, redis_url: str | None = None) -> Iterator[Cluster]:
    with Cluster(spec, run_dir, redis_url=redis_url) as cluster:
        cluster.start_workers()
        yield cluster
