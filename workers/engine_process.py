"""The engine as a child process: started in its own process group, stopped as a group.

vLLM leaves engine-core processes behind if only its main process is signalled, so the
agent always signals the whole group; and the child asks Linux for SIGTERM should the
agent die first, so that no engine keeps holding a GPU that nobody tracks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import IO, Any


class EngineDied(Exception):
    pass


class EngineProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: str | None, log: Any) -> None:
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self._log_file: IO[bytes] | None = None

    async def start(self) -> None:
        out: int | IO[bytes] | None = None
        if self.log_path:
            self._log_file = open(self.log_path, "ab")  # noqa: ASYNC230 - once, at start
            out = self._log_file
        self.log.info("agent.engine_starting", argv=self.argv)
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdout=out, stderr=asyncio.subprocess.STDOUT if out else None,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )
        self.log.info("agent.engine_started", pid=self.proc.pid)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.returncode is not None:
            raise EngineDied(f"engine exited with code {self.proc.returncode}")

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.log.warning("agent.engine_kill", reason="did not stop within 15 s of SIGTERM")
        # Also stop helpers the engine left in its group (vLLM's engine core, say).
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.proc.wait()
        self.log.info("agent.engine_stopped", code=self.proc.returncode)

    def close(self) -> None:
        if self._log_file:
            self._log_file.close()


def die_with_parent() -> None:
    """In the engine's child process: get SIGTERM if the agent dies (Linux), so a crashed
    agent never leaves an engine holding a GPU that nobody tracks."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
