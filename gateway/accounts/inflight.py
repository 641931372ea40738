"""Requests in flight per worker: this gateway's, exact, plus the other replicas', shared through Redis.

Beside the count, the KV tokens those requests hold by the gateway's estimate (each
request's own prompt tokens and completion budget, plus a shared prefix once per worker
while any request using it is in flight there): routing's stand-in for an engine that does
not measure its KV use.

Where the engine does measure it, its report is the truth, and the gateway only predicts
how it changed since (`fresh`, per worker): each request sent adds its own prompt and the
growth it can make before the next report (its shared prefix too when no request in flight
there holds it already), and each that ends takes as much back out, whether the report
counted it or not (an ended request frees at least that). Each new report, seen in a new
fleet snapshot (`reported`), starts the count again. It can go below zero: completions freed
more than arrivals took.

The request path only touches the local dicts (an increment and a decrement). A
background task publishes the local counts about ten times a second under a lease
and reads the other gateways' sum, so routing on every replica sees the whole
fleet's in-flight work without a Redis round trip per request, and a gateway that
crashes leaks nothing (its counts expire with its lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import structlog

from fleetgate.background import Outage, repeat, stop_tasks
from fleetgate.registry import Registry
from fleetgate.schema import WorkerView

log = structlog.get_logger("gateway.inflight")

# Token counts travel in the same Redis hash as the request counts, under these prefixes.
TOKENS_FIELD = "~t:"
FRESH_FIELD = "~f:"
PENDING_FIELD = "~p:"


class _Summed(Mapping[str, int]):
    """Local + remote counts per worker (requests, or KV tokens), read like a dict."""

    def __init__(self, local: dict[str, int], remote: dict[str, int]) -> None:
        self.local = local
        self.remote = remote

    def get(self, worker_id: str, default: int = 0) -> int:  # type: ignore[override]
        return self.local.get(worker_id, 0) + self.remote.get(worker_id, 0) or default

    def __getitem__(self, worker_id: str) -> int:
        return self.get(worker_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self.local.keys() | self.remote.keys())

    def __len__(self) -> int:
        return len(self.local.keys() | self.remote.keys())


class SharedInflight(_Summed):
    """Requests in flight per worker, this gateway's (`local`) and the other replicas' (`remote`)."""

    def __init__(self, registry: Registry, gateway_id: str, interval_s: float = 0.1,
                 lease_s: float = 3.0) -> None:
        super().__init__({}, {})
        self.registry = registry
        self.gateway_id = gateway_id
        self.interval_s = interval_s
        self.lease_s = lease_s
        self.local_tokens: dict[str, int] = {}
        self.remote_tokens: dict[str, int] = {}
        self.tokens = _Summed(self.local_tokens, self.remote_tokens)
        # The same sums as plain dicts, kept current by `add`, `done` and each sync: what routing
        # reads (`Live`), a C-level dict lookup per worker instead of a method call.
        self.total: dict[str, int] = {}
        self.total_tokens: dict[str, int] = {}
        # KV tokens taken (+) and freed (-) by requests since each worker's last engine report
        # (this gateway's, the others', the sum routing reads), and that report's time.
        self.local_fresh: dict[str, int] = {}
        self.remote_fresh: dict[str, int] = {}
        self.total_fresh: dict[str, int] = {}
        self._report_ts: dict[str, float] = {}
        # Prompt tokens still to prefill per worker: those its engine does not hold of the
        # streamed requests in flight there whose first token has not come (this gateway's,
        # the others', the sum routing reads). A first token ends a request's prefill.
        self.local_pending: dict[str, int] = {}
        self.remote_pending: dict[str, int] = {}
        self.total_pending: dict[str, int] = {}
        # (worker, affinity key) -> requests in flight there that share that key's prefix.
        self._sharing: dict[tuple[str, int], int] = {}
        # Called after every completion (the admission queue re-checks for room).
        self.on_done: Callable[[], None] | None = None
        self._remote_at = 0.0
        self._task: asyncio.Task[None] | None = None

    # -- the request path ----------------------------------------------------------

    def add(self, worker_id: str, tokens: int = 0, key: int | None = None, prefix: int = 0, fresh: int = 0) -> None:
        """One request in flight on `worker_id`, holding `tokens` of its own and sharing the
        `prefix` tokens of affinity `key` with the others in flight there; of its own, `fresh`
        before the engine's next report."""
        n = self.local[worker_id] = self.local.get(worker_id, 0) + 1
        self.total[worker_id] = n + self.remote.get(worker_id, 0)
        if key is not None and prefix:
            sharing = self._sharing.get((worker_id, key), 0)
            self._sharing[(worker_id, key)] = sharing + 1
            if sharing == 0:
                tokens += prefix
                fresh += prefix
        if tokens:
            held = self.local_tokens[worker_id] = self.local_tokens.get(worker_id, 0) + tokens
            self.total_tokens[worker_id] = held + self.remote_tokens.get(worker_id, 0)
        if fresh:
            self._fresh(worker_id, fresh)

    def done(self, worker_id: str, tokens: int = 0, key: int | None = None, prefix: int = 0,
             fresh: int = 0) -> None:
        """The request `add` counted (same arguments) has finished: its engine frees at least
        its `fresh` tokens (and the prefix, were it the last to share it there)."""
        _store(self.local, self.remote, self.total, worker_id, self.local.get(worker_id, 1) - 1)
        if key is not None and prefix:
            sharing = self._sharing.get((worker_id, key), 1) - 1
            if sharing > 0:
                self._sharing[(worker_id, key)] = sharing
            else:
                self._sharing.pop((worker_id, key), None)
                tokens += prefix
                fresh += prefix if fresh else 0
        if fresh:
            self._fresh(worker_id, -fresh)
        if tokens:  # none left where no request is
            held = self.local_tokens.get(worker_id, 0) - tokens if worker_id in self.local else 0
            _store(self.local_tokens, self.remote_tokens, self.total_tokens, worker_id, held)
        if self.on_done is not None:
            self.on_done()

    def pend(self, worker_id: str, tokens: int) -> None:
        """`tokens` more prompt tokens (negative: fewer) for `worker_id`'s engine to prefill."""
        _store(self.local_pending, self.remote_pending, self.total_pending, worker_id,
               self.local_pending.get(worker_id, 0) + tokens)

    def _fresh(self, worker_id: str, change: int) -> None:
        if n := self.local_fresh.get(worker_id, 0) + change:
            self.local_fresh[worker_id] = n
        else:
            self.local_fresh.pop(worker_id, None)
        if t := n + self.remote_fresh.get(worker_id, 0):
            self.total_fresh[worker_id] = t
        else:
            self.total_fresh.pop(worker_id, None)

    def reported(self, workers: Iterable[WorkerView]) -> None:
        """The workers of a new fleet snapshot: one with a new engine report starts its `fresh`
        count again (the report covers what was sent before it)."""
        seen = self._report_ts
        for view in workers:
            worker_id, ts = view.info.id, view.load.ts
            if seen.get(worker_id) == ts:
                continue
            seen[worker_id] = ts
            if self.local_fresh.pop(worker_id, None) is not None:
                if remote := self.remote_fresh.get(worker_id, 0):
                    self.total_fresh[worker_id] = remote
                else:
                    self.total_fresh.pop(worker_id, None)

    # -- background sync --------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="inflight-sync")

    async def stop(self) -> None:
        await stop_tasks(self._task)
        with contextlib.suppress(Exception):
            await self.registry.forget_gateway(self.gateway_id)

    async def sync(self) -> None:
        counts: dict[str, int] = dict(self.local)
        counts.update({TOKENS_FIELD + w: t for w, t in self.local_tokens.items()})
        counts.update({FRESH_FIELD + w: t for w, t in self.local_fresh.items()})
        counts.update({PENDING_FIELD + w: t for w, t in self.local_pending.items()})
        await self.registry.publish_inflight(self.gateway_id, counts, self.lease_s)
        remote = await self.registry.read_inflight(exclude_gateway=self.gateway_id)
        self._set_remote(remote)
        self._remote_at = time.monotonic()

    def _set_remote(self, remote: dict[str, int]) -> None:
        # In place: routing's `Live` view and the `tokens` mapping hold these very dicts.
        n = len(TOKENS_FIELD)
        self.remote.clear()
        self.remote_tokens.clear()
        self.remote_fresh.clear()
        self.remote_pending.clear()
        for field, value in remote.items():
            if field.startswith(TOKENS_FIELD):
                self.remote_tokens[field[n:]] = value
            elif field.startswith(FRESH_FIELD):
                self.remote_fresh[field[len(FRESH_FIELD):]] = value
            elif field.startswith(PENDING_FIELD):
                self.remote_pending[field[len(PENDING_FIELD):]] = value
            else:
                self.remote[field] = value
        _sum_into(self.total, self.local, self.remote)
        _sum_into(self.total_tokens, self.local_tokens, self.remote_tokens)
        _sum_into(self.total_fresh, self.local_fresh, self.remote_fresh)
        _sum_into(self.total_pending, self.local_pending, self.remote_pending)

    async def _loop(self) -> None:
        outage = Outage(log, "gateway.inflight_sync_failed", "gateway.inflight_sync_resumed")
        await repeat(self.sync, outage, self.interval_s, on_error=self._expire_remote)

    def _expire_remote(self) -> None:
        """Other replicas' counts expire with their lease; so do our copies of them."""
        if time.monotonic() - self._remote_at > self.lease_s:
            self._set_remote({})


def _store(local: dict[str, int], remote: dict[str, int], total: dict[str, int], worker_id: str, n: int) -> None:
    """This gateway's count for a worker is now `n` (none below zero): its entry and the sum's."""
    if n > 0:
        local[worker_id] = n
    else:
        local.pop(worker_id, None)
        n = 0
    if t := n + remote.get(worker_id, 0):
        total[worker_id] = t
    else:
        total.pop(worker_id, None)


def _sum_into(total: dict[str, int], local: dict[str, int], remote: dict[str, int]) -> None:
    """`total` (in place: routing holds it) = local + remote, per worker, zeros left out."""
    total.clear()
    for source in (local, remote):
        for worker_id, n in source.items():
            total[worker_id] = total.get(worker_id, 0) + n
    for worker_id in [w for w, n in total.items() if not n]:
        del total[worker_id]
