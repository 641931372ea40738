"""The processes under test: Redis, two stub engines, their agents, the gateway, vllm-router.

Each child runs in its own session with its output in a log file of the run folder
(`fleetgate_tools.bench.cluster.Proc`); `Stack` stops them all when its `with` block ends.
The gateway runs as in production: routing policy `fleet`, an API key, metrics, and
JSON request logs at level info (into its log file).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleetgate_tools.bench.cluster import Proc, wait_for
from fleetgate_tools.redis_server import EmbeddedRedis, free_port, ping

ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (a gateway run with --workers N: the supervisor and its children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in task.read_text().split())
    return out


def _own_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU so far of a process (all its threads) and its live descendants, from /proc."""
    return sum(_own_cpu(p) for p in tree(pid))


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1])
    return total * PAGE / 2**20


def find_router(explicit: str | None) -> str | None:
    """The vllm-router executable: --router, else .venv-router's, else one on PATH."""
    if explicit:
        return explicit if Path(explicit).exists() or shutil.which(explicit) else None
    for root in (ROOT, Path.cwd()):
        local = root / ".venv-router" / "bin" / "vllm-router"
        if local.exists():
            return str(local)
    return shutil.which("vllm-router")


@dataclass
class Target:
    """Where the load generator sends requests, and the process whose CPU it costs."""

    name: str
    urls: list[str]
    pid: int | None = None
    api_key: str = ""


@dataclass
class Stack:
    run_dir: Path
    stubs: int = 2
    router: str | None = None
    router_policy: str = "cache_aware"
    # One fleetgate target per count: "fleetgate" for 1 process, "fleetgate-wN" for `--workers N`.
    gateway_workers: tuple[int, ...] = (1,)
    redis_url: str | None = None
    # Another checkout of fleetgate (its root folder): its gateway is one more target, "baseline",
    # measured in the same rounds (before/after a change, side by side).
    baseline: Path | None = None
    # Run each gateway under valgrind's callgrind, instrumentation off until asked for
    # (scripts/bench_instructions.py): its dumps go to <run_dir>/callgrind.<target>.out[.N].
    callgrind: bool = False
    # More arguments for every fleetgate gateway (`--set KEY=VALUE`...).
    gateway_args: tuple[str, ...] = ()
    # More one-process gateways of this checkout on the same workers, by target name.
    extra_gateways: tuple[str, ...] = ()
    api_key: str = field(default_factory=lambda: "fg-bench-" + secrets.token_hex(8))
    procs: list[Proc] = field(default_factory=list)
    targets: dict[str, Target] = field(default_factory=dict)
    _redis: EmbeddedRedis | None = None

    def __enter__(self) -> Stack:
        self.run_dir = self.run_dir.resolve()  # a baseline gateway runs in its own checkout's folder
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> Proc:
        proc = Proc(name, argv, self.run_dir / f"{name}.log", env, cwd)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        if self.redis_url is None:
            url = os.environ.get("FLEETGATE_REDIS_URL")
            if not url and ping("127.0.0.1", 6379):
                url = "redis://127.0.0.1:6379/0"
            if not url:
                self._redis = EmbeddedRedis().start()
                url = self._redis.url
            self.redis_url = url
        prefix = f"fgoverhead-{uuid.uuid4().hex[:8]}"
        py = sys.executable
        stub_urls = []
        for n in range(1, self.stubs + 1):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            stub_urls.append(url)
            stub = self._spawn(f"stub{n}", [py, "-m", "fleetgate_tools.overhead.stub", "--port", str(port)])
            wait_for(f"stub{n}", lambda url=url: httpx.get(url + "/health").status_code == 200, [stub])  # type: ignore[misc]
            self._spawn(f"agent-stub{n}", [
                py, "-m", "workers", "--engine", "external", "--url", url, "--flavor", "vllm",
                "--id", f"stub{n}", "--redis-url", self.redis_url, "--redis-prefix", prefix,
                "--log-level", "warning",
            ])
        self.targets["direct"] = Target("direct", stub_urls)
        for n in self.gateway_workers:
            name = "fleetgate" if n == 1 else f"fleetgate-w{n}"
            self.targets[name] = self._gateway(name, n, prefix)
        for name in self.extra_gateways:
            self.targets[name] = self._gateway(name, 1, prefix)
        if self.baseline is not None:
            self.targets["baseline"] = self._gateway("baseline", 1, prefix, self.baseline)
        if self.router:
            port = free_port()
            r_url = f"http://127.0.0.1:{port}"
            router = self._spawn("vllm-router", [
                self.router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *stub_urls,
                "--policy", self.router_policy, "--log-level", "warning",
                "--prometheus-port", str(free_port()), "--log-dir", str(self.run_dir / "router-logs"),
            ])
            wait_for("vllm-router", lambda: httpx.get(r_url + "/v1/models").status_code == 200, [router])
            self.targets["vllm-router"] = Target("vllm-router", [r_url], router.popen.pid)

    def _gateway(self, name: str, workers: int, prefix: str, checkout: Path | None = None) -> Target:
        assert self.redis_url is not None
        port = free_port()
        gw_url = f"http://127.0.0.1:{port}"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={self.run_dir / f'callgrind.{name}.out'}"] if self.callgrind else []
        gateway = self._spawn(name, [
            *valgrind, sys.executable, "-m", "gateway", "--port", str(port), "--redis-url", self.redis_url,
            "--redis-prefix", prefix, "--policy", "fleet", "--workers", str(workers), *self.gateway_args,
        ], {"FLEETGATE_API_KEYS": self.api_key, "FLEETGATE_ADMIN_TOKEN": secrets.token_hex(8),
            **({"PYTHONPATH": str(checkout)} if checkout else {})}, cwd=checkout)

        def ready() -> bool:
            # With --workers N each connection may reach another process: every one must be ready.
            if len(tree(gateway.popen.pid)) < workers + (workers > 1):
                return False
            return all(httpx.get(gw_url + "/health").json().get("ready_workers", 0) >= self.stubs
                       for _ in range(4 * workers))

        wait_for(f"{name} with {self.stubs} ready workers", ready, self.procs, timeout=600 if self.callgrind else 90)
        return Target(name, [gw_url], gateway.popen.pid, self.api_key)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
