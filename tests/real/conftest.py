"""Fixtures for tests/real: the pool of shared real vLLM servers (tests/real/vllm_pool.py says
which servers, who shares them and why), and the order that lets each start once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real.vllm_pool import KILLERS, USERS, VllmPool, require_vllm

REAL = Path(__file__).resolve().parent


def _real(item: pytest.Item) -> bool:
    return item.path.parent == REAL


@pytest.fixture(scope="session")
def vllm_pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, redis_url: str,
) -> Iterator[VllmPool]:
    """The pool; on first use (the first module that uses a shared server, after
    test_vllm_e2e's own engines have stopped: a start-up beside engines under test starves
    them on 2 cores) it starts every server (and fleet) the collected tests of tests/real use."""
    require_vllm()
    pool = VllmPool(tmp_path_factory.mktemp("vllm-pool"), redis_url)
    modules = {item.path.name for item in request.session.items if _real(item)}
    for module, names in USERS.items():
        if module in modules:
            for name in names:
                pool.start(name)
    try:
        yield pool
    finally:
        pool.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that kill a shared server run right after the other tests of tests/real."""

    def taker(item: pytest.Item) -> bool:
        return _real(item) and KILLERS.get(item.path.name) == getattr(item, "originalname", item.name)

    takers = [i for i in items if taker(i)]
    if not takers:
        return
    rest = [i for i in items if not taker(i)]
    after = max((n + 1 for n, i in enumerate(rest) if _real(i)), default=len(rest))
    items[:] = rest[:after] + takers + rest[after:]
