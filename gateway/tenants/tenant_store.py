"""Keys and teams in Redis, and every replica's live copy of them.

The records are two hashes (`{P}:v1:tenants:keys`, `...:teams`, fleetgate/keys.py). Every
write publishes on `{P}:v1:tenants:events` after it lands; each gateway listens and re-reads
both hashes at once (a change reaches every replica in milliseconds), and re-reads them
every `reload_s` anyway, in case a message was lost while it was reconnecting. Until the
first read succeeds only the static keys (`api_keys`) are known. The live aliases and
fallbacks (gateway/models/live_routes.py) are read in the same pipeline, on the same events.

The YAML file seeds the records at start and on SIGHUP. The merge rule: Redis is the
truth once a record is there. The seed writes a key or team that Redis lacks, and never
one an operator deleted through the admin API (a tombstone remembers it; a PUT clears it),
unless `tenants_seed: overwrite`, which writes every record the file has over Redis's
(and clears its tombstone). Records the file lacks are never deleted by a seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog

from fleetgate.background import Outage, stop_tasks
from fleetgate.keys import Keys
from gateway.models.live_routes import LiveRoutes
from gateway.subscription import follow
from gateway.tenants.tenants import (
    Directory,
    KeyRecord,
    KeySpec,
    TeamRecord,
    TeamSpec,
    key_record,
    team_record,
)

log = structlog.get_logger("gateway.tenants")


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class TenantStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, static: tuple[str, ...] = (), reload_s: float = 5.0,
                 routes: LiveRoutes | None = None) -> None:
        self.redis = redis
        # The live aliases and fallbacks (gateway/models/live_routes.py) ride on the same reads and events.
        self.routes = routes or LiveRoutes(redis, keys)
        self.routes.announce = self._announce
        self.keys = keys
        self.static = static
        self.reload_s = reload_s
        self.directory = Directory(static=static)
        self.loaded_at = 0.0
        self._version = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._outage = Outage(log, "gateway.tenants_unreachable", "gateway.tenants_reachable")

    # -- reads ------------------------------------------------------------------------

    async def read(self, with_routes: bool = False) -> tuple[list[KeyRecord], list[TeamRecord]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.tenant_keys)
            pipe.hgetall(self.keys.tenant_teams)
            if with_routes:
                self.routes.queue_read(pipe)
            key_rows, team_rows, *route_rows = await pipe.execute()
        if with_routes:
            self.routes.build(*route_rows)
        keys = [r for k, v in key_rows.items() if isinstance(r := self._decode(KeyRecord, k, v), KeyRecord)]
        teams = [r for k, v in team_rows.items() if isinstance(r := self._decode(TeamRecord, k, v), TeamRecord)]
        return keys, teams

    @staticmethod
    def _decode(kind: type[KeyRecord] | type[TeamRecord], name: object, raw: bytes) -> KeyRecord | TeamRecord | None:
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.MsgspecError as exc:
            log.warning("gateway.tenant_record_invalid", kind=kind.__name__, id=_text(name), error=str(exc))
            return None

    async def reload(self) -> Directory:
        keys, teams = await self.read(with_routes=True)
        self._version += 1
        old = self.directory
        self.directory = Directory(keys, teams, self.static, self._version)  # type: ignore[arg-type]
        self.loaded_at = time.time()
        if set(old.keys) != set(self.directory.keys) or set(old.teams) != set(self.directory.teams):
            log.info("gateway.tenants_loaded", keys=len(self.directory.keys), teams=len(self.directory.teams))
            # A key naming a team that does not exist gets no team limits: say so.
            if missing := sorted({k.team for k in keys if k.team and k.team not in self.directory.teams}):
                log.warning("gateway.tenant_team_missing", teams=missing,
                            hint="define them (PUT /admin/teams/{id} or `teams:` in the config file)")
        return self.directory

    # -- writes (the admin API, the seed) ------------------------------------------------

    async def put_key(self, key_id: str, spec: KeySpec, source: str = "api") -> tuple[KeyRecord, str | None]:
        existing = await self.get_key(key_id)
        record, secret = key_record(key_id, spec, existing=existing, source=source)  # type: ignore[arg-type]
        await self._write(self.keys.tenant_keys, f"key:{key_id}", key_id, msgspec.json.encode(record))
        return record, secret

    async def get_key(self, key_id: str) -> KeyRecord | None:
        raw = await self.redis.hget(self.keys.tenant_keys, key_id)  # type: ignore[misc]
        return msgspec.json.decode(raw, type=KeyRecord) if raw else None

    async def put_team(self, team_id: str, spec: TeamSpec, source: str = "api") -> TeamRecord:
        record = team_record(team_id, spec, source)  # type: ignore[arg-type]
        await self._write(self.keys.tenant_teams, f"team:{team_id}", team_id, msgspec.json.encode(record))
        return record

    async def delete(self, kind: str, owner: str) -> bool:
        table = self.keys.tenant_keys if kind == "key" else self.keys.tenant_teams
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(table, owner)
            pipe.hset(self.keys.tenant_deleted, f"{kind}:{owner}", repr(time.time()))
            removed, _ = await pipe.execute()
        await self._announce(f"{kind}:{owner}")
        return bool(removed)

    async def _write(self, table: str, tomb: str, owner: str, raw: bytes) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(table, owner, raw)
            pipe.hdel(self.keys.tenant_deleted, tomb)
            await pipe.execute()
        await self._announce(tomb)

    async def _announce(self, what: str) -> None:
        # After the write (never inside a MULTI: cluster clients refuse PUBLISH there).
        await self.redis.publish(self.keys.tenant_events, what)
        self._wake.set()

    async def seed(self, keys: Mapping[str, KeySpec], teams: Mapping[str, TeamSpec], overwrite: bool = False) -> int:
        """Write the YAML file's records by the merge rule (module docstring); how many were written."""
        if not keys and not teams:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.tenant_deleted)
            pipe.hkeys(self.keys.tenant_keys)
            pipe.hkeys(self.keys.tenant_teams)
            deleted_raw, key_ids, team_ids = await pipe.execute()
        deleted = {_text(d) for d in deleted_raw}
        present = {f"key:{_text(k)}" for k in key_ids} | {f"team:{_text(t)}" for t in team_ids}
        written = 0
        writes: list[tuple[str, str, str, bytes]] = []
        for team_id, team_spec in teams.items():  # teams first: a key names its team
            if overwrite or (f"team:{team_id}" not in present and f"team:{team_id}" not in deleted):
                record = team_record(team_id, team_spec, "seed")
                writes.append((self.keys.tenant_teams, f"team:{team_id}", team_id, msgspec.json.encode(record)))
        for key_id, key_spec in keys.items():
            if overwrite or (f"key:{key_id}" not in present and f"key:{key_id}" not in deleted):
                if key_spec.secret is None and key_spec.secret_sha256 is None:
                    log.warning("gateway.tenant_seed_no_secret", key=key_id,
                                hint="give the key `secret` or `secret_sha256` in the config file")
                    continue
                key, _ = key_record(key_id, key_spec, source="seed")
                writes.append((self.keys.tenant_keys, f"key:{key_id}", key_id, msgspec.json.encode(key)))
        if writes:
            async with self.redis.pipeline(transaction=True) as pipe:
                for table, tomb, owner, raw in writes:
                    pipe.hset(table, owner, raw)
                    if overwrite:
                        pipe.hdel(self.keys.tenant_deleted, tomb)
                await pipe.execute()
            written = len(writes)
            await self._announce("seed")
        log.info("gateway.tenants_seeded", written=written, keys=len(keys), teams=len(teams),
                 overwrite=overwrite)
        return written

    # -- the live copy --------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(Exception):  # Redis away at start: the loop retries
            await self.reload()
        self._tasks = [asyncio.create_task(self._reload_loop(), name="tenants-reload"),
                       asyncio.create_task(self._listen_loop(), name="tenants-listen")]

    async def stop(self) -> None:
        await stop_tasks(*self._tasks)

    async def _reload_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.reload_s)
            self._wake.clear()
            try:
                await self.reload()
                self._outage.ok()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._outage.failed(exc, keeping=len(self.directory.keys))
                await asyncio.sleep(0.5)

    async def _listen_loop(self) -> None:
        await follow(self._subscribe, self._wake, lambda: self.reload_s, wake_on_subscribe=True)

    async def _subscribe(self) -> Any:
        await self.redis.initialize()  # a cluster client needs its slot map first
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.tenant_events)
        return pubsub
