"""`python -m gateway --workers N`: N gateway processes on one port, one per core.

One Python process serves on one core. With `--workers N` this process becomes a small
supervisor: it starts N children, each a whole gateway (`python -m gateway ... --workers 1`
with its own socket bound with SO_REUSEPORT to the same host and port), so the kernel spreads
new connections over them by hash, and each child keeps its connections on its own core.
The children share state exactly as replicas on different hosts do: the registry snapshot,
in-flight counts (gateway/accounts/inflight.py, one lease per process), adapter state and rate limits
all go through Redis; nothing is shared in memory.

SIGTERM or SIGINT to the supervisor is passed to every child, which drains as a single
gateway does; the supervisor exits when all have. SIGHUP is passed on too (each child reads
its config file again). A child that dies on its own is started
again (at most once a second); one that fails at start-up (a bad setting, the port taken by
another program) stops the whole group, since its siblings would fail alike.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import structlog

log = structlog.get_logger("gateway.multiproc")

# A child that exits this soon after its start failed at start-up, not in service.
_STARTUP_S = 5.0
# A child still up this long after SIGTERM (30 s of drain, then the lifespan's close) is killed.
_STOP_S = 45.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT, so sibling processes can bind the same address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def child_argv(argv: list[str]) -> list[str]:
    """The command line of one child: this one's, with `--workers 1 --reuse-port`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "gateway", *out, "--workers", "1", "--reuse-port"]


class Supervisor:
    def __init__(self, argv: list[str], workers: int, host: str, port: int) -> None:
        self.argv = child_argv(argv)
        self.workers = workers
        self.host = host
        self.port = port
        self.children: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
        self.stopping = False
        self._stop_at = 0.0

    def _start(self, slot: int) -> None:
        proc = subprocess.Popen(self.argv)
        self.children[slot] = (proc, time.monotonic())
        log.info("gateway.worker_started", slot=slot, pid=proc.pid)

    def _signal(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            log.info("gateway.workers_stopping", signal=signal.Signals(signum).name, workers=len(self.children))
            self._stop_at = time.monotonic()
        self.stopping = True
        for proc, _ in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    def _reload(self, _signum: int, _frame: object) -> None:
        """SIGHUP: every child reads the config file again (gateway/tenancy.py)."""
        for proc, _ in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGHUP)

    def run(self) -> int:
        # The port must be free of anything but our own children: a plain bind tells.
        probe = reuse_port_socket(self.host, self.port)
        probe.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signal)
        signal.signal(signal.SIGHUP, self._reload)
        log.info("gateway.workers", workers=self.workers, host=self.host, port=self.port, pid=os.getpid())
        for slot in range(self.workers):
            self._start(slot)
        status = 0
        while self.children:
            time.sleep(0.2)
            if self.stopping and time.monotonic() - self._stop_at > _STOP_S:
                self._kill_stragglers()
            status = self._reap() or status
        log.info("gateway.workers_stopped", code=status)
        return status

    def _kill_stragglers(self) -> None:
        for proc, _ in self.children.values():
            if proc.poll() is None:
                log.warning("gateway.worker_killed", pid=proc.pid, after_s=_STOP_S)
                proc.kill()

    def _reap(self) -> int:
        """Forget the children that exited and start again one that died in service; returns the
        exit code of one that failed at start-up, which stops the group (0: none did)."""
        status = 0
        for slot, (proc, started) in list(self.children.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.children[slot]
            if self.stopping:
                continue
            log.warning("gateway.worker_exited", slot=slot, pid=proc.pid, code=code)
            if time.monotonic() - started < _STARTUP_S:
                status = code or 1
                self._signal(signal.SIGTERM, None)
                continue
            time.sleep(1.0)
            self._start(slot)
        return status
