"""Per-key and per-team limits, enforced across gateway replicas atomically in Redis.

Each key and each team has up to two GCRA cells (requests and tokens per minute, Redis's
clock) and a token budget (a counter per UTC day, or in total). One Lua script checks a
request against all of them and takes from all only if every one allows it: a request is
refused by exactly one limit and never half-counted. The prompt's tokens (counted with
the model's tokenizer, else estimated) are charged before routing; when the answer ends
(a stream included) a second script corrects the charge to what the engine reported,
prompt and completion, and writes the day's usage record. So the tokens a key is charged
are the engine's own counts, not an estimate held against it: over any window the limit
is met exactly, give or take one request's output (which is only known at its end).

If Redis cannot answer, requests pass (a limiter that fails closed turns a registry
outage into a full outage); the gateway logs that once until Redis answers again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from fleetgate.keys import Keys
from gateway.errors import ModelNotAllowed, QuotaExhausted, RateLimited, TokensLimited
from gateway.tenants.tenants import Limits, Tenant
from gateway.tenants.usage import USAGE_TTL_S, Today, UsageBuffer, UsageMetrics, day_of

log = structlog.get_logger("gateway.quota")

# KEYS: 1 key requests, 2 key tokens, 3 team requests, 4 team tokens (GCRA cells), 5 key
# budget, 6 team budget, 7 the day's usage hash. ARGV: 1 the prompt's tokens; 2..9 per cell
# (µs per unit, 0: no limit; burst in units); 10, 11 budgets (0: none); 12, 13 their TTLs
# (s, 0: none); 14 the usage field prefix ("<key>\t<model>\t"); 15 the usage TTL.
# Returns {allowed, refusing limit (1-6, 0), µs until it would allow, then per cell
# (remaining, µs until full) and per budget (remaining, 0)}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local out = {1, 0, 0}
local tats = {}
for i = 1, 4 do
  local interval = tonumber(ARGV[2 * i])
  local cap = tonumber(ARGV[2 * i + 1])
  local rem, reset = -1, 0
  if interval > 0 then
    local n = 1
    if i % 2 == 0 then n = cost end
    local tat = tonumber(redis.call('GET', KEYS[i]) or now)
    if tat < now then tat = now end
    local tau = interval * cap
    -- A request larger than the whole burst goes when the cell is full, and leaves it in debt.
    local need = math.min(n, cap) * interval
    if tat + need - now > tau + 1 then
      local wait = tat + need - now - tau
      if out[1] == 1 or wait > out[3] then out[2] = i; out[3] = wait end
      out[1] = 0
      reset = tat - now
    else
      tats[i] = tat + n * interval
      reset = tats[i] - now
    end
    rem = math.floor((tau - reset) / interval + 1e-9)
    if rem < 0 then rem = 0 end
  end
  out[#out + 1] = rem
  out[#out + 1] = math.ceil(reset)
end
local used = {}
for j = 0, 1 do
  local limit = tonumber(ARGV[10 + j])
  local rem = -1
  if limit > 0 then
    used[j] = tonumber(redis.call('GET', KEYS[5 + j]) or '0')
    rem = limit - used[j]
    if out[1] == 1 and used[j] + cost > limit then
      out[1] = 0; out[2] = 5 + j; out[3] = tonumber(ARGV[12 + j]) * 1000000
    end
    if rem < 0 then rem = 0 end
  end
  out[#out + 1] = rem
  out[#out + 1] = 0
end
local usage_ttl = tonumber(ARGV[15])
if out[1] == 0 then
  redis.call('HINCRBY', KEYS[7], ARGV[14] .. 'rate_limited', 1)
  redis.call('EXPIRE', KEYS[7], usage_ttl)
  return out
end
for i = 1, 4 do
  if tats[i] then
    redis.call('SET', KEYS[i], string.format('%.0f', tats[i]), 'PX', math.ceil((tats[i] - now) / 1000) + 1)
  end
end
for j = 0, 1 do
  if used[j] and cost > 0 then
    redis.call('INCRBY', KEYS[5 + j], cost)
    local ttl = tonumber(ARGV[12 + j])
    if ttl > 0 then redis.call('EXPIRE', KEYS[5 + j], ttl + 86400) end
    out[12 + 2 * j] = math.max(0, out[12 + 2 * j] - cost)
  end
end
return out
"""

# KEYS: 1 key tokens, 2 team tokens (GCRA cells), 3 key budget, 4 team budget, 5 usage hash.
# ARGV: 1 tokens to add (negative: give back what was charged beyond the engine's count);
# 2, 3 the cells' µs per token (0: none); 4, 5 budget on (1/0); 6 the usage field prefix;
# 7 the usage TTL; 8..11 requests, input, output and errors to add to the usage record.
_SETTLE = """
local delta = tonumber(ARGV[1])
if delta ~= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  for i = 1, 2 do
    local interval = tonumber(ARGV[1 + i])
    if interval > 0 then
      local tat = tonumber(redis.call('GET', KEYS[i]) or now)
      if tat < now then tat = now end
      tat = tat + delta * interval
      if tat > now then
        redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
      else
        redis.call('DEL', KEYS[i])
      end
    end
  end
  for j = 0, 1 do
    if ARGV[4 + j] == '1' and redis.call('EXISTS', KEYS[3 + j]) == 1 then
      if redis.call('INCRBY', KEYS[3 + j], delta) < 0 then redis.call('SET', KEYS[3 + j], 0, 'KEEPTTL') end
    end
  end
end
local names = {'requests', 'input', 'output', 'errors'}
for k = 1, 4 do
  local n = tonumber(ARGV[7 + k])
  if n ~= 0 then redis.call('HINCRBY', KEYS[5], ARGV[6] .. names[k], n) end
end
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[7]))
return 1
"""

_KIND = {1: "requests", 2: "tokens", 3: "requests", 4: "tokens"}


def _cell(limits: Limits | None, per_minute: float) -> tuple[float, float]:
    """(µs per unit, burst in units) of a cell; (0, 0): no limit."""
    if limits is None or per_minute <= 0:
        return 0.0, 0.0
    return 60e6 / per_minute, max(1.0, per_minute * limits.burst_s / 60)


def _budget(limits: Limits | None, scope: str, owner: str, keys: Keys, now: dt.datetime) -> tuple[str, int, int]:
    """(counter key, limit, seconds until the period ends: 0 for a total budget)."""
    if limits is None or limits.budget_tokens <= 0:
        return keys.budget(scope, owner, "none"), 0, 0
    if limits.budget_period == "total":
        return keys.budget(scope, owner, "total"), limits.budget_tokens, 0
    midnight = (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return keys.budget(scope, owner, now.strftime("%Y-%m-%d")), limits.budget_tokens, \
        max(1, math.ceil((midnight - now).total_seconds()))


def _reset(us: int) -> str:
    """OpenAI's way of writing a reset time: `1s`, `6m0s`, `20ms`."""
    if us < 1_000_000:
        return f"{max(0, round(us / 1000))}ms"
    seconds = us / 1e6
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


@dataclass(slots=True)
class Ticket:
    """One admitted request of a tenant: what it was charged, settled once when it ends."""

    quota: Quota
    tenant: Tenant
    model: str
    charged: int
    keys: list[str]
    intervals: tuple[float, float]
    budgets: tuple[bool, bool]
    usage_prefix: str
    day: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    settled: bool = False

    async def settle(self, prompt_tokens: int, completion_tokens: int, status: int) -> None:
        """Correct the charge to the engine's counts and write the usage record (once)."""
        if self.settled:
            return
        self.settled = True
        if not self.tenant.counts_tokens:  # only usage to write, and nothing waits for it: the buffer
            self.quota.buffered(self, prompt_tokens, completion_tokens, status)
            return
        await self.quota.settle(self, prompt_tokens, completion_tokens, status)

    @property
    def settles_at_once(self) -> bool:
        """Whether `settle` does no I/O (only usage to buffer): it may then run after the answer."""
        return not self.tenant.counts_tokens

    def settle_buffered(self, prompt_tokens: int, completion_tokens: int, status: int) -> None:
        """`settle` for a ticket that `settles_at_once`: no await."""
        if self.settled:
            return
        self.settled = True
        self.quota.buffered(self, prompt_tokens, completion_tokens, status)

    def settle_soon(self, prompt_tokens: int, completion_tokens: int, status: int) -> None:
        """`settle` in the background: for where the request's task is being cancelled."""
        if self.settled:
            return
        if not self.tenant.counts_tokens:
            self.settled = True
            self.quota.buffered(self, prompt_tokens, completion_tokens, status)
            return
        self.settled = True
        task = asyncio.create_task(self.quota.settle(self, prompt_tokens, completion_tokens, status))
        self.quota.tasks.add(task)
        task.add_done_callback(self.quota.tasks.discard)


class Quota:
    """Admits a tenant's request against its key's and team's limits, and settles it."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, metrics: UsageMetrics,
                 model_label: Callable[[str], str] = lambda m: m, buffer: UsageBuffer | None = None) -> None:
        self.keys = keys
        self.buffer = buffer or UsageBuffer(redis, keys)
        self.metrics = metrics
        self.model_label = model_label
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)
        self._unavailable = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.today = Today()

    async def admit(self, tenant: Tenant, model: str, prompt_tokens: int) -> Ticket:
        """Check and charge one request of `prompt_tokens`; RateLimited (or a subclass) if a
        limit refuses it, ModelNotAllowed if the key may not use `model`."""
        if not tenant.allows(model):
            raise ModelNotAllowed(f"The API key `{tenant.id}` may not use the model `{model}`.", param="model")
        key, team = tenant.key, tenant.team
        label = self.model_label(model)
        if not tenant.limited:  # nothing to check or charge: only usage to write (`buffered`)
            return Ticket(self, tenant, label, prompt_tokens, [], (0.0, 0.0), (False, False),
                          f"{key.id}\t{label}\t", self.today())
        now = dt.datetime.now(dt.UTC)
        k = self.keys
        cells = [_cell(key, key.rpm), _cell(key, key.tpm), _cell(team, team.rpm if team else 0),
                 _cell(team, team.tpm if team else 0)]
        team_id = team.id if team else "-"
        kb, tb = _budget(key, "k", key.id, k, now), _budget(team, "t", team_id, k, now)
        names = [k.quota("k", key.id, "r"), k.quota("k", key.id, "t"), k.quota("t", team_id, "r"),
                 k.quota("t", team_id, "t"), kb[0], tb[0], k.usage(day_of(now))]
        prefix = f"{key.id}\t{label}\t"
        ticket = Ticket(self, tenant, label, prompt_tokens, names, (cells[1][0], cells[3][0]),
                        (kb[1] > 0, tb[1] > 0), prefix, day_of(now))
        args: list[str | int | float] = [prompt_tokens]
        for interval, cap in cells:
            args += [repr(interval), repr(cap)]
        args += [kb[1], tb[1], kb[2], tb[2], prefix, USAGE_TTL_S]
        try:
            reply = await self._admit(keys=names, args=args)
        except (RedisError, OSError) as exc:
            if not self._unavailable:
                log.warning("gateway.quota_unavailable", error=repr(exc))
            self._unavailable = True
            ticket.charged = 0
            ticket.settled = True  # nothing to correct, nowhere to write
            return ticket
        self._unavailable = False
        allowed, which, wait_us = int(reply[0]), int(reply[1]), int(reply[2])
        state = [(int(reply[3 + 2 * i]), int(reply[4 + 2 * i])) for i in range(6)]
        ticket.headers = self._headers(tenant, state)
        if allowed:
            return ticket
        self.metrics.rate_limited(key.id, label, _KIND.get(which, "budget"))
        owner = f"team `{team_id}`" if which in (3, 4, 6) else f"key `{key.id}`"
        limits = dict(ticket.headers)
        if which in (5, 6):
            budget = (key if which == 5 else team)
            assert budget is not None
            per = "per day (UTC)" if budget.budget_period == "day" else "in total"
            log.info("gateway.quota_exhausted", key_id=key.id, team=team_id, budget=budget.budget_tokens)
            raise QuotaExhausted(
                f"Token budget used up: {budget.budget_tokens} tokens {per} for {owner}.",
                retry_after=wait_us / 1e6 if wait_us else None, limit_headers=limits)
        wait_s = wait_us / 1e6
        log.info("gateway.rate_limited", key_id=key.id, team=team_id, limit=_KIND[which],
                 retry_after_s=round(wait_s, 3))
        unit = "requests" if _KIND[which] == "requests" else "tokens"
        per_minute = [key.rpm, key.tpm, team.rpm if team else 0, team.tpm if team else 0][which - 1]
        error = RateLimited if unit == "requests" else TokensLimited
        raise error(f"Rate limit reached for {owner}: {per_minute:g} {unit} per minute. "
                    f"Try again in {wait_s:.2g} s.", retry_after=wait_s, limit_headers=limits)

    def _headers(self, tenant: Tenant, state: list[tuple[int, int]]) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* headers, for the tighter of the key's and the team's cells."""
        key, team = tenant.key, tenant.team
        out: list[tuple[str, str]] = []
        for unit, idx, limits in (("requests", (0, 2), (key.rpm, team.rpm if team else 0)),
                                  ("tokens", (1, 3), (key.tpm, team.tpm if team else 0))):
            options = [(state[i][0], state[i][1], lim) for i, lim in zip(idx, limits, strict=True) if lim > 0]
            if not options:
                continue
            remaining, reset, limit = min(options)
            out += [(f"x-ratelimit-limit-{unit}", f"{limit:g}"), (f"x-ratelimit-remaining-{unit}", str(remaining)),
                    (f"x-ratelimit-reset-{unit}", _reset(reset))]
        budgets = [state[i][0] for i in (4, 5) if state[i][0] >= 0]
        if budgets:
            out.append(("x-fleetgate-budget-remaining-tokens", str(min(budgets))))
        return out

    async def settle(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int, status: int) -> None:
        tokens = prompt_tokens + completion_tokens
        error = 1 if status >= 400 else 0
        self.metrics.done(ticket.tenant.id, ticket.model, prompt_tokens, completion_tokens, bool(error))
        names = ticket.keys
        charged = ticket.charged if ticket.tenant.counts_tokens else 0
        try:
            await self._settle(
                keys=[names[1], names[3], names[4], names[5], names[6]],
                args=[tokens - charged, repr(ticket.intervals[0]), repr(ticket.intervals[1]),
                      int(ticket.budgets[0]), int(ticket.budgets[1]), ticket.usage_prefix, USAGE_TTL_S,
                      1, prompt_tokens, completion_tokens, error])
        except (RedisError, OSError) as exc:
            if not self._unavailable:
                log.warning("gateway.quota_unavailable", error=repr(exc))
            self._unavailable = True

    def buffered(self, ticket: Ticket, prompt_tokens: int, completion_tokens: int, status: int) -> None:
        """The usage of a key without limits: counted now, written with the next flush."""
        error = status >= 400
        self.metrics.done(ticket.tenant.id, ticket.model, prompt_tokens, completion_tokens, error)
        self.buffer.add(ticket.day, ticket.usage_prefix, 1, prompt_tokens, completion_tokens, int(error))

    def start(self) -> None:
        self.buffer.start()

    async def close(self) -> None:
        for task in list(self.tasks):
            await asyncio.gather(task, return_exceptions=True)
        await self.buffer.stop()
