"""Issue 13's mechanism on an AMX CPU: a tile instruction without permission is SIGILL, and
vllm_launcher's request makes it run. Skipped where the CPU has no AMX (this development
machine is an AMD EPYC); CI and users on Intel Xeons with AMX run it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.real.amx_probe import ROOT, has_amx

pytestmark = pytest.mark.skipif(not has_amx(), reason="this CPU has no AMX")

PROBE = str(ROOT / "tests" / "real" / "amx_probe.py")


def test_a_tile_instruction_without_permission_is_sigill() -> None:
    """What killed vLLM's worker: the instruction, unasked for, ends the process."""
    done = subprocess.run([sys.executable, PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGILL, done.stdout + done.stderr


def test_the_launchers_request_lets_it_run() -> None:
    """After request_amx_permission() (what every vLLM process does through the launcher)
    the same instruction runs."""
    done = subprocess.run([sys.executable, PROBE, "--permit"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "permission granted" in done.stdout
