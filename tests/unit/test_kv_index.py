"""The block index rebuilt from KV cache events (fleetgate/kv_index.py), and the simulator's
block pool reporting them (workers/simulator/kvcache.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from fleetgate.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from fleetgate.kv_index import BlockIndex, chain_keys
from fleetgate.kv_registry import pack_keys, unpack_keys
from workers.simulator.kvcache import BlockPool, block_hashes

BS = 4
PROMPT = list(range(100, 112))  # three blocks


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    fields.update(kw)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, **fields)


def batch(*events: Any) -> EventBatch:
    return EventBatch(ts=0.0, events=list(events), data_parallel_rank=0)


def test_chain_keys_are_the_same_in_every_process() -> None:
    """A gateway and an agent compute the same keys whatever their PYTHONHASHSEED."""
    code = "from fleetgate.kv_index import chain_keys; print(chain_keys(list(range(100, 112)), 4, 'lo'))"
    outs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    assert outs == {f"{chain_keys(PROMPT, BS, 'lo')}\n"}


def test_stored_blocks_are_indexed_under_the_prompt_chain_keys() -> None:
    """Keys come from token ids and the parent chain, not from the engine's hashes: a batch
    that continues an earlier one (parent = its last hash) extends the same chain."""
    index = BlockIndex()
    index.apply(batch(stored([0xA1, 0xA2], None, PROMPT[:8])))
    index.apply(batch(stored([0xA3], 0xA2, PROMPT[8:])))
    keys = chain_keys(PROMPT, BS)
    assert all(k in index for k in keys) and len(index) == 3
    assert index.block_size == BS


def test_lora_blocks_live_in_their_adapter_namespace() -> None:
    """The same tokens under an adapter are other blocks (vLLM hashes the LoRA name in)."""
    index = BlockIndex()
    index.apply(batch(stored([1, 2], None, PROMPT[:8], lora_name="fin", extra_keys=[("fin",), ("fin",)])))
    assert all(k in index for k in chain_keys(PROMPT[:8], BS, "fin"))
    assert not any(k in index for k in chain_keys(PROMPT[:8], BS))


def test_blocks_hashed_with_more_than_tokens_match_no_text_prompt() -> None:
    """A block whose hash took in an image or a cache salt, and its children, never match."""
    index = BlockIndex()
    index.apply(batch(stored([1], None, PROMPT[:4], extra_keys=[("salt-x",)])))
    index.apply(batch(stored([2], 1, PROMPT[4:8])))
    assert len(index) == 2
    assert not any(k in index for k in chain_keys(PROMPT[:8], BS))
    assert all(-(2**63) <= k < 2**63 for k in index.keys())  # packed as int64 for Redis
    assert sorted(unpack_keys(pack_keys(index.keys()))) == sorted(index.keys())


def test_removal_counts_copies_of_a_hash() -> None:
    """vLLM can hold a hash in two blocks and removes each: the key stays until the last."""
    index = BlockIndex()
    index.apply(batch(stored([1], None, PROMPT[:4]), stored([1], None, PROMPT[:4])))
    [key] = chain_keys(PROMPT[:4], BS)
    index.apply(batch(BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)))
    assert key in index
    index.apply(batch(BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)))
    assert key not in index and len(index) == 0


def test_orphans_other_groups_and_media_are_not_indexed() -> None:
    """A block whose parent was never seen cannot be keyed; sliding-window groups and CPU
    copies are not what a gateway matches; removals of unknown hashes are ignored."""
    index = BlockIndex()
    index.apply(batch(
        stored([5], 999, PROMPT[:4]),
        stored([6], None, PROMPT[:4], group_idx=1),
        stored([7], None, PROMPT[:4], kv_cache_spec_kind="sliding_window"),
        stored([8], None, PROMPT[:4], medium="CPU"),
        BlockRemoved(block_hashes=[12345], medium="GPU", group_idx=0),
    ))  # fmt: skip
    assert len(index) == 0 and index.orphans == 1


def test_delta_reports_net_changes_and_clears() -> None:
    """A delta holds what appeared and vanished since the last one; a key stored and evicted
    in between is in neither; AllBlocksCleared starts the next delta from nothing."""
    index = BlockIndex()
    index.apply(batch(stored([1, 2], None, PROMPT[:8])))
    k1, k2 = chain_keys(PROMPT[:8], BS)
    delta = index.take_delta()
    assert delta.added == {k1, k2} and not delta.removed and not delta.cleared
    index.apply(batch(stored([3], 2, PROMPT[8:]), BlockRemoved(block_hashes=[3], medium="GPU"),
                      BlockRemoved(block_hashes=[2], medium="GPU")))  # fmt: skip
    delta = index.take_delta()
    assert not delta.added and delta.removed == {k2}
    index.apply(batch(AllBlocksCleared(), stored([9], None, PROMPT[:4])))
    delta = index.take_delta()
    assert delta.cleared and delta.added == {k1} and len(index) == 1
    assert not index.take_delta()


# --- the simulator's block pool -----------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               block_size: int, lora_name: str | None) -> None:  # fmt: skip
        self.events.append(("stored", list(hashes), parent, list(token_ids), lora_name))

    def removed(self, block_hash: int) -> None:
        self.events.append(("removed", block_hash))

    def cleared(self) -> None:
        self.events.append(("cleared",))


def test_pool_reports_stored_runs_chained_to_the_block_before() -> None:
    """cache_full_blocks reports the newly cached blocks with the hashes the pool looks up,
    their tokens (generated ones with their ids, as vLLM's all_token_ids) and the previous
    block as parent."""
    rec = Recorder()
    pool = BlockPool(8, events=rec)
    tokens = [*PROMPT, 7, 8, 9, 10]  # a prompt of three blocks and a block of generated tokens
    hashes = block_hashes(tokens, BS, "")
    blocks = pool.allocate(4)
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens, BS)
    pool.cache_full_blocks(blocks, hashes, 2, 4, tokens, BS, None)
    assert rec.events == [
        ("stored", hashes[:2], None, PROMPT[:8], None),
        ("stored", hashes[2:4], hashes[1], [*PROMPT[8:], 7, 8, 9, 10], None),
    ]
    assert pool.lookup(hashes, 4) == blocks  # the published hashes are the lookup's


def test_pool_reports_evictions_and_resets() -> None:
    """Evicting a cached block reports its hash; reset reports AllBlocksCleared."""
    rec = Recorder()
    pool = BlockPool(2, events=rec)
    hashes = block_hashes(PROMPT[:8], BS, "a")
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2, PROMPT, BS, "a")
    pool.release(blocks)
    taken = pool.allocate(1)  # evicts the tail block first
    assert rec.events[-1] == ("removed", hashes[1])
    pool.release(taken)
    pool.reset()
    assert rec.events[-1] == ("cleared",)
    assert pool.lookup(hashes, 2) == [] and pool.num_free == 2


def test_a_hash_held_elsewhere_splits_the_run() -> None:
    """First holder wins: a block whose hash another block holds is not cached, so it is not
    reported, and the blocks after it are a run of their own chained to it."""
    rec = Recorder()
    pool = BlockPool(8, events=rec)
    hashes = block_hashes(PROMPT, BS, "")
    first = pool.allocate(2)
    pool.cache_full_blocks(first, hashes, 1, 2, PROMPT, BS)  # someone holds hashes[1]
    rec.events.clear()
    other = pool.allocate(3)
    pool.cache_full_blocks(other, hashes, 0, 3, PROMPT, BS)
    assert rec.events == [
        ("stored", hashes[:1], None, PROMPT[:4], None),
        ("stored", hashes[2:3], hashes[1], PROMPT[8:12], None),
    ]


def test_pool_without_events_behaves_as_before() -> None:
    """With no sink attached the pool caches, hits and evicts exactly as with one."""
    pools = [BlockPool(6), BlockPool(6, events=Recorder())]
    for pool in pools:
        for p in range(3):
            prompt = [p] * 4 + PROMPT[:8]
            hashes = block_hashes(prompt, BS, "")
            blocks = pool.allocate(3)
            pool.cache_full_blocks(blocks, hashes, 0, 3, prompt, BS)
            pool.release(blocks)
    states = [
        (pool.num_free, [pool.lookup(block_hashes([p] * 4 + PROMPT[:8], BS, ""), 3) for p in range(3)])
        for pool in pools
    ]
    assert states[0] == states[1]
