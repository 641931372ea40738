"""The kernel's small pieces: one stable hash for gateway and simulator, Redis URLs parsed."""

from __future__ import annotations

import hashlib

import pytest

from fleetgate.connection import _nodes, connect
from fleetgate.hashing import stable_hash


def test_stable_hash_of_parts_is_the_blake2b_of_them_joined_by_nul() -> None:
    """The simulator's seeds (several parts) and the gateway's keys (one part) share one hash,
    pinned to its formula so that neither can drift: the prefix cache and affinity depend on it."""
    def reference(*parts: str) -> int:
        return int.from_bytes(hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest(), "little")

    assert stable_hash("prefix", "ns") == reference("prefix", "ns")
    assert stable_hash("w1") == reference("w1") == stable_hash(b"w1")
    assert stable_hash("a", "b") != stable_hash("ab")


def test_sentinel_and_cluster_urls_name_their_nodes_password_and_path() -> None:
    """`scheme[:password@]host:port,host[/a/b]`: default ports filled in, the path split."""
    assert _nodes("redis+sentinel://:pw@s1:26380,s2/mymaster/2", "redis+sentinel://", 26379) == (
        "pw", [("s1", 26380), ("s2", 26379)], ["mymaster", "2"])
    assert _nodes("redis+cluster://n1:7000,n2:7001", "redis+cluster://", 6379) == (
        None, [("n1", 7000), ("n2", 7001)], [])


def test_a_sentinel_url_without_a_master_and_a_cluster_db_are_refused() -> None:
    """The two mistakes a URL can make are said at start, not on the first command."""
    with pytest.raises(ValueError, match="names the master"):
        connect("redis+sentinel://s1:26379")
    with pytest.raises(ValueError, match="only database 0"):
        connect("redis+cluster://n1:7000/3")


def test_no_two_test_files_share_a_name() -> None:
    """tests/ has no __init__.py files: pytest imports test modules by file name, so two
    test_x.py in different folders fail the whole run's collection (`make test`)."""
    from collections import Counter
    from pathlib import Path

    tests = Path(__file__).resolve().parent.parent
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
