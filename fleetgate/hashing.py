"""Stable 64-bit hashing for affinity: the same on every gateway replica and every run.

Python's own `hash()` of a string is salted per process, so it cannot be used to make
replicas agree. Workers get a blake2b digest once per snapshot; a request's key is
hashed once; rendezvous (highest-random-weight) ranking then mixes the two with
splitmix64, which is a handful of integer operations per worker.
"""

from __future__ import annotations

import hashlib

_MASK = (1 << 64) - 1


def stable_hash(*parts: str | bytes) -> int:
    """blake2b-64 of the parts joined by NUL: the same in every process and every run."""
    if len(parts) == 1:
        raw = parts[0].encode() if isinstance(parts[0], str) else parts[0]
    else:
        raw = b"\x00".join(p.encode() if isinstance(p, str) else p for p in parts)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def mix(a: int, b: int) -> int:
    """splitmix64 of a ^ b: a well-spread 64-bit weight for rendezvous hashing."""
    z = (a ^ b) & _MASK
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)
