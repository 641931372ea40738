"""Client-side routing: strategies that send each request straight to an engine.

They sit beside the gateway's policies in `--policies` and get the identical request
sequence, but no gateway is between the client and the engines: the engine URLs come from
a gateway's `GET /admin/workers` (the registry), and each request goes to the engine the
strategy picks.

* `tenant_affinity`: the oracle of issue 14. It knows what no gateway is told, the tenant
  of every request (its `tenant-<i>` tag), and pins tenant i to worker i % N, the workers
  ordered by id. A request without a tenant tag is pinned by a hash of its first message
  (the system prompt), so other workloads still get a fixed home per prefix.
* `direct_round_robin`: the engines in turn, in arrival order, with no gateway's overhead.
* `adapter_affinity`: issue 36's simple LoRA client: the adapter named `<prefix><k>` (the
  `lora` workload's a0..a15) goes to worker k % N, the workers ordered by id; a model name
  without a trailing number by a hash of it. Each engine then sees a fixed 1/N of the
  adapters, however many slots it has.
* `conversation_affinity`: the multi-turn oracle (issue 31): conversation k (its `conv-<k>`
  tag, never sent) goes to worker k % N for all its turns, the workers ordered by id; other
  requests as `tenant_affinity` pins them. What a sticky client that knew the conversation
  would do; an ordinary OpenAI client sends nothing that tells a conversation apart.
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable, Sequence

from fleetgate_tools.bench.engines import WorkerRef
from fleetgate_tools.bench.workloads import BenchRequest

# A route: the engine a request goes to.
Route = Callable[[BenchRequest], WorkerRef]

CLIENT_STRATEGIES = ("tenant_affinity", "direct_round_robin", "adapter_affinity", "conversation_affinity")
_TENANT = re.compile(r"tenant-(\d+)")
_CONVERSATION = re.compile(r"conv-(\d+)")
_INDEX = re.compile(r".*?(\d+)")


def tenant_of(tag: str) -> int | None:
    """The tenant index in a `tenant-<i>` tag; None for other tags."""
    m = _TENANT.fullmatch(tag)
    return int(m[1]) if m else None


def routable(workers: Sequence[WorkerRef]) -> list[WorkerRef]:
    """The ready workers (all of them when the registry gave no state), ordered by id."""
    ready = [w for w in workers if w.state in ("", "ready")]
    return sorted(ready, key=lambda w: w.id)


def tenant_affinity(workers: Sequence[WorkerRef]) -> Route:
    pool = routable(workers)
    if not pool:
        raise ValueError("tenant_affinity: no ready worker")

    def route(req: BenchRequest) -> WorkerRef:
        tenant = tenant_of(req.tag)
        if tenant is None:
            head = req.messages[0]["content"] if req.messages else ""
            tenant = zlib.crc32(head.encode())
        return pool[tenant % len(pool)]

    return route


def adapter_index(model: str) -> int:
    """The number an adapter's name ends with (a7 -> 7); a hash of the name without one."""
    m = _INDEX.fullmatch(model)
    return int(m[1]) if m else zlib.crc32(model.encode())


def adapter_affinity(workers: Sequence[WorkerRef]) -> Route:
    pool = routable(workers)
    if not pool:
        raise ValueError("adapter_affinity: no ready worker")
    return lambda req: pool[adapter_index(req.model) % len(pool)]


def conversation_affinity(workers: Sequence[WorkerRef]) -> Route:
    pool = routable(workers)
    if not pool:
        raise ValueError("conversation_affinity: no ready worker")
    fallback = tenant_affinity(pool)

    def route(req: BenchRequest) -> WorkerRef:
        m = _CONVERSATION.fullmatch(req.tag)
        return pool[int(m[1]) % len(pool)] if m else fallback(req)

    return route


def direct_round_robin(workers: Sequence[WorkerRef]) -> Route:
    pool = routable(workers)
    if not pool:
        raise ValueError("direct_round_robin: no ready worker")
    turn = itertools.cycle(pool)
    return lambda _req: next(turn)


_FACTORIES: dict[str, Callable[[Sequence[WorkerRef]], Route]] = {
    "tenant_affinity": tenant_affinity,
    "direct_round_robin": direct_round_robin,
    "adapter_affinity": adapter_affinity,
    "conversation_affinity": conversation_affinity,
}


def make_route(name: str, workers: Sequence[WorkerRef]) -> Route:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown client strategy {name!r}; known: {', '.join(CLIENT_STRATEGIES)}") from None
    return factory(workers)
