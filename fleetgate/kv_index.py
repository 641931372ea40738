"""What one engine has in its prefix cache, rebuilt from its KV cache events.

Blocks are indexed under fleetgate's own chain keys, not the engine's hashes: a key is
computed from the block's token ids and its parent's key (the first block's parent is the
LoRA adapter's root), so a gateway computes the keys of a prompt from its token ids alone,
whatever hash function and seed the engine uses (vLLM 0.26 seeds its chain at random unless
PYTHONHASHSEED is set; llm-d's indexer does the same for the same reason). The engine's
hashes are kept only to follow its chain (`parent_block_hash`) and its removals.

`chain_keys` hashes a tuple of ints with Python's `hash`, which is not salted (only str,
bytes and datetime are): it is the same in every process on a 64-bit CPython, and costs a
fraction of a microsecond per block.

`BlockIndex` applies decoded events and records what changed since the last `take_delta()`,
so that the agent publishes changes, not the whole set (fleetgate/kv_registry.py). Only what
the gateway can match is indexed:

- blocks of the full-attention KV cache group (sliding-window or Mamba groups of hybrid models
  are skipped), held on the GPU (`medium` GPU or unset);
- a block whose hash took in more than the LoRA name (an image, a cache salt) gets a key no
  prompt text maps to, so that it and its children never match a text-only prompt;
- vLLM can hold two physical blocks with the same hash and removes each: counted per hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fleetgate.hashing import mix, stable_hash
from fleetgate.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["BlockIndex", "Delta", "chain_keys", "root_key"]

_FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_OPAQUE = stable_hash("kv-opaque")


def _opaque(*parts: int) -> int:
    """A key no prompt's chain reaches, signed 64-bit like Python's hashes (keys are packed
    as int64 for Redis)."""
    z = 0
    for part in parts:
        z = mix(z, part & 0xFFFF_FFFF_FFFF_FFFF)
    return z - (1 << 64) if z >= 1 << 63 else z


def root_key(lora_name: str | None) -> int:
    """The parent key of a prompt's first block: one namespace per adapter, as in vLLM."""
    return stable_hash("kv-root", lora_name or "")


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    parent: int | None = None,
) -> list[int]:
    """The keys of the full blocks of `token_ids`, chained from `parent` (default: the root)."""
    prev = root_key(lora_name) if parent is None else parent
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start : start + block_size])))
        keys.append(prev)
    return keys


@dataclass
class Delta:
    """Keys that appeared and vanished since the last delta; `cleared`: start from nothing."""

    added: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.cleared)


class BlockIndex:
    def __init__(self) -> None:
        self._key_of: dict[bytes | int, int] = {}  # engine hash -> our key
        self._copies: dict[bytes | int, int] = {}  # engine hash -> physical blocks holding it
        self._key_refs: dict[int, int] = {}  # our key -> engine hashes mapped to it
        self._delta = Delta()
        self.block_size = 0
        # Blocks whose parent this index never saw (stored before it started, or lost in a
        # gap): not indexed. A growing count says the index is incomplete.
        self.orphans = 0

    def __len__(self) -> int:
        return len(self._key_refs)

    def __contains__(self, key: int) -> bool:
        return key in self._key_refs

    def keys(self) -> Iterable[int]:
        return self._key_refs.keys()

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        self._key_of.clear()
        self._copies.clear()
        self._key_refs.clear()
        self._delta = Delta(cleared=True)

    def take_delta(self) -> Delta:
        delta, self._delta = self._delta, Delta()
        return delta

    @staticmethod
    def _tracked(group_idx: int | None, medium: str | None) -> bool:
        return (group_idx or 0) == 0 and medium in (None, "GPU")

    def _stored(self, ev: BlockStored) -> None:
        if not self._tracked(ev.group_idx, ev.medium):
            return
        if ev.kv_cache_spec_kind is not None and ev.kv_cache_spec_kind not in _FULL_KINDS:
            return
        if ev.parent_block_hash is None:
            parent: int | None = root_key(ev.lora_name)
        else:
            parent = self._key_of.get(ev.parent_block_hash)
        if parent is None:
            self.orphans += len(ev.block_hashes)
            return
        bs = ev.block_size
        self.block_size = bs
        aligned = len(ev.token_ids) == len(ev.block_hashes) * bs
        extra = ev.extra_keys or []
        for i, engine_hash in enumerate(ev.block_hashes):
            if aligned:
                key = hash((parent, tuple(ev.token_ids[i * bs : (i + 1) * bs])))
                more = extra[i] if i < len(extra) else None
                if more and tuple(more) != (ev.lora_name,):
                    key = _opaque(_OPAQUE, key, stable_hash(repr(more)))
            else:  # tokens that do not tile the blocks: keep the chain, match nothing
                key = _opaque(_OPAQUE, hash(engine_hash))
            self._add(engine_hash, key)
            parent = key

    def _add(self, engine_hash: bytes | int, key: int) -> None:
        copies = self._copies.get(engine_hash, 0)
        self._copies[engine_hash] = copies + 1
        if copies:
            return
        self._key_of[engine_hash] = key
        refs = self._key_refs.get(key, 0)
        self._key_refs[key] = refs + 1
        if not refs:
            if key in self._delta.removed:
                self._delta.removed.discard(key)
            else:
                self._delta.added.add(key)

    def _removed(self, ev: BlockRemoved) -> None:
        if not self._tracked(ev.group_idx, ev.medium):
            return
        for engine_hash in ev.block_hashes:
            copies = self._copies.get(engine_hash)
            if copies is None:  # never indexed (an orphan, another group's)
                continue
            if copies > 1:
                self._copies[engine_hash] = copies - 1
                continue
            del self._copies[engine_hash]
            key = self._key_of.pop(engine_hash)
            refs = self._key_refs[key] - 1
            if refs:
                self._key_refs[key] = refs
                continue
            del self._key_refs[key]
            if key in self._delta.added:
                self._delta.added.discard(key)
            else:
                self._delta.removed.add(key)
