"""Start the tests' gateways and agents from an interpreter that has already imported them.

Every e2e test starts real processes (`python -m gateway`, `python -m workers`), and on the
2-core CI machine the suite is CPU-bound: a gateway spends ~0.85 s of CPU importing Litestar,
redis, aiohttp and its own modules before it runs a line of its own, an agent ~0.3 s, and the
suite starts hundreds of each. A fork server per pytest-xdist worker imports them once; each
process is then a fork of it that runs the module as `python -m` would (`runpy`, `__main__`,
its own session, its output in its log file, its own pid, signals and exit status). Only the
interpreter's start-up is shared; what the process does is the product's own code.

What could differ from a fresh interpreter is ruled out, not hoped away:
- environment read at import: the server records every variable its imports look up by name;
  a process asked for with another value of any of them, or of any PYTHON* variable but
  PYTHONUNBUFFERED (which every child gets), is started fresh;
- threads: the server serves nothing if its imports started one (a fork would lose it);
- exit: the child leaves through the interpreter's normal shutdown (atexit, thread joins),
  with the exit status `python -m` gives (SystemExit's code, 1 for an uncaught exception).

The server's parent is the pytest worker: it gets each child's pid, then its exit status
when the server reaps it (`ForkedPopen` offers what the tests use of `subprocess.Popen`).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What the fork server imports up front, and the modules it starts (`python -m <module>`).
# (What `gateway/__main__.py` and `workers/__main__.py` import, not those modules themselves:
# runpy runs a `__main__` afresh and warns when it is imported already.)
PRELOAD = (
    "structlog", "uvicorn", "yaml", "httpx", "fleetgate.logs", "fleetgate.net", "fleetgate.schema",
    "gateway.app", "gateway.front.fastpath", "gateway.front.front_limits", "gateway.front.multiproc",
    "gateway.front.server", "gateway.settings_check",
    "workers.agent", "workers.context", "workers.engine_process", "workers.engines", "workers.gpu",
    "workers.options", "workers.preflight",
)
MODULES = frozenset({"gateway", "workers"})
DISABLE_ENV = "FLEETGATE_TEST_NO_FORKSERVER"


# --- the server (python -m tests.forkserver FD) -------------------------------------------

# A read of every variable at once (`os.environ.copy()`, iterating its items or values, as
# wsgiref does at import) reads none in particular: it is not what decides a module's set-up.
_BULK_READS = frozenset({("copy", os.__file__), ("__iter__", "<frozen _collections_abc>")})


def _import_recording_env(modules: tuple[str, ...]) -> set[str]:
    """Import `modules`; return the environment variables read while doing so."""
    read: set[str] = set()
    environ_type = type(os.environ)
    getitem, contains = environ_type.__getitem__, environ_type.__contains__

    def recording_getitem(self: Any, key: str) -> str:
        caller = sys._getframe(1).f_code
        if (caller.co_name, caller.co_filename) not in _BULK_READS:
            read.add(key)
        return getitem(self, key)

    def recording_contains(self: Any, key: object) -> bool:
        read.add(str(key))
        return contains(self, key)

    environ_type.__getitem__ = recording_getitem  # type: ignore[method-assign]
    environ_type.__contains__ = recording_contains  # type: ignore[method-assign]
    try:
        for module in modules:
            __import__(module)
    finally:
        environ_type.__getitem__ = getitem  # type: ignore[method-assign]
        environ_type.__contains__ = contains  # type: ignore[method-assign]
    return read


def _child(request: Mapping[str, Any], channel: socket.socket, wake: tuple[int, int], settled: int) -> None:
    """In the forked child: become `python -m <module> <args>`; never returns."""
    channel.close()
    signal.set_wakeup_fd(-1)
    for fd in wake:
        os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    err = os.open(request["err"], os.O_WRONLY | os.O_APPEND) if request.get("err") else log
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(err, 2)
    if err != log:
        os.close(err)
    os.close(log)
    os.close(null)
    os.close(settled)  # the server may now say the process started
    # PYTHONUNBUFFERED, as the tests start every process: write through to the log file.
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                         write_through=True)
        for fd in (1, 2)
    )
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module = request["module"]
    sys.argv = [module, *request["args"]]  # runpy puts the module's path first, as -m does
    import runpy

    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)  # the interpreter's own shutdown from here on, as after `python -m`


def serve(fd: int) -> None:
    channel = socket.socket(fileno=fd)
    read_at_import = _import_recording_env(PRELOAD)
    usable = threading.active_count() == 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C reaches the tests, which stop their processes
    channel.sendall(json.dumps({"ready": usable, "env_read": sorted(read_at_import)}).encode() + b"\n")
    buffer = b""
    while True:
        ready, _, _ = select.select([channel, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap every child that ended, and say so
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            channel.sendall(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if channel in ready:
            data = channel.recv(65536)
            if not data:
                return  # the tests' process is gone
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                settled_r, settled_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(settled_r)
                    _child(request, channel, (wake_r, wake_w), settled_w)
                # As Popen(start_new_session=True) returns only after the child's setsid: a
                # test may signal the new process group at once.
                os.close(settled_w)
                os.read(settled_r, 1)  # end of file: the child has its session and its output
                os.close(settled_r)
                channel.sendall(json.dumps({"started": pid}).encode() + b"\n")


# --- the client (in the pytest worker) ----------------------------------------------------

class ForkedPopen:
    """What the tests use of `subprocess.Popen`, for a process the fork server started."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            self.returncode = code
        return self.returncode


class ForkServer:
    """One fork server for this process, started at its first use."""

    def __init__(self, root: Path) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            cwd=root, stdin=subprocess.DEVNULL, env=os.environ.copy(),
        )
        theirs.close()
        self._channel = ours
        self._lines = ours.makefile("rb")
        hello = json.loads(self._lines.readline() or b"{}")
        self.ready = bool(hello.get("ready"))
        self._env_read = set(hello.get("env_read", ()))
        self._base_env = dict(os.environ)
        self._lock = threading.Lock()  # one start at a time: replies come in order
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self._lines:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                else:
                    self._started.append(message["started"])
                self._changed.notify_all()

    def can_start(self, argv: list[str], env: Mapping[str, str]) -> bool:
        if not self.ready or len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m" or argv[2] not in MODULES:
            return False
        differs = {k for k in env.keys() | self._base_env.keys() if env.get(k) != self._base_env.get(k)}
        differs.discard("PYTHONUNBUFFERED")  # what it asks for, the child does (`_child`)
        return not any(k in self._env_read or k.startswith("PYTHON") for k in differs)

    def start(self, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path, err: Path | None = None) -> ForkedPopen:
        """Start `argv` with its output in `log` (its standard error in `err`, when given)."""
        request = {"module": argv[2], "args": argv[3:], "env": dict(env), "cwd": str(cwd), "log": str(log),
                   "err": str(err) if err else None}
        with self._lock, self._changed:
            self._channel.sendall(json.dumps(request).encode() + b"\n")
            if not self._changed.wait_for(lambda: self._started, timeout=30):
                raise RuntimeError("the fork server did not start the process")
            pid = self._started.pop(0)
        return ForkedPopen(self, pid)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
