"""`StatePool.check()`: the pool's ownership invariants, written down and machine-checked (the property tests call
it after every step): every KV page and state slot is free, cached, or owned by exactly one sequence (a state slot
no sequence holds may be lent to the checkpoint cache); node refs
equal their holders; no dead leaf is left unpruned; the LRU orders and checkpoint slots agree with the tree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridserve.statepool.allocators import CheckpointAllocator, PageAllocator, SlotAllocator
from hybridserve.statepool.radix_cache import RadixCache


class PoolIntegrityError(RuntimeError):
    """`StatePool.check()` found a page or slot that is not exactly one of free, cached or owned once."""


def check_pool(
    radix: RadixCache | None,
    pages: PageAllocator | None,
    slots: SlotAllocator | None,
    checkpoints: CheckpointAllocator,
    holders: list[Any],
    private_pages: Callable[[Any], list[int]],
) -> None:
    """Raise PoolIntegrityError on the first broken invariant of a pool's parts (`holders`: the sequences holding
    pool resources, `private_pages(seq)`: the pages a sequence owns outside the cache). It takes the parts, not the
    `StatePool`, so that this module and pool.py do not import each other."""
    nodes = radix.nodes() if radix is not None else []
    owner: dict[int, str] = {}

    def claim(page: int, who: str) -> None:
        if page in owner:
            raise PoolIntegrityError(f"KV page {page} is held by both {owner[page]} and {who}")
        owner[page] = who

    refs: dict[int, int] = {}
    for seq in holders:
        for i, node in enumerate(seq.cache_nodes):
            if node.depth != i + 1 or (i and node.parent is not seq.cache_nodes[i - 1]):
                raise PoolIntegrityError(f"a sequence's cached blocks are not a chain from the root at {i}")
            refs[id(node)] = refs.get(id(node), 0) + 1
        for page in private_pages(seq):
            claim(page, f"sequence {id(seq):#x}")
    for node in nodes:
        if node.page is not None:
            claim(node.page, f"cached block at depth {node.depth}")
        if node.ref != refs.get(id(node), 0):
            count = refs.get(id(node), 0)
            raise PoolIntegrityError(f"node at depth {node.depth} has ref {node.ref}, {count} holders")
        if node.ref == 0 and not node.children and node.checkpoint is None:
            raise PoolIntegrityError(f"dead leaf at depth {node.depth} was not pruned")
    if pages is not None and set(owner) != pages.used_ids():
        raise PoolIntegrityError(
            f"pages in use {sorted(pages.used_ids() ^ set(owner))[:8]} are neither cached nor owned"
        )
    if slots is not None:
        held = [s.state_slot for s in holders if s.state_slot is not None]
        borrowed = checkpoints.borrowed_ids()
        if len(held) != len(set(held)) or set(held) & borrowed or set(held) | borrowed != slots.used_ids():
            raise PoolIntegrityError(f"state slots {sorted(held)} + checkpoint rows {sorted(borrowed)} vs in use "
                                     f"{sorted(slots.used_ids())}")
    if radix is not None and (problems := radix.lru_problems()):
        raise PoolIntegrityError("; ".join(problems[:4]))
    cached = [n.checkpoint for n in nodes if n.checkpoint is not None]
    if len(cached) != len(set(cached)) or set(cached) != checkpoints.used_ids():
        raise PoolIntegrityError(
            f"checkpoint slots {sorted(cached)} vs in use {sorted(checkpoints.used_ids())}"
        )
