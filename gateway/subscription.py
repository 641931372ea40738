"""Following a Redis pub/sub channel to wake a re-read: the registry's events (gateway/fleet.py)
and the tenants' (gateway/tenants/tenant_store.py) both ride on this loop.

Each message sets `wake`; a lost connection is subscribed again with a doubling backoff of
at most `max_backoff_s()` (a re-read interval: the periodic re-read covers the gap).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


async def follow(
    subscribe: Callable[[], Awaitable[Any]], wake: asyncio.Event, max_backoff_s: Callable[[], float],
    *, wake_on_subscribe: bool = False,
) -> None:
    """Run until cancelled. `subscribe()` returns a subscribed redis-py PubSub.
    `wake_on_subscribe`: also wake once subscribed (for whatever changed while unsubscribed)."""
    backoff = 0.1
    while True:
        pubsub = None
        try:
            pubsub = await subscribe()
            backoff = 0.1
            if wake_on_subscribe:
                wake.set()
            async for _message in pubsub.listen():
                wake.set()
        except asyncio.CancelledError:
            raise
        except Exception:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s())
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
