"""The registry's key layout and TTLs: the names every gateway and agent read and write.

Layout (``P`` is the key prefix, ``v1`` the schema version)::

    {P}:v1:workers        SET   ids of registered workers (an index; stale ids are pruned by readers)
    {P}:v1:w:<id>         HASH  info  -> WorkerInfo JSON (written by the agent)
                                state -> starting|ready|draining (written by the agent)
                                drain -> "1" when an operator drained it (written by the admin API;
                                         re-asserted by its agent after a Redis restart)
                                load  -> Load JSON (refreshed by the agent's heartbeat)
                                hb    -> unix time of the last heartbeat
                                sig   -> HMAC-SHA256 of `info` with the registration secret
                                         (when one is set, readers ignore unsigned records)
                                stop  -> "1" when an operator asked the agent to stop
                          PEXPIRE heartbeat_ttl: a worker whose agent dies vanishes by itself
    {P}:v1:removed:<id>   STRING set when an operator removes a worker (TTL 10 min), so its
                          agent stops instead of registering again
    {P}:v1:events         PUBSUB a worker id whenever something about it changed
    {P}:v1:circuit:<id>   STRING why a gateway's circuit breaker took the worker out of routing,
                          PX cooldown (+ the probe's timeout): when it expires the worker gets
                          traffic again (half-open)
    {P}:v1:rejected:<id>  STRING why gateways ignore worker <id>'s record (not signed, or signed
                          with another registration secret), written by a gateway that read it,
                          EX REJECTED_TTL_S: the agent reads it (`rejection`) to learn it is ignored
    {P}:v1:epoch          STRING set once by the first gateway; its absence means Redis lost
                          everything (a restart without persistence)
    {P}:v1:gateways       SET   ids of gateways that publish in-flight counts (pruned by readers)
    {P}:v1:inflight:<gw>  HASH  worker id -> requests gateway <gw> has in flight there,
                          rewritten whole every ~100 ms, PEXPIRE lease: a gateway that crashes
                          leaks nothing, its counts vanish with the lease
    {P}:v1:rate:<key id>  STRING per-client rate limit (GCRA): the theoretical arrival time, in
                          ms of Redis's clock, of the client's next request; PX until then
    {P}:v1:resp:<id>      STRING the worker that created (and stores) Responses API response
                          <id>, so a follow-up (`previous_response_id`), a retrieve or a cancel
                          reaches it from any gateway; PX the gateway's `responses_ttl_s`
    {P}:v1:adapters       HASH  adapter name -> {"path", "base"} JSON: adapters an operator added
                          through the admin API, so every gateway (and one that restarts) can
                          place them
    {P}:v1:lora:<gw>      HASH  "<worker>\t<adapter>" -> requests gateway <gw> has in flight for
                          that adapter on that worker, rewritten whole every ~200 ms, PEXPIRE
                          lease (like inflight:<gw>): no gateway evicts an adapter in use
    {P}:v1:lora_used:<id> ZSET  adapter -> unix time a gateway last sent it to worker <id> (the
                          LRU every gateway evicts by), PEXPIRE 1 h after the last write
    {P}:v1:lora_lock:<a>  STRING the gateway loading adapter <a> (one load of it at a time in the
                          fleet), PX the load's time limit
    {P}:v1:kv:<id>        STREAM worker <id>'s prefix-cache index change by change, written by its
                          agent from the engine's KV cache events (fleetgate/kv_registry.py):
                          entry id "<gen>-<version>", fields a / d (chain keys added / removed),
                          c (start from empty), s / r (state events|lost, reason), bs (block
                          size); XADD MAXLEN ~ 1024, PEXPIRE 10 s refreshed by the agent
    {P}:v1:kvsnap:<id>    STRING the whole index as of one entry (msgpack [gen, version, state,
                          reason, block_size, keys]), rewritten every 256 entries, PEXPIRE as above

    {P}:v1:tenants:keys   HASH  API key id -> KeyRecord JSON (gateway/tenants/tenants.py: limits, team, the
                          SHA-256 of its secret, never the secret), written by the admin API
                          and the YAML seed
    {P}:v1:tenants:teams  HASH  team id -> TeamRecord JSON (limits its keys share)
    {P}:v1:tenants:deleted HASH "key:<id>" / "team:<id>" -> unix time an operator deleted it, so
                          the YAML seed does not bring it back (a PUT clears it)
    {P}:v1:tenants:events PUBSUB "key:<id>" / "team:<id>" / "seed" after every change of the above
    {P}:v1:routes:aliases HASH  alias name -> {"targets": [{"model", "weight"}, ...]} JSON: aliases an
                          operator set through the admin API (gateway/models/live_routes.py); they
                          overlay the YAML `aliases` name by name
    {P}:v1:routes:fallbacks HASH model -> {"models": [...]} JSON: live fallback lists, the same way
    {P}:v1:routes:deleted HASH  "alias:<name>" / "fallback:<model>" -> unix time an operator deleted
                          it, so a YAML one of that name stays hidden (a PUT clears it);
                          changes of these three are announced on tenants:events
    {P}:v1:quota:<scope>:<id>:<r|t>  STRING GCRA cell of a key's or a team's (scope k|t) requests
                          (r) or tokens (t) per minute: the theoretical arrival time in µs of
                          Redis's clock; PX until then (gateway/tenants/quota.py)
    {P}:v1:budget:<scope>:<id>:<period>  STRING tokens a key or team used in a UTC day
                          (YYYY-MM-DD, EX two days) or in total ("total", no TTL)
    {P}:v1:usage:<day>    HASH  "<key id>\t<model>\t<requests|input|output|errors|rate_limited>"
                          -> count, one hash per UTC day (YYYY-MM-DD), EX 35 days

The prefix is wrapped in a hash tag so every key lands in one Redis Cluster slot:
multi-key pipelines and the registry's Lua scripts work unchanged on a cluster.
The reads and writes themselves are `fleetgate/registry.py`'s.
"""

from __future__ import annotations

from fleetgate.schema import SCHEMA_VERSION

DEFAULT_PREFIX = "fleetgate"
DEFAULT_HEARTBEAT_TTL_S = 3.0
DEFAULT_INFLIGHT_LEASE_S = 3.0
REMOVED_TTL_S = 600
REJECTED_TTL_S = 120
# The field of a lease hash (inflight:<gw>, lora:<gw>) that holds when it was written.
LEASE_FIELD = "_at"


class Keys:
    """Key names for one fleet (one prefix)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        base = f"{{{prefix}}}:v{SCHEMA_VERSION}"
        self.workers = f"{base}:workers"
        self.events = f"{base}:events"
        self._worker = f"{base}:w:"
        self._removed = f"{base}:removed:"
        self._circuit = f"{base}:circuit:"
        self._rejected = f"{base}:rejected:"
        self.gateways = f"{base}:gateways"
        self.epoch = f"{base}:epoch"
        self._inflight = f"{base}:inflight:"
        self._rate = f"{base}:rate:"
        self._response = f"{base}:resp:"
        self.adapters = f"{base}:adapters"
        self._lora = f"{base}:lora:"
        self._lora_used = f"{base}:lora_used:"
        self._lora_lock = f"{base}:lora_lock:"
        self._kv = f"{base}:kv:"
        self._kv_snapshot = f"{base}:kvsnap:"
        self.tenant_keys = f"{base}:tenants:keys"
        self.tenant_teams = f"{base}:tenants:teams"
        self.tenant_deleted = f"{base}:tenants:deleted"
        self.tenant_events = f"{base}:tenants:events"
        self.live_aliases = f"{base}:routes:aliases"
        self.live_fallbacks = f"{base}:routes:fallbacks"
        self.routes_deleted = f"{base}:routes:deleted"
        self._quota = f"{base}:quota:"
        self._budget = f"{base}:budget:"
        self._usage = f"{base}:usage:"

    def worker(self, worker_id: str) -> str:
        return self._worker + worker_id

    def removed(self, worker_id: str) -> str:
        return self._removed + worker_id

    def circuit(self, worker_id: str) -> str:
        return self._circuit + worker_id

    def rejected(self, worker_id: str) -> str:
        return self._rejected + worker_id

    def inflight(self, gateway_id: str) -> str:
        return self._inflight + gateway_id

    def rate(self, client_id: str) -> str:
        return self._rate + client_id

    def response(self, response_id: str) -> str:
        return self._response + response_id

    def lora(self, gateway_id: str) -> str:
        return self._lora + gateway_id

    def lora_used(self, worker_id: str) -> str:
        return self._lora_used + worker_id

    def lora_lock(self, adapter: str) -> str:
        return self._lora_lock + adapter

    def kv(self, worker_id: str) -> str:
        return self._kv + worker_id

    def kv_snapshot(self, worker_id: str) -> str:
        return self._kv_snapshot + worker_id

    def quota(self, scope: str, owner: str, what: str) -> str:
        """GCRA cell of key (scope "k") or team ("t") `owner`: requests ("r") or tokens ("t")."""
        return f"{self._quota}{scope}:{owner}:{what}"

    def budget(self, scope: str, owner: str, period: str) -> str:
        return f"{self._budget}{scope}:{owner}:{period}"

    def usage(self, day: str) -> str:
        return self._usage + day
