"""The collector, set for a process that allocates a little per request and keeps it briefly.

CPython's default thresholds run a young collection every 700 allocations, a few times a
request, and a full one whenever the young ones have promoted enough: a full collection
walks every object the process holds (Litestar's routes, the OpenAPI models, the
snapshot), which at C=64 showed up as the p99's stalls. After start-up the long-lived
objects are frozen out of the collector's sight (`gc.freeze`), and the thresholds are raised
so that young collections are rarer and older ones rarer still. Reference cycles are still
collected; memory stays flat (the soak of scripts/bench_overhead.py shows it).
"""

from __future__ import annotations

import gc

# Young collections every 50,000 net allocations; the older generations each after 20 of
# the one below.
THRESHOLDS = (50_000, 20, 20)


def settle() -> None:
    """Call once start-up has built what lives for the whole process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
