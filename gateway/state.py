"""`Gateway`: what the handlers need, built and closed by the lifespan in `gateway/app.py`."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.datastructures import State

from fleetgate.kv_registry import KvMirror
from fleetgate.registry import Registry
from gateway.fleet import FleetWatcher
from gateway.observe.metrics import GatewayMetrics
from gateway.request.proxy import Proxy
from gateway.settings import GatewaySettings
from gateway.tenancy import Tenancy
from gateway.tenants.ratelimit import RateLimiter
from gateway.tenants.tenant_store import TenantStore


@dataclass
class Gateway:
    """Everything the handlers need, owned by the lifespan."""

    settings: GatewaySettings
    registry: Registry
    watcher: FleetWatcher
    proxy: Proxy
    metrics: GatewayMetrics
    limiter: RateLimiter
    # Keys, teams and their limits (gateway/tenancy.py); `tenants.directory` authenticates.
    tenancy: Tenancy
    # Said at start and on /health: what an operator must fix (an open data plane, say).
    warnings: tuple[str, ...] = ()
    # Every worker's prefix-cache index from its engine's KV cache events (fleetgate/kv_registry.py).
    kv_mirror: KvMirror | None = None


    @property
    def tenants(self) -> TenantStore:
        return self.tenancy.store


def gw_of(state: State) -> Gateway:
    return state["gw"]  # type: ignore[no-any-return]
