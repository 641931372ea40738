"""Aliases and fallbacks as live configuration: the YAML's, overlaid by the admin API's.

The live records are two hashes (`{P}:v1:routes:aliases`, `...:fallbacks`, fleetgate/keys.py)
and a hash of deletions (`...:routes:deleted`). The effective mapping is the YAML's
`aliases` / `fallbacks`, less the names an operator deleted, overlaid name by name by the
live records (a live record wins). So a DELETE of a name the YAML defines hides it on every
replica until a PUT of that name (which clears the deletion); a replica that cannot reach
Redis at start routes by its YAML until the first read.

The tenant store (gateway/tenants/tenant_store.py) reads these hashes in the same pipeline as the
keys and teams, on the same events (`tenants:events`, "alias:<name>" / "fallback:<model>")
and the same periodic re-read, and swaps in a new immutable `Routes`. Nothing here is on a
request's path but `Routes`' two mappings.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
import structlog

from fleetgate.keys import Keys
from gateway.models.aliases import AliasTarget, problems

log = structlog.get_logger("gateway.routes")

Kind = Literal["alias", "fallback"]


class AliasSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The body of `PUT /admin/aliases/{name}` and its record in Redis."""

    targets: tuple[AliasTarget, ...]


class FallbackSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The body of `PUT /admin/fallbacks/{model}` and its record in Redis."""

    models: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Routes:
    """The effective aliases and fallbacks, and which names came from the admin API."""

    aliases: Mapping[str, tuple[AliasTarget, ...]] = field(default_factory=dict)
    fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    live: frozenset[str] = frozenset()  # "alias:<name>" / "fallback:<model>" from Redis

    def source(self, kind: Kind, name: str) -> str:
        return "api" if f"{kind}:{name}" in self.live else "config"

    def changed(self, kind: Kind, name: str, value: tuple[Any, ...] | None) -> Routes:
        """These routes with one name set (None: removed), for checking a write before it lands."""
        table: dict[str, Any] = dict(self.aliases if kind == "alias" else self.fallbacks)
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value
        if kind == "alias":
            return Routes(table, self.fallbacks, self.live)
        return Routes(self.aliases, table, self.live)

    def problems(self) -> list[str]:
        return problems(self.aliases, self.fallbacks)


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@dataclass
class LiveRoutes:
    """The live copy (`current`) and the writes of the admin API."""

    redis: aioredis.Redis
    keys: Keys
    seed_aliases: Mapping[str, tuple[AliasTarget, ...]] = field(default_factory=dict)
    seed_fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Publishes a change and wakes this replica's re-read (the tenant store's).
    announce: Callable[[str], Awaitable[None]] | None = None
    current: Routes = field(init=False)

    def __post_init__(self) -> None:
        self.current = Routes(dict(self.seed_aliases), dict(self.seed_fallbacks))

    # -- reads ------------------------------------------------------------------------

    def queue_read(self, pipe: Any) -> None:
        """Add the three reads to `pipe`; `build` takes their three results."""
        pipe.hgetall(self.keys.live_aliases)
        pipe.hgetall(self.keys.live_fallbacks)
        pipe.hgetall(self.keys.routes_deleted)

    def build(self, alias_rows: Mapping[Any, bytes], fallback_rows: Mapping[Any, bytes],
              deleted_rows: Mapping[Any, Any]) -> Routes:
        deleted = {_text(d) for d in deleted_rows}
        aliases = {k: v for k, v in self.seed_aliases.items() if f"alias:{k}" not in deleted}
        fallbacks = {k: v for k, v in self.seed_fallbacks.items() if f"fallback:{k}" not in deleted}
        live: set[str] = set()
        for raw_name, raw in alias_rows.items():
            name = _text(raw_name)
            if (alias := self._decode(AliasSpec, "alias", name, raw)) is not None:
                aliases[name] = alias.targets
                live.add(f"alias:{name}")
        for raw_name, raw in fallback_rows.items():
            name = _text(raw_name)
            if (chain := self._decode(FallbackSpec, "fallback", name, raw)) is not None:
                fallbacks[name] = chain.models
                live.add(f"fallback:{name}")
        routes = Routes(aliases, fallbacks, frozenset(live))
        if routes != self.current:
            log.info("gateway.routes_loaded", aliases=len(aliases), fallbacks=len(fallbacks), live=len(live))
        self.current = routes
        return routes

    @staticmethod
    def _decode(kind: type[AliasSpec] | type[FallbackSpec], what: str, name: str, raw: bytes) -> Any:
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.MsgspecError as exc:
            log.warning("gateway.route_record_invalid", kind=what, name=name, error=str(exc))
            return None

    async def read(self) -> Routes:
        """The routes in Redis now (this replica's `current` is swapped too)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self.queue_read(pipe)
            rows = await pipe.execute()
        return self.build(*rows)

    # -- writes (the admin API) ----------------------------------------------------------

    async def put(self, kind: Kind, name: str, spec: AliasSpec | FallbackSpec) -> None:
        table = self.keys.live_aliases if kind == "alias" else self.keys.live_fallbacks
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(table, name, msgspec.json.encode(spec))
            pipe.hdel(self.keys.routes_deleted, f"{kind}:{name}")
            await pipe.execute()
        await self._announce(f"{kind}:{name}")

    async def delete(self, kind: Kind, name: str) -> None:
        table = self.keys.live_aliases if kind == "alias" else self.keys.live_fallbacks
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(table, name)
            pipe.hset(self.keys.routes_deleted, f"{kind}:{name}", repr(time.time()))
            await pipe.execute()
        await self._announce(f"{kind}:{name}")

    async def _announce(self, what: str) -> None:
        if self.announce is not None:
            await self.announce(what)


__all__ = ["AliasSpec", "FallbackSpec", "LiveRoutes", "Routes"]
