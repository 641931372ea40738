"""Small network helpers that both the gateway and the workers use."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
from pathlib import Path

# "LOW-HIGH": hand out ports from this range, each once in turn across every process that
# sets it (the tests do: parallel test workers start dozens of servers at once).
PORT_RANGE_ENV = "FLEETGATE_PORT_RANGE"


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A TCP port that nothing listens on right now; the first of `count` such in a row.

    The OS picks it, unless FLEETGATE_PORT_RANGE is set: then the next free ports of that
    range in a turn that every process on the machine shares. An OS pick is free only
    until someone else binds it, and between the pick and the server's own bind another
    process asking at the same moment may get it too; the shared turn never gives one
    port twice before the whole range went round.
    """
    spec = os.environ.get(PORT_RANGE_ENV)
    if spec:
        low, _, high = spec.partition("-")
        return _next_in_range(host, int(low), int(high), count)
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if all(_bindable(host, port + k) for k in range(1, count)):
            return port
    raise OSError(f"no {count} free ports in a row")


def _bindable(host: str, port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _next_in_range(host: str, low: int, high: int, count: int) -> int:
    """The first of `count` free ports of [low, high) after the last one handed out (a
    counter in a locked file)."""
    size = high - low
    if size < count or count < 1:
        raise ValueError(f"{PORT_RANGE_ENV}: {low}-{high} holds no {count} ports")
    path = Path(tempfile.gettempdir()) / f"fleetgate-ports-{low}-{high}"
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        last = -1
        with contextlib.suppress(ValueError):
            last = int(f.read().strip() or -1)
        for step in range(1, size + 1):
            first = (last + step) % size
            if first + count > size:
                continue
            if all(_bindable(host, low + first + k) for k in range(count)):
                f.seek(0)
                f.truncate()
                f.write(str(first + count - 1))
                return low + first
    raise OSError(f"no {count} free ports in a row in {PORT_RANGE_ENV} {low}-{high}")
