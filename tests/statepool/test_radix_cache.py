"""The radix cache and block hashes on their own: matching, refs, LRU eviction, pruning, events."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridserve.common.block_hash import ROOT_HASH, block_hashes, hash_block
from hybridserve.statepool import (
    CheckpointAllocator,
    EventKind,
    EventLog,
    PageAllocator,
    RadixCache,
)


def test_block_hashes_are_chained_and_stable_across_processes() -> None:
    tokens = list(range(8))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2 and hashes[1] == hash_block(hash_block(ROOT_HASH, tokens[:4]), tokens[4:])
    assert block_hashes(tokens + [9], 4, known=hashes[:1]) == hashes  # incremental, partial block ignored
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)[1] != hashes[1]
    # pinned: the router and other workers compute the same value in their own processes
    assert hashes[1].hex() == "27b40a60b3b4176fe0788e012f131304"
    code = "from hybridserve.common.block_hash import block_hashes; print(block_hashes(list(range(8)), 4)[1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == hashes[1].hex()
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)


def _cache(pages: int = 8, checkpoints: int = 3) -> RadixCache:
    return RadixCache(4, 8, PageAllocator(pages), CheckpointAllocator(checkpoints, first_id=100), EventLog(100))


def _insert_chain(cache: RadixCache, hashes: list[bytes]) -> list:
    nodes, parent = [], None
    for h in hashes:
        page = cache.pages.allocate(1)[0]
        node, created = cache.insert(parent, h, page)
        assert created
        cache.lock([node])
        nodes.append(node)
        parent = node
    return nodes


def test_match_returns_deepest_checkpoint_and_ignores_kv_beyond() -> None:
    cache = _cache()
    hashes = block_hashes(list(range(20)), 4)  # 5 blocks
    nodes = _insert_chain(cache, hashes)
    assert cache.attach_checkpoint(nodes[1], cache.allocate_checkpoint())  # ends at 8
    assert cache.attach_checkpoint(nodes[3], cache.allocate_checkpoint())  # ends at 16
    assert not cache.attach_checkpoint(nodes[2], 101)  # 12 is not a multiple of state_block
    assert len(cache.match(hashes, max_tokens=20)) == 4  # block 5 is KV only: not used
    assert len(cache.match(hashes, max_tokens=15)) == 2  # must leave a token to compute
    assert cache.match(block_hashes([7] * 8, 4), max_tokens=8) == []
    cache.unlock(nodes)
    # the KV-only leaf (block 5) is pruned at once; the leaf at 16 holds a checkpoint and stays
    assert cache.num_nodes == 4 and cache.pages.num_free == 4


def test_page_eviction_takes_cold_unreferenced_leaves_only() -> None:
    cache = _cache(pages=8)
    a = block_hashes([1] * 16, 4)
    b = block_hashes([1] * 8 + [2] * 8, 4)  # shares the first two blocks with a
    nodes_a = _insert_chain(cache, a)
    cache.attach_checkpoint(nodes_a[1], cache.allocate_checkpoint())
    cache.attach_checkpoint(nodes_a[3], cache.allocate_checkpoint())
    shared = cache.match(b, max_tokens=15)
    assert shared == nodes_a[:2]
    cache.lock(shared)
    parent = shared[-1]
    nodes_b = []
    for h in b[2:]:
        node, _ = cache.insert(parent, h, cache.pages.allocate(1)[0])
        cache.lock([node])
        nodes_b.append(node)
        parent = node
    cache.attach_checkpoint(nodes_b[-1], cache.allocate_checkpoint())
    assert cache.pages.num_free == 2
    cache.unlock(nodes_a)  # branch a is cold now, b is still running
    assert cache.evict_pages(4) == 2  # a's two private blocks; shared and b's blocks are in use
    assert nodes_a[3] not in cache.nodes() and nodes_a[1] in cache.nodes()
    cache.unlock(shared + nodes_b)
    assert cache.evict_pages(10) == 4 and cache.num_nodes == 0 and cache.checkpoints.num_free == 3


def test_checkpoint_eviction_is_lru_and_prunes_dead_leaves() -> None:
    cache = _cache(pages=8, checkpoints=2)
    x = block_hashes([3] * 8, 4)
    y = block_hashes([4] * 8, 4)
    nx, ny = _insert_chain(cache, x), _insert_chain(cache, y)
    cache.attach_checkpoint(nx[1], cache.allocate_checkpoint())
    cache.attach_checkpoint(ny[1], cache.allocate_checkpoint())
    cache.unlock(nx + ny)
    cache.match(x, max_tokens=9)  # x is now the more recently used
    slot = cache.allocate_checkpoint()  # full: evicts y's checkpoint, and y's blocks die with it
    assert slot is not None and ny[1].checkpoint is None and cache.num_nodes == 2
    assert cache.pages.num_free == 6
    kinds = [e.kind for e in cache.events.drain()]
    assert kinds.count(EventKind.BLOCK_STORED) == 4 and kinds.count(EventKind.CHECKPOINT_REMOVED) == 1
    assert kinds.count(EventKind.BLOCK_REMOVED) == 2


def test_events_have_monotonic_sequence_numbers_and_count_drops() -> None:
    log = EventLog(max_events=2)
    for i in range(3):
        log.emit(EventKind.BLOCK_STORED, bytes([i]) * 16, None, 4 * (i + 1))
    events = log.drain()
    assert [e.sequence for e in events] == [1, 2] and log.num_dropped == 1 and log.next_sequence == 3
    assert events[0].block_hash == (bytes([1]) * 16).hex() and events[0].parent_hash is None
