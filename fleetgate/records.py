"""A worker's record as it lies in Redis: encoding, decoding, and its registration signature.

With a registration secret, agents sign their `info` (HMAC-SHA256) and readers ignore a
record that is not signed with it, so nothing can point a gateway at an arbitrary URL.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from fleetgate.hashing import stable_hash
from fleetgate.schema import SCHEMA_VERSION, Load, WorkerInfo, WorkerView

_encoder = msgspec.json.Encoder()
_info_decoder = msgspec.json.Decoder(WorkerInfo)
_load_decoder = msgspec.json.Decoder(Load)


def encode(record: WorkerInfo | Load) -> bytes:
    return _encoder.encode(record)


def sign(secret: str, info: bytes) -> str:
    return hmac.new(secret.encode(), info, hashlib.sha256).hexdigest()


def unsigned(fields: dict[bytes, bytes], secret: str) -> str:
    """Why a worker hash is not signed with `secret` ("" when it is, or no secret is set)."""
    raw_info = fields.get(b"info")
    if not secret or not raw_info:
        return ""
    sig = fields.get(b"sig", b"").decode(errors="replace")
    if hmac.compare_digest(sig, sign(secret, raw_info)):
        return ""
    return "signed with another registration secret" if sig else "not signed (no registration secret)"


def decode_worker(
    fields: dict[bytes, bytes], circuit: bytes | None = None, secret: str = ""
) -> WorkerView | None:
    """A worker hash as read from Redis, or None if it is incomplete, of another schema,
    or (with a registration secret) not signed with it."""
    raw_info = fields.get(b"info")
    if not raw_info or unsigned(fields, secret):
        return None
    try:
        info = _info_decoder.decode(raw_info)
    except msgspec.DecodeError:
        return None
    if info.schema != SCHEMA_VERSION:
        return None
    state = fields.get(b"state", b"starting").decode()
    if state not in ("starting", "ready", "draining"):
        state = "starting"
    raw_load = fields.get(b"load")
    try:
        load = _load_decoder.decode(raw_load) if raw_load else Load()
    except msgspec.DecodeError:
        load = Load()
    return WorkerView(
        info=info,
        state=state,  # type: ignore[arg-type]
        load=load,
        last_heartbeat=float(fields.get(b"hb", b"0") or 0),
        admin_drain=fields.get(b"drain") == b"1",
        id_hash=stable_hash(info.id),
        circuit=circuit.decode(errors="replace") if circuit else "",
    )
