"""Gateway settings: defaults < config/gateway.yaml < environment < command-line flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from fleetgate.registry import DEFAULT_HEARTBEAT_TTL_S, DEFAULT_PREFIX
from gateway.errors import GatewayError
from gateway.models.aliases import AliasTarget
from gateway.routing.base import FullAt
from gateway.tenants.tenants import KeySpec, TeamSpec, key_record, team_record


class AdapterSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter the gateway may load onto workers: where it is and its base model."""

    path: str
    base: str


class PriorityClass(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A priority class (gateway/accounts/priorities.py): its weight in the admission queue, the share of
    a worker it may fill, and its own queue timeout (None: `queue_timeout_s`)."""

    weight: float = 1.0
    share: float = 1.0
    queue_timeout_s: float | None = None


class GatewaySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = DEFAULT_PREFIX
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    # Full re-read of the registry; pub/sub events trigger one at once in between.
    refresh_interval_s: float = 1.0
    # A model the fleet served this recently gets 503 + Retry-After while no worker serves
    # it (its workers left or restart), not 404 model_not_found; so does every model while
    # the registry cannot be read. Only these names become metrics labels.
    model_memory_s: float = 600.0
    admin_token: str = ""
    # Shared with the agents: records not signed with it are ignored (empty: no signing).
    registration_secret: str = ""
    # Client keys for /v1; empty means the data plane is open (say so in the docs).
    api_keys: tuple[str, ...] = ()
    # Keys and teams with their own limits (docs/tenants.md): the seed of the records in
    # Redis, which the admin API changes live. `tenants_seed`: "absent" writes only records
    # Redis lacks (and an operator did not delete); "overwrite" writes every one given here.
    keys: dict[str, KeySpec] = msgspec.field(default_factory=dict)
    teams: dict[str, TeamSpec] = msgspec.field(default_factory=dict)
    tenants_seed: Literal["absent", "overwrite"] = "absent"
    # Full re-read of keys and teams; pub/sub events trigger one at once in between.
    tenants_reload_s: float = 5.0
    # Requests per minute each client may send to the inference routes, shared by every
    # gateway through Redis (0: no limit). A client is its API key, or its address when
    # no keys are configured. `rate_limit_burst` requests may come at once (0: 10 s worth).
    rate_limit_rpm: float = 0.0
    rate_limit_burst: int = 0
    policy: str = "fleet"
    # Knobs of the `fleet` policy (gateway/routing/fleet.py: FleetOptions).
    routing: dict[str, float | int | bool] = msgspec.field(default_factory=dict)
    # LoRA adapters the gateway may place on runtime-loading workers: name -> path, base.
    adapters: dict[str, AdapterSpec] = msgspec.field(default_factory=dict)
    # Public model names -> the models/adapters they send to, by weight; and model -> the
    # models a request goes to when its own has no capacity or context (gateway/models/aliases.py).
    aliases: dict[str, tuple[AliasTarget, ...]] = msgspec.field(default_factory=dict)
    fallbacks: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    # Base model name -> tokenizer.json, for exact prompt token counts; wins over the path a
    # worker registered (gateway/request/tokenizers.py); else the prompt is estimated.
    tokenizers: dict[str, str] = msgspec.field(default_factory=dict)
    # Use the tokenizers agents register (false: only `tokenizers:`, else the estimate).
    registered_tokenizers: bool = True
    connect_timeout_s: float = 2.0
    # Time allowed for an engine's first byte (a stream's first event), plus this much per
    # 1,000 prompt tokens: what was asked sets the limit, not one fixed figure.
    first_byte_timeout_s: float = 30.0
    first_byte_per_1k_tokens_s: float = 5.0
    # A stream's first event may wait longer, up to this in all, while its engine reports
    # requests waiting (its queue, adapters waiting for a LoRA slot) in fresh, healthy
    # reports: it keeps its place there rather than being sent again (gateway/request/relay.py).
    first_byte_queued_timeout_s: float = 300.0
    # A whole non-streamed answer gets the first byte's time plus this much per token asked
    # for (`max_tokens`; without it, what the worker's context leaves): 10 tokens a second
    # is slower than any healthy engine generates one sequence.
    answer_per_token_s: float = 0.1
    # A stream whose engine sends nothing for this long after its first event, while the
    # gateway waits on it, counts as dead (it is given up within a tenth of this after:
    # gateway/request/relay.py's STALL_MARGIN); a client reading slowly never counts.
    stall_timeout_s: float = 30.0
    # How many times one stream may be continued on another worker.
    max_resumes: int = 2
    retry_attempts: int = 3
    retry_max_s: float = 10.0
    retry_backoff_s: float = 0.05
    # Circuit breaker: failures in a row that open it, and its first cooldown.
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    # Each failed probe doubles the cooldown, up to this.
    breaker_max_cooldown_s: float = 60.0
    # Load shedding: a worker is full at capacity x (1 + shed_queue_ratio) outstanding
    # requests, or at its KV cache x (1 + shed_queue_ratio) of demand (what its engine
    # reports it holds and queues), or, KV size unknown, at shed_kv KV-cache use with a
    # queue; when all are, requests wait up to queue_timeout_s in a queue of at most
    # queue_max, then get 429.
    shed_queue_ratio: float = 1.0
    shed_kv: float = 0.98
    # A request that would push its chosen worker's KV cache past hold_kv (its engine's
    # measured use and the prediction since; the gateway's account where none) waits for a completion there, at most hold_max_s, then goes anyway (never a
    # 429): the engine would preempt running requests to admit it. hold_kv 0 turns it off.
    hold_kv: float = 1.0
    hold_max_s: float = 0.5
    # The adapter slot gate (gateway/routing/lora_gate.py): an adapter request whose engine has
    # every LoRA slot busy with other adapters waits in the gateway (vLLM would let it starve
    # there, with no fairness), and free slots go to the adapters held longest; an adapter that
    # has had a slot for lora_slot_turn_s while others wait stops taking new requests on that
    # engine until its slot has turned over. A request waits at most lora_slot_wait_max_s from
    # its arrival, then goes anyway (never a 429); 0 turns the gate off.
    lora_slot_wait_max_s: float = 30.0
    lora_slot_turn_s: float = 2.0
    queue_max: int = 512
    queue_timeout_s: float = 10.0
    # Priority classes and which keys are in which (docs/operations.md, "Priorities and
    # fairness"): key_priority maps a key id (or the key's last 4+ characters) to a class;
    # other keys are in default_priority. One `default` class: the queue is FIFO per model.
    priority_classes: dict[str, PriorityClass] = msgspec.field(
        default_factory=lambda: {"default": PriorityClass()})
    key_priority: dict[str, str] = msgspec.field(default_factory=dict)
    default_priority: str = "default"
    # Serve the OpenAI POST routes with a raw ASGI handler in front of Litestar (same logic,
    # a third less CPU per request).
    fast_path: bool = True
    # How long the gateway remembers which worker stores a Responses API response (for
    # `previous_response_id`, retrieve and cancel, from any gateway replica).
    responses_ttl_s: float = 86400.0
    # Largest request body accepted (413 above it).
    max_body_bytes: int = 32 * 1024 * 1024
    # Limits on a client's connection (gateway/front/front_limits.py; docs/operations.md, "Limits on
    # client connections"), nginx's and h11's in spirit. A request target over
    # max_request_line_bytes gets 414 (nginx: one 8 KiB buffer a line); a head over
    # max_header_bytes in all (target and header lines) or with more than max_headers lines
    # gets 431 (nginx: 4 x 8 KiB; h11: 16 KiB; Apache: 100 lines). 32 KiB holds a long
    # bearer token and a tracing context many times over; it also bounds what the parser
    # holds of one connection's head.
    max_request_line_bytes: int = 8 * 1024
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    # A head must be whole this long after its first byte, else the connection closes
    # (nginx's client_header_timeout is 60 s, Apache's 20-40 s: an honest client sends its
    # head at once, a slow-header attacker holds a connection as long as this allows).
    header_timeout_s: float = 30.0
    # A new connection that sends nothing this long, and a keep-alive one with no next
    # request, is closed (uvicorn's keep-alive default, which the gateway always had).
    idle_timeout_s: float = 5.0
    # A body must arrive within body_timeout_s of its request's first byte plus a second per
    # body_min_rate bytes (Apache mod_reqtimeout's MinRate, whose default is 500): slower
    # gets 408 and the connection closes.
    body_timeout_s: float = 30.0
    body_min_rate: int = 1024
    # A client that reads nothing of its answer this long (the gateway's writes to it stay
    # paused: its connection's send buffer full) is closed, and its engine request
    # cancelled as for a hang-up (nginx's send_timeout, 60 s): else it holds the connection,
    # the engine's request and its KV cache for as long as it likes.
    send_timeout_s: float = 60.0
    # Client connections one gateway process holds open at most: past it, a connection is
    # answered 503 and closed, logged once per 10 s. The process raises its soft limit on
    # open files to the hard one at start; at most half of that limit less 256 is used
    # (a connection with a request in flight holds a second descriptor, to its engine).
    max_connections: int = 10_000
    # OpenTelemetry: the OTLP/HTTP traces URL (http://collector:4318/v1/traces) spans are
    # sent to; empty: no tracing (a client's traceparent still reaches the engine).
    tracing_endpoint: str = ""
    tracing_service: str = "fleetgate-gateway"
    log_level: str = "info"
    log_json: bool | None = None

    def __post_init__(self) -> None:
        # A mistyped key or team fails at start, not when the seed is written.
        for team_id, team in self.teams.items():
            _valid(team_record, team_id, team, f"teams.{team_id}")
        for key_id, key in self.keys.items():
            _valid(key_record, key_id, key, f"keys.{key_id}")

    @property
    def full_at(self) -> FullAt:
        return FullAt(queue_ratio=self.shed_queue_ratio, kv=self.shed_kv, hold_kv=self.hold_kv)

    def public(self) -> dict[str, Any]:
        """The settings with secrets masked, for logs and /admin."""
        out = msgspec.structs.asdict(self)
        out["admin_token"] = "***" if self.admin_token else ""
        out["registration_secret"] = "***" if self.registration_secret else ""
        out["api_keys"] = [f"***{k[-4:]}" if len(k) > 8 else "***" for k in self.api_keys]
        out["key_priority"] = {(f"***{k[-4:]}" if len(k) > 8 else k): v for k, v in self.key_priority.items()}
        out["redis_url"] = _mask_url(self.redis_url)
        out["tracing_endpoint"] = _mask_url(self.tracing_endpoint)
        out["keys"] = {k: {**msgspec.to_builtins(v), "secret": "***", "secret_sha256": "***"}
                       for k, v in self.keys.items()}
        return out


def _valid(check: Any, name: str, spec: Any, where: str) -> None:
    try:
        check(name, spec)
    except GatewayError as exc:
        raise ValueError(f"{where}: {exc.message}") from None


def _mask_url(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


_ENV = {
    # The OpenTelemetry standard names first: fleetgate's own win over them.
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "tracing_endpoint",
    "OTEL_SERVICE_NAME": "tracing_service",
    "FLEETGATE_OTLP_ENDPOINT": "tracing_endpoint",
    "FLEETGATE_REDIS_URL": "redis_url",
    "FLEETGATE_REDIS_PREFIX": "redis_prefix",
    "FLEETGATE_ADMIN_TOKEN": "admin_token",
    "FLEETGATE_REGISTRATION_SECRET": "registration_secret",
    "FLEETGATE_POLICY": "policy",
    "FLEETGATE_RATE_LIMIT_RPM": "rate_limit_rpm",
    "FLEETGATE_LOG_LEVEL": "log_level",
}


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> GatewaySettings:
    """Build settings from a YAML file, the environment and explicit overrides (flags)."""
    data, _ = gather(config_path, overrides, environ)
    return msgspec.convert(data, GatewaySettings, strict=False)


def gather(
    config_path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The raw settings, and where each came from (the file, a variable, `flag`), unchecked."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_path is not None and Path(config_path).exists():
        loaded = yaml.safe_load(Path(config_path).read_text()) or {}
        section = loaded.get("gateway", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(section, dict):
            raise msgspec.ValidationError(f"Expected `object`, got `{type(section).__name__}` - at `$`")
        data.update(section)
        sources.update(dict.fromkeys(section, str(config_path)))
    for var, field in _ENV.items():
        if env.get(var):
            data[field], sources[field] = env[var], var
    if env.get("FLEETGATE_API_KEYS"):
        data["api_keys"] = [k.strip() for k in env["FLEETGATE_API_KEYS"].split(",") if k.strip()]
        sources["api_keys"] = "FLEETGATE_API_KEYS"
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    data.update(given)
    sources.update(dict.fromkeys(given, "the command line"))
    return data, sources
