"""How long a whole answer's head may wait on an engine that is busy (`Patience`): a plain
deadline of gateway/engines/engine_conn.py's `Response.head`, extended while the engine says it
holds requests waiting."""

from __future__ import annotations

from collections.abc import Callable


class Patience:
    """A head wait cut before its limit unless its engine is busy: at `cut_s` from `start` (the
    loop's time), and at each `cut_s` after while `queued()` says the engine holds requests
    waiting, up to `most_s` from `start` in all. (A whole answer queued in its engine may wait as
    long as a stream's first event: gateway/request/attempts.py.) No timer or task of its own:
    `Response.head`'s one timer per wait asks it when a check is due, and raises TimeoutError
    with `cut` set when it says no."""

    __slots__ = ("at", "cut", "cut_s", "end", "queued")

    def __init__(self, start: float, cut_s: float, most_s: float, queued: Callable[[], bool]) -> None:
        self.cut_s = cut_s
        self.queued = queued
        self.at = start + cut_s  # the next check
        self.end = start + most_s
        self.cut = False  # the wait was cut at a check: no answer in time, and no queue reported

    def goes_on(self, now: float) -> bool:
        """At a check: whether the wait goes on (then `at` is the next check)."""
        left = self.end - now
        if left > 0 and self.queued():
            self.at = now + min(self.cut_s, left)
            return True
        self.cut = True
        return False


__all__ = ["Patience"]
