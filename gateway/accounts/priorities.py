"""Priority classes: which class a request is in, and what the class changes.

A request's class is its key's (`key_priority`, else `default_priority`); the
`x-fleetgate-priority` header may name another class of the same or a lower weight (a key
may always lower its own priority, never raise it above its configured class). An unknown
name, or one above the key's class, is a 400 that lists what the key may use.

What a class changes (docs/operations.md, "Priorities and fairness"):

- `weight`: its share of the admissions while the fleet is saturated (gateway/accounts/fairqueue.py),
  and the order of shedding: a full queue makes room for an arrival by refusing the newest
  waiter of the lightest class lighter than it.
- `share`: a class below 1 counts a worker full at that share of the gateway's limit
  (`FullAt.share`), so a flood of it leaves the rest of every worker to the classes above.
- `queue_timeout_s`: how long its requests wait for room before a 429.

`key_class` is the one look-up of a key's configured class; a per-key record (live key
configuration) can replace it without touching the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.errors import InvalidRequest
from gateway.routing import FullAt
from gateway.settings import GatewaySettings, PriorityClass
from gateway.tenants.auth import digest

if TYPE_CHECKING:
    from gateway.accounts.admission import Admission

HEADER = "x-fleetgate-priority"


@dataclass(frozen=True, slots=True)
class Priority:
    name: str
    weight: float = 1.0
    share: float = 1.0
    queue_timeout_s: float | None = None

    def full_at(self, base: FullAt) -> FullAt:
        return base if self.share >= 1.0 else replace(base, share=self.share)


class Priorities:
    """The configured classes, and the class of each request."""

    def __init__(
        self, classes: Mapping[str, PriorityClass], key_class: Callable[[str], str], default: str,
        enabled: bool = True,
    ) -> None:
        self.classes = {name: Priority(name, c.weight, c.share, c.queue_timeout_s) for name, c in classes.items()}
        for p in self.classes.values():
            if p.weight <= 0 or not 0 < p.share <= 1 or (p.queue_timeout_s is not None and p.queue_timeout_s < 0):
                raise ValueError(f"priority class `{p.name}`: weight must be > 0, share in (0, 1], "
                                 "queue_timeout_s >= 0")
        if default not in self.classes:
            raise ValueError(f"default_priority `{default}` is not a priority class ({self.names})")
        self.key_class = key_class
        self.default = self.classes[default]
        # False with the settings' defaults: the queue stays FIFO per model (no key fairness).
        self.enabled = enabled

    @property
    def names(self) -> str:
        return ", ".join(sorted(self.classes, key=lambda n: -self.classes[n].weight))

    @property
    def weights(self) -> dict[str, float]:
        return {name: p.weight for name, p in self.classes.items()}

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> Priorities:
        """Raises ValueError on a class name that is not configured (fail at start-up)."""
        by_key = _key_ids(settings.key_priority, settings.api_keys)
        for name in by_key.values():
            if name not in settings.priority_classes:
                raise ValueError(f"key_priority names `{name}`, which is not a priority class "
                                 f"({', '.join(settings.priority_classes)})")
        default = settings.default_priority
        enabled = bool(by_key) or settings.priority_classes != {"default": PriorityClass()}
        return cls(settings.priority_classes, lambda key_id: by_key.get(key_id, default), default, enabled)

    def priority_of(self, key_id: str, header: str | None) -> Priority:
        """The class of a request by `key_id` that sent `header` (None: no header)."""
        own = self.classes.get(self.key_class(key_id), self.default)
        if not header:
            return own
        asked = self.classes.get(header.strip().lower())
        allowed = ", ".join(n for n in sorted(self.classes, key=lambda n: -self.classes[n].weight)
                            if self.classes[n].weight <= own.weight)
        if asked is None:
            raise InvalidRequest(f"Unknown priority class `{header}` in `{HEADER}`; this key may use: {allowed}.",
                                 param=HEADER, code="invalid_priority")
        if asked.weight > own.weight:
            raise InvalidRequest(f"This key's priority class is `{own.name}`; `{HEADER}` may name it or a lower "
                                 f"one ({allowed}), not `{asked.name}`.", param=HEADER, code="invalid_priority")
        return asked


def _key_ids(key_priority: Mapping[str, str], api_keys: tuple[str, ...]) -> dict[str, str]:
    """`key_priority` by key id (gateway/tenants/auth.py: the key digest's first 4 bytes in hex): an
    entry is a key id, or the last 4 or more characters of one configured key."""
    ids = {key: digest(key)[:4].hex() for key in api_keys}
    out: dict[str, str] = {}
    for name, cls in key_priority.items():
        matches = {kid for kid in ids.values() if kid == name} or {
            kid for key, kid in ids.items() if len(name) >= 4 and key.endswith(name)}
        if len(matches) != 1:  # a mistyped entry fails loudly, never silently leaves a key default
            raise ValueError(f"key_priority entry `{name[-4:]}` is the id or the end of "
                             f"{'no' if not matches else 'more than one'} configured API key")
        out[matches.pop()] = cls
    return out


class PriorityCollector(Collector):
    """Queue depth and sheds per class, read from the admission queue when scraped (labels:
    the configured classes only)."""

    def __init__(self, admission: Admission, names: list[str]) -> None:
        self.admission = admission
        self.names = names

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("fleetgate_priority_queue_depth", "Requests waiting in this gateway's "
                                  "admission queue, by priority class.", labels=["priority"])
        depths = self.admission.class_depths()
        for name in self.names:
            depth.add_metric([name], depths.get(name, 0))
        yield depth
        shed = CounterMetricFamily("fleetgate_priority_shed", "Requests the admission queue refused with 429, "
                                   "by priority class and reason (queue_full, queue_timeout).",
                                   labels=["priority", "reason"])
        for (name, reason), count in sorted(self.admission.sheds.items()):
            shed.add_metric([name, reason], count)
        yield shed


__all__ = ["HEADER", "Priorities", "Priority", "PriorityCollector"]
