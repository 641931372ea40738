"""gateway/observe/cells.py scrapes exactly as prometheus_client's Counter and Histogram would (but `_created`)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.cells import CounterFamily, HistogramFamily

BUCKETS = (0.05, 0.1, 0.25, 1.0, 2.5)
# Values on, between, under and over the bounds: `le` is inclusive.
OBSERVED = (0.0, 0.05, 0.07, 0.1, 0.1000001, 0.3, 1.0, 2.5, 2.6, 100.0)


def _samples(registry: CollectorRegistry) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    text = generate_latest(registry).decode()
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    )


def _exercise(counter, histogram) -> None:  # type: ignore[no-untyped-def]
    counter.labels("m1", "200").inc()
    counter.labels("m1", "200").inc(2)
    counter.labels("m2", "429").inc(0.5)
    for value in OBSERVED:
        histogram.labels("m1").observe(value)
    histogram.labels("m2").observe(0.2)


def test_the_scrape_matches_prometheus_clients_own_metrics() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    _exercise(Counter("t_requests", "Requests.", ["model", "status"], registry=theirs),
              Histogram("t_seconds", "Durations.", ["model"], buckets=BUCKETS, registry=theirs))
    _exercise(CounterFamily("t_requests", "Requests.", ["model", "status"], registry=ours),
              HistogramFamily("t_seconds", "Durations.", ["model"], buckets=BUCKETS, registry=ours))
    expected = _samples(theirs)
    assert ("t_seconds_bucket", (("le", "0.05"), ("model", "m1")), 2.0) in expected  # 0.0 and 0.05
    assert _samples(ours) == expected
    ours_text = generate_latest(ours).decode()
    for line in generate_latest(theirs).decode().splitlines():
        if line.startswith("#"):  # HELP and TYPE lines, word for word
            assert line in ours_text


def test_every_series_has_its_created_time() -> None:
    registry = CollectorRegistry()
    CounterFamily("t_c", "C.", ["a"], registry=registry).labels("x").inc()
    HistogramFamily("t_h", "H.", ["a"], buckets=(1.0,), registry=registry).labels("x").observe(3)
    created = {s.name for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.name.endswith("_created")}
    assert created == {"t_c_created", "t_h_created"}


def test_a_wrong_number_of_label_values_is_refused() -> None:
    counter = CounterFamily("t_c", "C.", ["a", "b"], registry=None)
    with pytest.raises(ValueError, match="2 label values"):
        counter.labels("only-one")
    with pytest.raises(ValueError, match="finite bucket"):
        HistogramFamily("t_h", "H.", ["a"], buckets=(float("inf"),), registry=None)


def test_a_name_taken_in_the_registry_is_refused() -> None:
    registry = CollectorRegistry()
    CounterFamily("t_c", "C.", ["a"], registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("t_c", "Again.", ["a"], registry=registry)
