"""The fleet benchmark: seeded workloads, an open-loop load generator, a fleet of real
gateway and simulated-worker processes, and a side-by-side report of routing policies.

`scripts/bench_fleet.py` is the command line; README's "Benchmarks" section the guide.
"""

from fleetgate_tools.bench.arrivals import bursty_arrivals
from fleetgate_tools.bench.fleet import FleetSpec, WorkerSpec, capacity, load_fleet
from fleetgate_tools.bench.loadgen import Outcome, run_requests
from fleetgate_tools.bench.report import format_ratios, format_table, ratios, summarise
from fleetgate_tools.bench.runner import BenchOptions, run_attached, run_fleet
from fleetgate_tools.bench.workloads import (
    WORKLOADS,
    BenchRequest,
    FleetFacts,
    contents,
    read_trace,
    write_trace,
)

__all__ = [
    "WORKLOADS", "BenchOptions", "BenchRequest", "FleetFacts", "FleetSpec", "Outcome",
    "WorkerSpec", "bursty_arrivals", "capacity", "contents", "format_ratios", "format_table",
    "load_fleet", "ratios", "read_trace", "run_attached", "run_fleet", "run_requests",
    "summarise", "write_trace",
]  # fmt: skip
