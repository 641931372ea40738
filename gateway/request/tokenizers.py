"""The tokenizers the gateway counts prompt tokens with, per base model.

A model's tokenizer comes from the `tokenizers:` setting (base model -> tokenizer.json,
loaded at start; it wins), else from the registry: an agent that knows its model's
tokenizer.json registers its absolute path (`WorkerInfo.tokenizer`, workers/tokenizer.py)
and the first request for that model loads it, when the gateway's host can read the same
path (a shared model store, one host, the same image). A path that cannot be loaded is
logged once (`gateway.tokenizer_unusable`) and never tried again; without a tokenizer the
prompt is estimated (4 bytes a token, gateway/request/requests.py `estimate_tokens`).

The look-up on the request path is a dict read: the workers are scanned for a model's
tokenizer once per fleet snapshot, and only for models the fleet serves (a client-chosen
name grows nothing here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import structlog

from gateway.fleet import FleetSnapshot
from gateway.request.requests import TokenCounter

log = structlog.get_logger("gateway.tokenizers")


class Tokenizers:
    def __init__(
        self,
        configured: Mapping[str, str] | None = None,
        snapshot: Callable[[], FleetSnapshot] | None = None,
        load: Callable[[str], TokenCounter] = TokenCounter,
    ) -> None:
        self._configured = {model: load(path) for model, path in (configured or {}).items()}
        self._snapshot = snapshot
        self._load = load
        # tokenizer.json path -> its counter, None when it could not be loaded (logged once)
        self._by_path: dict[str, TokenCounter | None] = {}
        # base model -> (the snapshot it was looked up in, what was found)
        self._found: dict[str, tuple[FleetSnapshot, TokenCounter | None]] = {}

    def get(self, base: str) -> TokenCounter | None:
        """The counter for base model `base`, or None: estimate its prompts."""
        counter = self._configured.get(base)
        if counter is not None or self._snapshot is None:
            return counter
        snapshot = self._snapshot()
        found = self._found.get(base)
        if found is not None and found[0] is snapshot:
            return found[1]
        if base not in snapshot.models:
            return None
        paths = sorted({w.info.tokenizer for w in snapshot.workers if w.info.model == base and w.info.tokenizer})
        counter = next((c for path in paths if (c := self._from_path(path, base)) is not None), None)
        self._found[base] = (snapshot, counter)
        return counter

    def _from_path(self, path: str, model: str) -> TokenCounter | None:
        if path in self._by_path:
            return self._by_path[path]
        counter: TokenCounter | None = None
        try:
            counter = self._load(path)
        except Exception as exc:  # missing, unreadable or not a tokenizer: estimate instead
            log.warning("gateway.tokenizer_unusable", model=model, path=path, error=str(exc)[:200])
        else:
            log.info("gateway.tokenizer_loaded", model=model, path=path, source="registry")
        self._by_path[path] = counter
        return counter


__all__ = ["Tokenizers"]
