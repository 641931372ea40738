"""The tenants' part of the gateway's lifespan: the live keys and teams, their limits, the seed.

Opened by `create_app`'s lifespan: seeds Redis from the settings' `keys:` and `teams:`,
starts the live copy (gateway/tenants/tenant_store.py), builds the limits (gateway/tenants/quota.py) and
the usage counters (gateway/tenants/usage.py), and re-seeds from the config file on SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry

from fleetgate.keys import Keys
from gateway.models.live_routes import LiveRoutes
from gateway.settings import GatewaySettings
from gateway.tenants.quota import Quota
from gateway.tenants.tenant_store import TenantStore
from gateway.tenants.usage import UsageMetrics

log = structlog.get_logger("gateway.tenants")

ReloadSeed = Callable[[], GatewaySettings]


@dataclass
class Tenancy:
    store: TenantStore
    quota: Quota
    settings: GatewaySettings
    reload_seed: ReloadSeed | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def seed(self, settings: GatewaySettings | None = None) -> int:
        s = settings or self.settings
        return await self.store.seed(s.keys, s.teams, overwrite=s.tenants_seed == "overwrite")

    async def on_sighup(self) -> None:
        """Read the config file again and seed from it (the merge rule of gateway/tenants/tenant_store.py)."""
        try:
            fresh = self.reload_seed() if self.reload_seed is not None else self.settings
        except (msgspec.ValidationError, OSError, ValueError) as exc:
            log.error("gateway.sighup_bad_config", error=str(exc), kept="the records in Redis")
            return
        try:
            written = await self.seed(fresh)
        except Exception as exc:
            log.error("gateway.sighup_seed_failed", error=repr(exc))
            return
        log.info("gateway.sighup_reloaded", written=written)

    def _sighup(self) -> None:
        task = asyncio.create_task(self.on_sighup())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await self.store.stop()
        await self.quota.close()


async def open_tenancy(
    settings: GatewaySettings, redis: aioredis.Redis, keys: Keys, registry: CollectorRegistry,
    model_label: Callable[[str], str], reload_seed: ReloadSeed | None = None,
) -> Tenancy:
    routes = LiveRoutes(redis, keys, settings.aliases, settings.fallbacks)
    store = TenantStore(redis, keys, settings.api_keys, settings.tenants_reload_s, routes)
    usage = UsageMetrics(registry, lambda key_id: key_id in store.directory.ids)
    tenancy = Tenancy(store, Quota(redis, keys, usage, model_label), settings, reload_seed)
    try:
        await tenancy.seed()
    except Exception as exc:  # Redis away at start: SIGHUP or a restart seeds later
        log.warning("gateway.tenants_seed_failed", error=repr(exc))
    await store.start()
    tenancy.quota.start()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, tenancy._sighup)
    return tenancy
