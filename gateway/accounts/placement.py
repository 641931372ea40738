"""The gateway's side of affinity homes: it looks keys up before a decision, records what
the decision placed or spilled, and rebalances in the background (about once a second).

The table itself and every rule about it are pure code (gateway/routing/homes.py); this
module holds the clock and the task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import structlog

from fleetgate.background import stop_tasks
from gateway.routing import Choice, Live, RequestFacts, Routes
from gateway.routing.base import kv_in_use
from gateway.routing.homes import Homes

log = structlog.get_logger("gateway.placement")


class Placement:
    def __init__(self, homes: Homes, routes: Callable[[], Routes], tokens: Mapping[str, int],
                 interval_s: float = 1.0, heavy_share: float = 0.3, fresh: Mapping[str, int] | None = None) -> None:
        self.homes = homes
        # The in-flight account, and what engines' last reports do not cover yet (`Live.fresh`).
        self.tokens = tokens
        self.fresh: Mapping[str, int] = fresh if fresh is not None else {}
        self.heavy_share = heavy_share
        self.routes = routes
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def live(self, requests: Live) -> Live:
        """The live account with this table's placed work (all views of live dicts)."""
        return Live(requests.requests, requests.tokens, self.homes, requests.fresh, requests.pending)

    def lookup(self, key: int | None) -> tuple[str | None, str | None, bool]:
        """(home, second home, heavy) of an affinity key; (None, None, False) for a key not placed yet."""
        if key is None:
            return None, None, False
        entry = self.homes.get(key)
        if entry is None:
            return None, None, False
        return entry.home, entry.live_second(time.monotonic()), self.homes.heavy(entry, self.heavy_share)

    def record(self, facts: RequestFacts, choice: Choice, work: float) -> None:
        """What a first attempt's decision means for its key's homes."""
        key = facts.affinity_key
        if key is None or facts.adapter:
            return
        now = time.monotonic()
        worker = choice.slot.id
        need = facts.prompt_tokens + (facts.max_tokens or 0)
        if choice.reason.endswith("-placed") and self.homes.get(key) is None:
            self.homes.place(key, worker, facts.model, facts.prefix_tokens, need, now)
        elif choice.reason.endswith("-spill") and facts.second != worker:
            self.homes.spill(key, worker, now)
            log.info("gateway.affinity_spill", home=facts.home, second=worker, kind=facts.affinity_kind)
        self.homes.note(key, worker, work, need, now)

    # -- background ----------------------------------------------------------------------

    def rebalance(self) -> None:
        by_model = self.routes().by_model
        # The KV each worker holds: its engine's measured figure where it reports one (the
        # account's completion budgets would drown the prefixes the placement is for).
        live = Live({}, self.tokens, None, self.fresh)
        held = {s.id: int(kv_in_use(s, live)) for routes in by_model.values() for s in routes.routable}
        moved = self.homes.rebalance(by_model, time.monotonic(), held)
        if log.is_enabled_for(logging.DEBUG):
            for model, routes in by_model.items():
                log.debug("gateway.affinity_pressures", model=model, pressures=self.homes.pressures(routes.routable),
                          rho=self.homes.rho(), placed=dict(self.homes.placed), prefixes=dict(self.homes.prefixes))
        for key, src, dst in moved:
            log.info("gateway.affinity_moved", key=f"{key:016x}", src=src, dst=dst)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="affinity-rebalance")

    async def stop(self) -> None:
        await stop_tasks(self._task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.rebalance()
            except Exception as exc:  # never let the table's upkeep kill the gateway
                log.warning("gateway.affinity_rebalance_failed", error=repr(exc))


__all__ = ["Placement"]
