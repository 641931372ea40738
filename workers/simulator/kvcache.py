"""The KV cache: fixed-size blocks, reference counts, and a prefix cache over them.

Like vLLM's block pool, a block whose last user finished keeps its content hash and sits in
an LRU of free-but-cached blocks; a new prompt whose leading full blocks hash the same
reuses them instead of recomputing. Allocation takes never-hashed blocks first, then evicts
the least recently freed cached block, so the prefix cache holds exactly the free blocks.
Block hashes chain (each depends on the previous one), and the chain starts from the
adapter's name, so every adapter has its own namespace. As in vLLM, every full block of a
sequence is hashed and cached, a prompt's or one that its generated tokens filled, with the
same chain: a later prompt that quotes the answer hits its blocks as far as its token ids
match the generated ones.

With an event sink attached (`events`, the simulator's publisher of vLLM's KV cache events,
workers/simulator/kv_events.py) the pool reports what vLLM's block pool reports, with the
hashes its own lookups use: `cache_full_blocks` one BlockStored per run of newly cached
blocks (chained to the block before the run), an eviction one BlockRemoved per block, `reset`
AllBlocksCleared. Without one it behaves exactly as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from fleetgate.hashing import stable_hash


class KvEventSink(Protocol):
    """Where the pool reports cache changes (vLLM's BlockStored / BlockRemoved /
    AllBlocksCleared); the sink batches them."""

    def stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
        block_size: int, lora_name: str | None,
    ) -> None: ...  # fmt: skip
    def removed(self, block_hash: int) -> None: ...
    def cleared(self) -> None: ...


def block_hashes(ids: Sequence[int], block_size: int, namespace: str) -> list[int]:
    """Chained hashes of the full blocks of `ids`."""
    hashes: list[int] = []
    extend_hashes(hashes, ids, block_size, namespace)
    return hashes


def extend_hashes(hashes: list[int], ids: Sequence[int], block_size: int, namespace: str) -> None:
    """Append to `hashes` (those of the first blocks of `ids`) the chained hashes of the
    further full blocks of `ids`: a sequence's generated tokens continue its prompt's chain."""
    prev = hashes[-1] if hashes else stable_hash("prefix", namespace)
    for start in range(len(hashes) * block_size, len(ids) - block_size + 1, block_size):
        # Python's hash of a tuple of ints is not salted: stable across processes.
        prev = hash((prev, tuple(ids[start : start + block_size])))
        hashes.append(prev)


class BlockPool:
    def __init__(self, num_blocks: int, events: KvEventSink | None = None) -> None:
        self.num_blocks = num_blocks
        self.events = events
        self._refs = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

    def reset(self) -> None:
        """Forget every cached block, as vLLM's reset_prefix_cache (only when none is in use)."""
        if any(self._refs):
            raise RuntimeError("blocks are in use")
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        if self.events is not None:
            self.events.cleared()

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks holding the longest prefix of `hashes` (at most max_blocks)."""
        found: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are free (reusing them takes them out of the free pool)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"{n} blocks wanted, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                h = self._hash_of.pop(block)
                del self._block_of[h]
                if self.events is not None:
                    self.events.removed(h)
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, h: int) -> bool:
        """Record that `block` holds the content hashed `h` (first holder wins): whether it did."""
        if h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = h
            return True
        return False

    def cache_full_blocks(
        self, blocks: Sequence[int], hashes: Sequence[int], num_cached: int, num_full: int,
        token_ids: Sequence[int], block_size: int, lora_name: str | None = None,
    ) -> None:  # fmt: skip
        """Register blocks[num_cached:num_full] under their hashes, as vLLM's
        BlockPool.cache_full_blocks; `token_ids` are the sequence's tokens from its first on,
        prompt and generated, at least to the end of these blocks (BlockStored carries them,
        as vLLM's carries `request.all_token_ids`). A block whose hash another block already
        holds is not cached (first holder wins), so the events report runs of the blocks
        that were, each chained to the block before it."""
        if self.events is None:
            for j in range(num_cached, num_full):
                self.register(blocks[j], hashes[j])
            return
        start = num_cached
        for j in range(num_cached, num_full + 1):
            if j < num_full and self.register(blocks[j], hashes[j]):
                continue
            if j > start:
                self._report_stored(hashes, start, j, token_ids, block_size, lora_name)
            start = j + 1

    def _report_stored(
        self, hashes: Sequence[int], start: int, end: int, token_ids: Sequence[int],
        block_size: int, lora_name: str | None,
    ) -> None:  # fmt: skip
        assert self.events is not None
        tokens = list(token_ids[start * block_size : end * block_size])
        if len(tokens) != (end - start) * block_size:
            raise ValueError(f"blocks {start}..{end - 1} are not full: {len(tokens)} tokens known")
        parent = hashes[start - 1] if start else None
        self.events.stored(hashes[start:end], parent, tokens, block_size, lora_name)

    def release(self, blocks: Sequence[int]) -> None:
        # Tail blocks first, so that they are evicted before the shared head of a prompt.
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

