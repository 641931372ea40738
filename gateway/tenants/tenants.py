"""Tenants as data: API keys and the teams they belong to, each with its own limits.

A key is a record (`KeyRecord`): a stable, non-secret id (what logs, metrics and usage
name it by), the SHA-256 of its secret (the secret itself is never stored), its team,
its requests and tokens per minute, an optional token budget (per UTC day or in total),
a priority class (read by admission's scheduling) and the models it may use. A team
(`TeamRecord`) carries limits of its own that all its keys share. A limit of 0 is no
limit. The records live in Redis (gateway/tenants/tenant_store.py) and every gateway replica
holds them as one immutable `Directory`, swapped whole when they change.

Keys of the flat `api_keys` list (FLEETGATE_API_KEYS) are keys without limits, with the
id they always had (a digest prefix); a record in Redis with the same secret wins.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from gateway.errors import InvalidRequest, Unauthorized
from gateway.tenants.auth import digest

Period = Literal["day", "total"]
Source = Literal["api", "seed", "static"]
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
SECRET_PREFIX = "fg-"


class Limits(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a key or a team may use; 0 means no limit."""

    rpm: float = 0.0
    tpm: float = 0.0
    # Tokens (input + output) per `budget_period`: a UTC day, or in total.
    budget_tokens: int = 0
    budget_period: Period = "day"
    # How much of a minute's limit may come at once (60: a whole minute's worth, as OpenAI does).
    burst_s: float = 60.0

    @property
    def limited(self) -> bool:
        return self.rpm > 0 or self.tpm > 0 or self.budget_tokens > 0


class TeamSpec(Limits, frozen=True):
    """A team as the YAML seed or `PUT /admin/teams/{id}` gives it."""


class TeamRecord(Limits, frozen=True):
    id: str
    source: Source = "api"


class KeySpec(Limits, frozen=True):
    """A key as the YAML seed or `PUT /admin/keys/{id}` gives it: the secret in clear (hashed
    at once), or only its digest; neither on a PUT that changes an existing key's limits."""

    secret: str | None = None
    secret_sha256: str | None = None
    team: str = ""
    priority: str = "default"
    models: tuple[str, ...] | None = None


class KeyRecord(Limits, frozen=True):
    id: str
    secret_sha256: str
    team: str = ""
    # Read by priority scheduling (admission); "default" unless said.
    priority: str = "default"
    # None: every model; else only these (models or adapters).
    models: tuple[str, ...] | None = None
    source: Source = "api"
    created_at: float = 0.0

    def public(self) -> dict[str, object]:
        """The record without its digest, for the admin API and the CLI."""
        out = msgspec.structs.asdict(self)
        del out["secret_sha256"]
        out["models"] = list(self.models) if self.models is not None else None
        return out


def check_id(kind: str, value: str) -> str:
    if not ID_RE.match(value):
        raise InvalidRequest(f"A {kind} id is 1-64 letters, digits and `_.@-`, starting with a letter or "
                             f"digit; got `{value}`.", param="id")
    return value


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _limits(spec: Limits) -> dict[str, object]:
    return {f: getattr(spec, f) for f in Limits.__struct_fields__}


def team_record(team_id: str, spec: TeamSpec, source: Source = "api") -> TeamRecord:
    _check_limits(spec)
    return TeamRecord(id=check_id("team", team_id), source=source, **_limits(spec))  # type: ignore[arg-type]


def key_record(
    key_id: str, spec: KeySpec, *, existing: KeyRecord | None = None, source: Source = "api",
) -> tuple[KeyRecord, str | None]:
    """The record a spec makes, and the secret in clear when the spec gave one or none existed
    (generated: shown once, never stored). A spec without a secret keeps the existing one."""
    check_id("key", key_id)
    _check_limits(spec)
    if spec.secret is not None and spec.secret_sha256 is not None:
        raise InvalidRequest("Give `secret` or `secret_sha256`, not both.", param="secret")
    shown: str | None = None
    if spec.secret is not None:
        if len(spec.secret) < 16:
            raise InvalidRequest("A key's secret must be at least 16 characters.", param="secret")
        sha, shown = secret_digest(spec.secret), spec.secret
    elif spec.secret_sha256 is not None:
        if not re.fullmatch(r"[0-9a-f]{64}", spec.secret_sha256):
            raise InvalidRequest("`secret_sha256` must be 64 lowercase hex digits.", param="secret_sha256")
        sha = spec.secret_sha256
    elif existing is not None:
        sha = existing.secret_sha256
    else:
        shown = new_secret()
        sha = secret_digest(shown)
    record = KeyRecord(
        id=key_id, secret_sha256=sha, team=spec.team, priority=spec.priority or "default",
        models=tuple(spec.models) if spec.models is not None else None, source=source,
        created_at=existing.created_at if existing is not None else round(time.time(), 3),
        **_limits(spec),  # type: ignore[arg-type]
    )
    return record, shown


def _check_limits(spec: Limits) -> None:
    for name in ("rpm", "tpm", "budget_tokens"):
        if getattr(spec, name) < 0:
            raise InvalidRequest(f"`{name}` must be 0 (no limit) or more.", param=name)
    if spec.burst_s <= 0:
        raise InvalidRequest("`burst_s` must be more than 0.", param="burst_s")


def static_key(secret: str) -> KeyRecord:
    """A key of the flat `api_keys` list: no limits, the id it always had (a digest prefix)."""
    raw = digest(secret)
    return KeyRecord(id=raw[:4].hex(), secret_sha256=raw.hex(), source="static")


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated key with its team (None: no team, or one that is not defined)."""

    key: KeyRecord
    team: TeamRecord | None
    # Whether the key or its team has any limit (else quota skips Redis entirely).
    limited: bool = field(init=False, repr=False, compare=False)
    # Whether a limit counts this key's tokens (its own or its team's tpm or budget): then
    # a request's end must correct its charge before the next request is checked.
    counts_tokens: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Both are read on every request of the key: worked out once (a Tenant is immutable).
        key, team = self.key, self.team
        object.__setattr__(self, "limited", key.limited or (team is not None and team.limited))
        object.__setattr__(self, "counts_tokens", any(
            lim is not None and (lim.tpm > 0 or lim.budget_tokens > 0) for lim in (key, team)))

    @property
    def id(self) -> str:
        return self.key.id

    @property
    def priority(self) -> str:
        """The key's priority class, for admission's scheduling."""
        return self.key.priority

    def allows(self, model: str) -> bool:
        return self.key.models is None or model in self.key.models


class Directory:
    """Every key and team one replica knows, immutable; rebuilt whole on a change."""

    def __init__(
        self, keys: Iterable[KeyRecord] = (), teams: Iterable[TeamRecord] = (), static: Iterable[str] = (),
        version: int = 0,
    ) -> None:
        self.teams: Mapping[str, TeamRecord] = {t.id: t for t in teams}
        self.keys: Mapping[str, KeyRecord] = {k.id: k for k in keys}
        self.version = version
        by_digest: dict[bytes, Tenant] = {}
        for secret in static:
            record = static_key(secret)
            by_digest[bytes.fromhex(record.secret_sha256)] = Tenant(record, None)
        for record in self.keys.values():  # a stored record wins over a static key's
            by_digest[bytes.fromhex(record.secret_sha256)] = Tenant(record, self.teams.get(record.team))
        self._by_digest = by_digest
        self._accepted: dict[str, Tenant] = {}
        # Metric labels: only the ids of configured keys.
        self.ids = frozenset(t.id for t in by_digest.values())

    @property
    def open(self) -> bool:
        """No key at all: the data plane takes every request (say so in the docs)."""
        return not self._by_digest

    def authenticate(self, authorization: str) -> Tenant | None:
        """The tenant an `Authorization` header names; None on an open data plane."""
        if not self._by_digest:
            return None
        # A client sends the same header on every request: hashed once per directory (which
        # is immutable). Only accepted headers are kept, so wrong keys cannot fill it.
        tenant = self._accepted.get(authorization)
        if tenant is not None:
            return tenant
        scheme, _, token = authorization.partition(" ")
        tenant = self._by_digest.get(digest(token.strip() if scheme.lower() == "bearer" else ""))
        if tenant is None:
            raise Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>`.")
        if len(self._accepted) < 4096:
            self._accepted[authorization] = tenant
        return tenant

