"""Weighted fair queuing of waiting requests: across priority classes by weight, and within a
class across keys, both by tokens (a request counts for what it asks the fleet to do, its
prompt plus its completion budget, not 1).

Pure code: no I/O, no clock, no asyncio. The admission queue (gateway/accounts/admission.py) keeps
one `FairQueue` per requested model and asks it, when room opens, who goes next.

Start-time fair queuing (Goyal, Vin and Cheng, 1996), on two levels:

- Within a class, each waiting request gets a start tag when it arrives:
  `start = max(class clock, its key's last finish)` and its key's finish moves to
  `start + tokens`. The class serves the smallest start first (arrival order on ties), and
  its clock is the start of the request it served last. A key that sends one huge request
  (or many) pushes its own next starts back, not the other keys'.
- Across classes, each class with waiters has a tag; the queue serves the class with the
  smallest tag (the heavier weight on ties). Serving `t` tokens from a class moves the queue's
  clock to the class's tag and the class's tag on by `t / weight`; a class that starts to wait
  again starts at the queue's clock, so it neither banks credit while idle nor pays for
  what it was served long ago. Two backlogged classes of weights 8 and 1 get 8:1 of the
  tokens admitted.

A class's waiters are a heap with lazy deletion: a removed ticket is marked and skipped
when it reaches the top. Queues are hundreds long at most; `victim` scans.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Ticket(Generic[T]):
    """One waiting request: what the caller queued, with its tags."""

    item: T
    cls: str
    key: str
    tokens: float
    seq: int
    start: float
    finish: float
    live: bool = True


@dataclass(slots=True, eq=False)
class _Class(Generic[T]):
    weight: float
    heap: list[tuple[float, int, Ticket[T]]] = field(default_factory=list)
    live: int = 0
    # Within the class: the start of the request it served last, and each key's last finish.
    clock: float = 0.0
    finish_by_key: dict[str, float] = field(default_factory=dict)
    # Across classes: the tag of the class's next service, and the finish of its last.
    tag: float = 0.0
    finish: float = 0.0

    def head(self) -> Ticket[T] | None:
        heap = self.heap
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def emptied(self) -> None:
        """No waiter left: the clock catches up with every key's finish (no key banks credit)."""
        if self.finish_by_key:
            self.clock = max(self.clock, *self.finish_by_key.values())
            self.finish_by_key.clear()
        self.heap.clear()


class FairQueue(Generic[T]):
    """Waiting requests of priority classes (`weights`: name -> weight > 0)."""

    def __init__(self, weights: Mapping[str, float], next_seq: Callable[[], int] | None = None) -> None:
        if not weights or any(w <= 0 for w in weights.values()):
            raise ValueError("a fair queue needs at least one class, every weight > 0")
        self._classes: dict[str, _Class[T]] = {name: _Class(float(w)) for name, w in weights.items()}
        self._next_seq = next_seq or itertools.count().__next__
        self.clock = 0.0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def depth(self, cls: str) -> int:
        return self._classes[cls].live

    def depths(self) -> dict[str, int]:
        return {name: c.live for name, c in self._classes.items()}

    def push(self, item: T, cls: str, key: str = "", tokens: float = 1.0) -> Ticket[T]:
        """Queue `item` of class `cls` for `key`, costing `tokens` (at least 1)."""
        c = self._classes[cls]
        tokens = max(1.0, float(tokens))
        start = max(c.clock, c.finish_by_key.get(key, 0.0))
        ticket = Ticket(item, cls, key, tokens, self._next_seq(), start, start + tokens)
        c.finish_by_key[key] = ticket.finish
        if c.live == 0:
            c.tag = max(self.clock, c.finish)
        c.live += 1
        self._len += 1
        heapq.heappush(c.heap, (start, ticket.seq, ticket))
        return ticket

    def heads(self) -> list[Ticket[T]]:
        """The first waiter of each class with any, in the order the queue would serve them."""
        order = sorted((c.tag, -c.weight, name) for name, c in self._classes.items() if c.live)
        return [head for _, _, name in order if (head := self._classes[name].head()) is not None]

    def first(self) -> Ticket[T] | None:
        heads = self.heads()
        return heads[0] if heads else None

    def pop(self, ticket: Ticket[T]) -> None:
        """Serve `ticket`, the head of its class (from `heads`): it leaves, the clocks move."""
        c = self._classes[ticket.cls]
        if c.head() is not ticket:
            raise ValueError("only the head of a class is served")
        heapq.heappop(c.heap)
        ticket.live = False
        c.clock = ticket.start
        self.clock = c.tag
        c.finish = c.tag + ticket.tokens / c.weight
        c.tag = c.finish
        self._gone(c)

    def remove(self, ticket: Ticket[T]) -> None:
        """`ticket` leaves unserved (timed out, displaced, its client gone); no-op when gone."""
        if not ticket.live:
            return
        ticket.live = False
        c = self._classes[ticket.cls]
        if c.finish_by_key.get(ticket.key) == ticket.finish:
            c.finish_by_key[ticket.key] = ticket.start  # its key is not charged for it
        self._gone(c)

    def _gone(self, c: _Class[T]) -> None:
        c.live -= 1
        self._len -= 1
        if c.live == 0:
            c.emptied()

    def victim(self, weight: float) -> Ticket[T] | None:
        """The newest waiter of the lightest class lighter than `weight`, or None: whom an
        arrival of that weight displaces when the queue is full."""
        lighter = [c for c in self._classes.values() if c.live and c.weight < weight]
        if not lighter:
            return None
        lightest = min(lighter, key=lambda c: c.weight)
        return max((t for _, _, t in lightest.heap if t.live), key=lambda t: t.seq)


__all__ = ["FairQueue", "Ticket"]
