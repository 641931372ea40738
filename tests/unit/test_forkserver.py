"""The tests' fork server (tests/forkserver.py): a process it starts is the module run as
`python -m` would run it, with its own argv, environment, session, output and exit status,
and a process whose import-time environment would differ is not started from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetgate_tools.redis_server import free_port
from tests.conftest import ROOT, children, wait_until
from tests.forkserver import ForkServer


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer(ROOT)
    assert server.ready, "the fork server's imports started a thread: it would serve nothing"
    yield server


def _gateway() -> list[str]:
    """A gateway that runs until it is stopped (it serves without a Redis to reach)."""
    return [sys.executable, "-m", "gateway", "--port", str(free_port()), "--redis-url", "redis://127.0.0.1:1/0"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def test_a_started_process_is_the_module_with_its_own_argv_env_and_exit_status(
    server: ForkServer, tmp_path: Path,
) -> None:
    log = tmp_path / "gateway.log"
    log.touch()
    argv = [sys.executable, "-m", "gateway", "--no-such-flag"]
    assert server.can_start(argv, _env(FLEETGATE_ADMIN_TOKEN="t"))
    popen = server.start(argv, _env(FLEETGATE_ADMIN_TOKEN="t"), ROOT, log)
    assert popen.pid != os.getpid() and popen.pid not in children(os.getpid())  # the server's child
    assert popen.wait(30) == 2  # argparse's exit status for a bad flag, as `python -m gateway` gives
    assert "unrecognized arguments: --no-such-flag" in log.read_text()


def test_a_started_process_leads_its_own_session_and_dies_of_its_signal(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    log.touch()
    popen = server.start(_gateway(), _env(), ROOT, log)
    assert popen.poll() is None
    assert os.getsid(popen.pid) == popen.pid
    with pytest.raises(subprocess.TimeoutExpired):
        popen.wait(0.2)
    os.kill(popen.pid, signal.SIGKILL)
    assert popen.wait(10) == -signal.SIGKILL
    assert popen.poll() == -signal.SIGKILL


def test_an_environment_read_at_import_is_not_inherited_from_the_server(server: ForkServer) -> None:
    """`FLEETGATE_PURE` chooses compiled or source modules when `gateway` is imported: a process
    asked for with another value is started fresh, as is any other module or program."""
    gateway = [sys.executable, "-m", "gateway"]
    other = "0" if os.environ.get("FLEETGATE_PURE") == "1" else "1"
    assert not server.can_start(gateway, _env(FLEETGATE_PURE=other))
    assert not server.can_start(gateway, _env(PYTHONPATH="/elsewhere"))
    assert not server.can_start([sys.executable, "-m", "workers.simulator"], _env())
    assert not server.can_start(["/bin/true"], _env())
    assert server.can_start(gateway, _env(FLEETGATE_ANY_RUNTIME_SETTING="x"))


def test_output_is_written_through_as_it_happens(server: ForkServer, tmp_path: Path) -> None:
    """As with PYTHONUNBUFFERED: a gateway's first log lines are in its file while it still runs."""
    log = tmp_path / "gateway.log"
    log.touch()
    popen = server.start(_gateway(), _env(), ROOT, log)
    try:
        wait_until(lambda: log.read_text().strip(), timeout=20)
        assert popen.poll() is None
    finally:
        os.kill(popen.pid, signal.SIGKILL)
        popen.wait(10)
