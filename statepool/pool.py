"""The state pool: who holds which KV page, Mamba slot and checkpoint slot, and the prefix cache over them.

A running sequence holds one state slot, and KV pages: the first `len(cache_nodes)` full blocks are nodes
of the radix cache (shared, refcounted, never written again), the rest are private. Shared blocks are always
full and lie before `num_computed_tokens`, so the partially filled last page is never shared: no
copy-on-write is needed for KV. A cached Mamba state is never written in place: a hit copies it into the
sequence's own slot.

Per step: `plan_checkpoints` assigns checkpoint slots to the state_block boundaries that prefill chunks
cross (the mixer writes them from the scan's chunk-end states); `commit_prefills`, called while the forward
runs on the device, files the full blocks those chunks complete and their checkpoints into the cache (host
work of ~1 ms per 1K-token prompt that would otherwise leave the GPU idle; nothing reads them before the
step's kernels finish, as later steps queue behind them on the same stream); `commit`, after the forward,
files the rest and copies a decoding sequence's slot into a checkpoint when it lands on a boundary, so a
follow-up turn hits the whole previous turn. `cancel_plan` takes a failed step's early commits back.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.common.block_hash import BlockHash, block_hashes
from hybridserve.statepool.allocators import CheckpointAllocator, PageAllocator, SlotAllocator
from hybridserve.statepool.events import CacheEvent, EventLog
from hybridserve.statepool.pool_check import PoolIntegrityError, check_pool
from hybridserve.statepool.pool_types import NO_HIT, CacheHit, EarlyCommit, PlannedCheckpoint, PooledSequence, StateSnapshot
from hybridserve.statepool.radix_cache import Node, RadixCache
from hybridserve.statepool.state_cache import StateCache

__all__ = ["NO_HIT", "CacheHit", "PlannedCheckpoint", "PoolIntegrityError", "PooledSequence", "StatePool", "StateSnapshot"]


class StatePool:
    """Allocators for pages, running slots and checkpoint slots, plus the radix cache (when enabled)."""

    def __init__(
        self, cache: StateCache, state_block: int, enable_prefix_caching: bool, max_events: int = 65536
    ) -> None:
        layout = cache.layout
        self.cache = cache
        self.has_kv = bool(cache.config.kv_layers())
        self.has_state = bool(cache.config.layers_of("mamba"))
        self.page_size = layout.page_size
        self.state_block = state_block
        self.pages = PageAllocator(layout.num_pages) if self.has_kv else None
        self.slots = SlotAllocator(layout.num_slots) if self.has_state else None
        num_checkpoints = layout.num_checkpoints if self.has_state and enable_prefix_caching else 0
        # with prefix caching, idle running slots hold checkpoints too (taken back on admission: `_slot_row`)
        lender = self.slots if self.has_state and enable_prefix_caching else None
        self.checkpoints = CheckpointAllocator(num_checkpoints, first_id=layout.num_slots, lender=lender)
        self.block_size = self.page_size if self.has_kv else state_block
        self.events = EventLog(max_events)
        self.radix: RadixCache | None = None
        if enable_prefix_caching and self.checkpoints.capacity > 0:
            self.radix = RadixCache(self.block_size, state_block, self.pages, self.checkpoints, self.events)
        self._holders: dict[int, PooledSequence] = {}
        self._planned: list[PlannedCheckpoint] = []
        self._early: EarlyCommit | None = None  # this step's `commit_prefills`, until the forward completed
        self._free_ahead = (0, 0)  # (pages, checkpoint slots) `evict_ahead` keeps free: see `keep_free_for`
        self.num_queries = 0  # admissions whose prompt could hit (over one block) looked up (prefix-cache metrics)
        self.num_hits = 0
        self.num_hit_tokens = 0

    # ---- sizes ---------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) if self.has_kv else 0

    @property
    def num_pages(self) -> int:
        return self.pages.capacity if self.pages is not None else 0

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` tokens fits an otherwise empty pool."""
        return self.pages_for(num_tokens) <= self.num_pages

    # ---- admission and release -----------------------------------------------------------------
    def match(self, seq: PooledSequence) -> CacheHit:
        """The longest cached prefix with a checkpoint, leaving at least one token to compute (the sampler
        needs its logits): a prompt that ends exactly on a checkpoint backs off to the previous one."""
        if self.radix is None:
            return NO_HIT
        nodes = self.radix.match(self._hashes(seq, seq.num_tokens // self.block_size), seq.num_tokens - 1)
        return CacheHit(nodes, len(nodes) * self.block_size)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The block hashes `match` needs for a prompt ([] without a cache). Reads nothing mutable, so a
        worker's request thread computes them before the request reaches the engine loop."""
        return block_hashes(token_ids, self.block_size) if self.radix is not None else []

    def keep_free_for(self, chunk_tokens: int) -> None:
        """Size `evict_ahead`'s reserve for prefill chunks of `chunk_tokens`: their pages and checkpoints, at most
        an eighth of the pages and a quarter of the checkpoint slots (the cache itself stays almost whole)."""
        pages = min(self.pages_for(chunk_tokens), self.num_pages // 8)
        self._free_ahead = (pages, min(chunk_tokens // self.state_block + 1, self.checkpoints.capacity // 4))

    def evict_ahead(self) -> None:
        """Keep the `keep_free_for` reserve of KV pages and checkpoint slots free by evicting the coldest cached
        blocks now (while a forward runs), so the next admissions and checkpoint plans find room without
        evicting on the critical path (~0.1 ms per 32-block chain with its events)."""
        if self.radix is None:
            return
        pages, checkpoints = self._free_ahead
        if self.pages is not None and self.pages.num_free < pages:
            self.radix.evict_pages(pages - self.pages.num_free)
        while self.checkpoints.num_free < checkpoints and self.radix.evict_checkpoint():
            pass

    def prepare(self, seq: PooledSequence) -> None:
        """Compute the block hashes `match` will need (ahead of admission, off the critical path)."""
        if self.radix is not None:
            self._hashes(seq, seq.num_tokens // self.block_size)

    def can_admit(self) -> bool:
        """Whether a state slot is free, or held by a cached checkpoint that admission takes back (pages may
        still be short)."""
        return self.slots is None or self.slots.can_allocate(1) or self.checkpoints.num_borrowed > 0

    @property
    def num_free_slots(self) -> int:
        """State slots a new request can have: free ones and those cached checkpoints borrowed."""
        return self.slots.num_free + self.checkpoints.num_borrowed if self.slots is not None else 0

    def admit(self, seq: PooledSequence, hit: CacheHit, num_tokens: int) -> bool:
        """Give the sequence a state slot (holding the hit's checkpoint) and pages for its first `num_tokens`
        tokens, sharing the hit's blocks; False, holding nothing, when the pool cannot do it now."""
        if not self.can_admit():
            return False
        if self.radix is not None:
            self.radix.lock(hit.nodes)
        seq.cache_nodes = list(hit.nodes)
        seq.page_ids = [n.page for n in hit.nodes] if self.has_kv else []  # type: ignore[misc]
        self._holders[id(seq)] = seq
        if not self.reserve(seq, num_tokens):
            self.release(seq)
            return False
        if self.slots is not None:
            source = hit.nodes[-1].checkpoint if hit.nodes else None
            if hit.nodes and source is None:
                raise RuntimeError("a matched checkpoint was evicted before it was copied")
            row = self._slot_row(hit.nodes[-1] if hit.nodes else None)
            if row is None:
                self.release(seq)
                return False
            seq.state_slot = row
            if source is not None and source != row:
                self.cache.copy_state(source, row)
        seq.num_computed_tokens = hit.num_tokens
        if self.radix is not None and seq.num_tokens > self.block_size:  # shorter prompts can never hit
            self.num_queries += 1
            self.num_hits += bool(hit.nodes)
            self.num_hit_tokens += hit.num_tokens
        return True

    def reset_counters(self) -> None:
        """Prefix-cache query / hit counters back to 0 (after a warm-up: its requests are not traffic)."""
        self.num_queries = self.num_hits = self.num_hit_tokens = 0

    def reserve(self, seq: PooledSequence, num_tokens: int) -> bool:
        """Make sure the sequence holds pages for `num_tokens` tokens, evicting cold cached blocks if needed."""
        needed = self.pages_for(num_tokens) - len(seq.page_ids)
        if needed <= 0 or self.pages is None:
            return True
        if self.pages.num_free < needed and self.radix is not None:
            self.radix.evict_pages(needed - self.pages.num_free)
        if not self.pages.can_allocate(needed):
            return False
        seq.page_ids.extend(self.pages.allocate(needed))
        return True

    def release(self, seq: PooledSequence) -> None:
        """Return the sequence's private pages and slot; its cached blocks stay in the cache, unreferenced."""
        if self.pages is not None:
            private = self._private_pages(seq)
            if private:
                self.pages.free(private)
        if self.radix is not None and seq.cache_nodes:
            self.radix.unlock(seq.cache_nodes)
        if self.slots is not None and seq.state_slot is not None:
            self.slots.free([seq.state_slot])
        seq.page_ids, seq.cache_nodes, seq.state_slot = [], [], None
        self._holders.pop(id(seq), None)

    # ---- per step ------------------------------------------------------------------------------
    def plan_checkpoints(self, prefills: Sequence[tuple[PooledSequence, int]]) -> list[int]:
        """Checkpoint slot for every state_block boundary in (computed, computed + count] of each prefill
        chunk, in chunk then position order (the order the scan returns chunk states); -1 = not kept."""
        self._planned = []
        if self.radix is None:
            return []
        out: list[int] = []
        for seq, count in prefills:
            start = seq.num_computed_tokens
            first = (start // self.state_block + 1) * self.state_block
            boundaries = range(first, start + count + 1, self.state_block)
            for pos, cached in zip(boundaries, self._cached_checkpoints(seq, boundaries)):
                slot = None if cached else self.radix.allocate_checkpoint()
                slot = -1 if slot is None else slot
                self._planned.append(PlannedCheckpoint(seq, pos, slot))
                out.append(slot)
        return out

    def take_plan(self) -> list[PlannedCheckpoint]:
        """Take the planned checkpoints out (the pool then holds none): an engine with two forwards in flight keeps
        each one's plan and gives it back (`put_plan`) right before that forward's `commit` or `cancel_plan`."""
        planned, self._planned = self._planned, []
        return planned

    def put_plan(self, planned: list[PlannedCheckpoint]) -> None:
        self._planned = planned

    def commit(
        self,
        scheduled: Sequence[PooledSequence],
        decodes: Sequence[tuple[PooledSequence, int]],
        snapshot: StateSnapshot | None = None,
    ) -> None:
        """After a forward (num_computed_tokens already advanced): cache the new full blocks, attach the
        planned prefill checkpoints, and checkpoint decodes at every boundary in (before, computed].
        `decodes` pairs each decoding sequence with its computed count before the step; a boundary short of
        the sequence's end (speculative steps move by several tokens) needs `snapshot` to produce that state."""
        planned, self._planned, self._early = self._planned, [], None
        if self.radix is None:
            return
        for seq in scheduled:
            self._insert_blocks(seq, seq.num_computed_tokens)
        self._attach_planned(planned)
        for seq, before in decodes:
            if seq.state_slot is None:
                continue
            first = (before // self.state_block + 1) * self.state_block
            for pos in range(first, seq.num_computed_tokens + 1, self.state_block):
                node = seq.cache_nodes[pos // self.block_size - 1]
                if node.checkpoint is not None:
                    continue
                slot = self.radix.allocate_checkpoint()
                if slot is None:
                    continue
                if snapshot is not None:
                    snapshot(seq, pos, slot)
                elif pos == seq.num_computed_tokens:
                    self.cache.copy_state(seq.state_slot, slot)
                else:
                    self.checkpoints.free([slot])
                    continue
                if not self.radix.attach_checkpoint(node, slot):
                    self.checkpoints.free([slot])

    def commit_prefills(self, prefills: Sequence[tuple[PooledSequence, int]]) -> None:
        """While the step's forward runs: file the full blocks each prefill chunk (sequence, tokens) completes
        and attach the planned checkpoints (`commit` would do the same after the forward, with the GPU idle)."""
        if self.radix is None:
            return
        before = [(seq, len(seq.cache_nodes)) for seq, _ in prefills]
        for seq, count in prefills:
            self._insert_blocks(seq, seq.num_computed_tokens + count)
        planned, self._planned = self._planned, []
        self._early = EarlyCommit(before, self._attach_planned(planned))

    def cancel_plan(self) -> None:
        """After a forward that did not complete: return planned checkpoint slots, and take back what
        `commit_prefills` filed (blocks and checkpoints whose contents were never written)."""
        slots = [p.slot for p in self._planned if p.slot >= 0]
        self._planned = []
        if slots:
            self.checkpoints.free(slots)
        early, self._early = self._early, None
        if self.radix is None or early is None:
            return
        for node in early.checkpoints:
            self.radix.drop_checkpoint(node)
        for seq, first in reversed(early.nodes_before):
            added, seq.cache_nodes = seq.cache_nodes[first:], seq.cache_nodes[:first]
            for index, node in enumerate(added, start=first):
                if self.has_kv and node.page == seq.page_ids[index]:
                    node.page = None  # a block this step created: its page goes back to being the sequence's
            self.radix.unlock(added)

    def drain_events(self) -> list[CacheEvent]:
        return self.events.drain()

    def clear_cache(self) -> None:
        """Drop every cached block and checkpoint that no running sequence holds."""
        if self.radix is not None:
            self.radix.clear()

    # ---- integrity -----------------------------------------------------------------------------
    def check(self) -> None:
        """Every page and slot is free, cached, or owned by exactly one sequence; refs match holders
        (`statepool/pool_check.py`)."""
        check_pool(self.radix, self.pages, self.slots, self.checkpoints, list(self._holders.values()), self._private_pages)

    # ---- internals -----------------------------------------------------------------------------
    def _hashes(self, seq: PooledSequence, num_blocks: int) -> list[BlockHash]:
        if len(seq.block_hashes) < num_blocks:
            tokens = seq.all_token_ids[: num_blocks * self.block_size]
            seq.block_hashes = block_hashes(tokens, self.block_size, seq.block_hashes)
        return seq.block_hashes

    def _slot_row(self, hit: Node | None) -> int | None:
        """A running slot for an admission: a free one, else the row of the coldest checkpoint cached in a
        borrowed slot (running requests come before cache), else the hit's own checkpoint row when that is
        borrowed (the state is already there: the checkpoint leaves the cache, the slot keeps it)."""
        assert self.slots is not None
        if self.slots.can_allocate(1):
            return self.slots.allocate(1)[0]
        if self.radix is None:
            return None
        if not self.radix.evict_borrowed_checkpoint(keep=hit):
            if hit is None or hit.checkpoint is None or not self.checkpoints.is_borrowed(hit.checkpoint):
                return None
            row = hit.checkpoint
            self.radix.drop_checkpoint(hit)  # the row goes back to the slots, last freed: allocated next
            taken = self.slots.allocate(1)[0]
            assert taken == row
            return taken
        return self.slots.allocate(1)[0]

    def _private_pages(self, seq: PooledSequence) -> list[int]:
        nodes = seq.cache_nodes
        return [p for i, p in enumerate(seq.page_ids) if i >= len(nodes) or nodes[i].page != p]

    def _attach_planned(self, planned: list[PlannedCheckpoint]) -> list[Node]:
        """Give each kept planned checkpoint to its block's node (slots a node does not take go back); returns
        the nodes that took one."""
        assert self.radix is not None
        attached = []
        for p in planned:
            if p.slot < 0:
                continue
            node = p.sequence.cache_nodes[p.num_tokens // self.block_size - 1]
            if self.radix.attach_checkpoint(node, p.slot):
                attached.append(node)
            else:
                self.checkpoints.free([p.slot])
        return attached

    def _insert_blocks(self, seq: PooledSequence, num_tokens: int) -> None:
        """File the sequence's full blocks up to `num_tokens` tokens as (locked) nodes of its cached chain."""
        assert self.radix is not None
        full = num_tokens // self.block_size
        if full <= len(seq.cache_nodes):  # no block filled since the last call (most decode steps)
            return
        hashes = self._hashes(seq, full)
        while len(seq.cache_nodes) < full:
            i = len(seq.cache_nodes)
            parent = seq.cache_nodes[-1] if seq.cache_nodes else None
            node, _ = self.radix.insert(parent, hashes[i], seq.page_ids[i] if self.has_kv else None)
            self.radix.lock([node])
            seq.cache_nodes.append(node)

    def _cached_checkpoints(self, seq: PooledSequence, positions: range) -> list[bool]:
        """For each boundary, whether the cache already holds a checkpoint there on this sequence's path
        (one walk down the tree from the sequence's last cached block)."""
        assert self.radix is not None
        if not positions:
            return []
        hashes = self._hashes(seq, positions[-1] // self.block_size)
        node: Node | None = seq.cache_nodes[-1] if seq.cache_nodes else self.radix.root
        depth = len(seq.cache_nodes)
        found = []
        for pos in positions:
            while node is not None and depth < pos // self.block_size:
                node = self.radix.child(node, hashes[depth])
                depth += 1
            found.append(node is not None and node.checkpoint is not None)
        return found
