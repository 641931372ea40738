"""The models this fleet serves or served recently.

Two answers depend on it. A request for a model no worker serves right now gets 404
`model_not_found` only when the model was never served (in the last `memory_s`): a
model whose workers just left (a restart, a crash, a redeploy) gets 503 + Retry-After,
which clients retry; so does every model while the gateway cannot read its registry,
since it cannot tell. And only these names become Prometheus label values: a client
choosing random model names must not create series (they are counted as `unknown`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from gateway.errors import GatewayError, NoWorkerAvailable

UNKNOWN = "unknown"


class KnownModels:
    def __init__(self, memory_s: float = 600.0) -> None:
        self.memory_s = memory_s
        # Model or adapter name -> monotonic time it was last seen in the registry.
        self._seen: dict[str, float] = {}

    def note(self, names: Iterable[str]) -> None:
        """The names the registry holds now (at each refresh); forgets those gone too long."""
        now = time.monotonic()
        seen = self._seen
        for name in names:
            seen[name] = now
        cutoff = now - self.memory_s
        for name in [n for n, at in seen.items() if at < cutoff]:
            del seen[name]

    def __contains__(self, name: object) -> bool:
        return name in self._seen

    def label(self, model: str) -> str:
        """`model` as a metrics label value: itself if the fleet serves (or served) it."""
        return model if model in self._seen else UNKNOWN

    def absent(self, model: str, *, registry_read: bool, registry_up: bool) -> GatewayError | None:
        """The answer for a request naming a model no worker serves now; None: a 404 is right."""
        if not registry_read:
            return NoWorkerAvailable(
                "The gateway has not been able to read its worker registry (Redis) yet, so it "
                "cannot tell which models are served; try again shortly.",
                code="registry_unavailable", retry_after=2,
            )
        if not registry_up and model not in self._seen:
            return NoWorkerAvailable(
                f"The gateway cannot reach its worker registry (Redis) and its last view of the "
                f"fleet has no worker for `{model}`; try again shortly.",
                code="registry_unavailable", retry_after=2,
            )
        if model in self._seen:
            minutes = self.memory_s / 60
            return NoWorkerAvailable(
                f"No worker serves `{model}` right now: the fleet served it within the last "
                f"{minutes:g} minutes and its workers have left or are starting; try again shortly.",
                param="model", code="model_unavailable", retry_after=5,
            )
        return None
