"""Counters and histograms of the request path, counted in plain Python, exposed through prometheus_client.

prometheus_client's `Counter.inc` and `Histogram.observe` take a thread lock and check
the metric's state on every call (a histogram: one lock for its sum, one for its bucket),
and the gateway makes about seven of them per request, for a process whose request path
runs on one thread. Here a series is a cell of plain numbers (`inc` is an addition,
`observe` a bisect and two additions) and the family is a prometheus_client `Collector`:
at each scrape it turns its cells into the same samples prometheus_client's own
classes would (`<name>_total` and `<name>_created` for a counter; `_bucket`, `_count`,
`_sum` and `_created` for a histogram), rendered by prometheus_client's exposition.

Cells are read and written on the event loop's thread only (the request path and the
`/metrics` handler both run there); that is what makes them safe without a lock.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterCell:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class HistogramCell:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1  # `le`: a value equal to a bound is in it


class _Family(Collector):
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry | None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._cells: dict[tuple[str, ...], CounterCell | HistogramCell] = {}
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]

    def _labels(self, values: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(self.labelnames, values, strict=True))

    def _check(self, values: tuple[str, ...]) -> None:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(values)}")


class CounterFamily(_Family):
    """A labelled counter: `labels(*values)` gives the series' cell (made when first asked for)."""

    kind = "counter"

    def labels(self, *values: str) -> CounterCell:
        cell = self._cells.get(values)
        if cell is None:
            self._check(values)
            cell = self._cells[values] = CounterCell()
        return cell  # type: ignore[return-value]

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        for values, cell in list(self._cells.items()):
            labels = self._labels(values)
            metric.add_sample(self.name + "_total", labels, cell.value)  # type: ignore[union-attr]
            metric.add_sample(self.name + "_created", labels, cell.created)
        yield metric


class HistogramFamily(_Family):
    """A labelled histogram with fixed bucket bounds (`le`, as prometheus_client's)."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry | None) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        if not bounds:
            raise ValueError(f"{name}: a histogram needs at least one finite bucket bound")
        self.bounds = bounds
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> HistogramCell:
        cell = self._cells.get(values)
        if cell is None:
            self._check(values)
            cell = self._cells[values] = HistogramCell(self.bounds)
        return cell  # type: ignore[return-value]

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self.documentation, self.kind)
        for values, cell in list(self._cells.items()):
            labels = self._labels(values)
            total = 0
            for le, count in zip(self._les, cell.counts, strict=True):  # type: ignore[union-attr]
                total += count
                metric.add_sample(self.name + "_bucket", {**labels, "le": le}, total)
            metric.add_sample(self.name + "_count", labels, total)
            metric.add_sample(self.name + "_sum", labels, cell.sum)  # type: ignore[union-attr]
            metric.add_sample(self.name + "_created", labels, cell.created)
        yield metric
