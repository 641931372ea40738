"""The KV cache: fixed-size blocks, reference counts, and a prefix cache over them.

Like vLLM's block pool, a block whose last user finished keeps its content hash and sits in
an LRU of free-but-cached blocks; a new prompt whose leading full blocks hash the same
reuses them instead of recomputing. Allocation takes never-hashed blocks first, then evicts
the least recently freed cached block, so the prefix cache holds exactly the free blocks.
Block hashes chain (each depends on the previous one), and the chain starts from the
adapter's name, so every adapter has its own namespace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fleetgate.hashing import stable_hash


def block_hashes(ids: Sequence[int], block_size: int, namespace: str) -> list[int]:
    """Chained hashes of the full blocks of `ids`."""
    hashes: list[int] = []
    prev = stable_hash("prefix", namespace)
    for start in range(0, len(ids) - block_size + 1, block_size):
        # Python's hash of a tuple of ints is not salted: stable across processes.
        prev = hash((prev, tuple(ids[start : start + block_size])))
        hashes.append(prev)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

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
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, h: int) -> None:
        """Record that `block` holds the content hashed `h` (first holder wins)."""
        if h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        # Tail blocks first, so that they are evicted before the shared head of a prompt.
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)


class LoraSlots:
    """Adapters resident in the engine's `max_loras` slots, least recently used first.

    `pinned` adapters are loaded at start and never leave (LMDeploy loads every adapter
    it is started with into GPU memory at start-up); they take no slot from the others.
    """

    def __init__(self, max_loras: int, pinned: tuple[str, ...] = ()) -> None:
        self.max_loras = max_loras
        self.pinned = frozenset(pinned)
        self._slots: OrderedDict[str, None] = OrderedDict()

    @property
    def resident(self) -> list[str]:
        return sorted(self.pinned) + list(self._slots)

    def acquire(self, name: str, busy: set[str]) -> bool | None:
        """Take a slot for `name`: False if resident already, True if it had to be loaded
        (evicting the least recently used adapter with no running request), None if every
        slot is busy."""
        if name in self.pinned:
            return False
        if name in self._slots:
            self._slots.move_to_end(name)
            return False
        if len(self._slots) >= self.max_loras:
            victim = next((a for a in self._slots if a not in busy), None)
            if victim is None:
                return None
            del self._slots[victim]
        self._slots[name] = None
        return True

    def drop(self, name: str) -> None:
        self._slots.pop(name, None)
