"""Radix prefix cache over token blocks, for hybrid models.

Each node is one full block of `block_size` tokens, keyed by its chained block hash under its parent. A node
holds the block's KV page (models with attention) and, when its end is a multiple of `state_block`, may also
hold a checkpoint slot: the Mamba state (conv window + SSM state of every layer) after its last token.
A recurrent state cannot be rewound, so a prefix is reusable only up to its deepest checkpoint: `match`
returns the path to that node and ignores KV matched beyond it.

Ownership. `ref` counts the running requests that hold a node; a request holds a whole chain from the root,
so an ancestor's ref is never below a descendant's. Nodes with ref > 0 are never removed. A ref-0 leaf
without a checkpoint can never be the end of a match, so it is pruned at once (its page freed); every
other ref-0 leaf is evictable. Two LRU orders: leaves for KV pages, nodes with a checkpoint for states.
A match touches its path root-first, so states nearer the root (shared by more branches) look older and a
cold branch's deeper states go first; page eviction only ever removes unreferenced leaves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridserve.common.block_hash import ROOT_HASH, BlockHash
from hybridserve.statepool.allocators import CheckpointAllocator, PageAllocator
from hybridserve.statepool.events import EventKind, EventLog


@dataclass(eq=False)
class Node:
    """One cached block: tokens [(depth-1)*block_size, depth*block_size) of every prefix through it."""

    block_hash: BlockHash
    parent: Node | None
    depth: int
    page: int | None  # KV page (None: the model has no attention layers, or the root)
    checkpoint: int | None = None  # checkpoint slot with the state after this block
    ref: int = 0
    children: dict[BlockHash, Node] = field(default_factory=dict)


class RadixCache:
    """The tree, its two LRU orders, and eviction back into the allocators."""

    def __init__(
        self,
        block_size: int,
        state_block: int,
        pages: PageAllocator | None,
        checkpoints: CheckpointAllocator,
        events: EventLog,
    ) -> None:
        if block_size <= 0 or state_block <= 0 or state_block % block_size:
            raise ValueError(f"state_block ({state_block}) must be a positive multiple of block_size ({block_size})")
        self.block_size = block_size
        self.state_block = state_block
        self.pages = pages
        self.checkpoints = checkpoints
        self.events = events
        self.root = Node(ROOT_HASH, None, 0, None, ref=1)
        self._leaf_lru: OrderedDict[Node, None] = OrderedDict()  # ref-0 leaves (all hold a checkpoint)
        self._state_lru: OrderedDict[Node, None] = OrderedDict()  # nodes holding a checkpoint
        self.num_nodes = 0

    # ---- lookups -------------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash], max_tokens: int) -> list[Node]:
        """Path from the root to the deepest node with a checkpoint that ends at <= max_tokens; [] if none.
        Touches that path (root first) in both LRU orders."""
        node, path, best = self.root, [], 0
        for block_hash in hashes[: max_tokens // self.block_size]:
            child = node.children.get(block_hash)
            if child is None:
                break
            path.append(child)
            if child.checkpoint is not None:
                best = len(path)
            node = child
        path = path[:best]
        for n in path:
            self._touch(n)
        return path

    def child(self, node: Node | None, block_hash: BlockHash) -> Node | None:
        return (node or self.root).children.get(block_hash)

    def is_checkpoint_position(self, num_tokens: int) -> bool:
        return num_tokens > 0 and num_tokens % self.state_block == 0

    # ---- refs ----------------------------------------------------------------------------------
    def lock(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            n.ref += 1
            self._leaf_lru.pop(n, None)

    def unlock(self, nodes: Sequence[Node]) -> None:
        """Drop one ref on each node (deepest first, so pruning walks up cleanly)."""
        for n in reversed(nodes):
            if n.ref <= 0:
                raise RuntimeError(f"radix node at depth {n.depth} unlocked more often than locked")
            n.ref -= 1
            self._settle(n)

    # ---- insertion -----------------------------------------------------------------------------
    def insert(self, parent: Node | None, block_hash: BlockHash, page: int | None) -> tuple[Node, bool]:
        """The child of `parent` for this block, created with `page` when missing. Returns (node, created);
        when not created the caller keeps its page. The caller locks the node."""
        parent = parent or self.root
        existing = parent.children.get(block_hash)
        if existing is not None:
            return existing, False
        node = Node(block_hash, parent, parent.depth + 1, page)
        parent.children[block_hash] = node
        self._leaf_lru.pop(parent, None)
        self.num_nodes += 1
        self.events.emit(EventKind.BLOCK_STORED, block_hash, self._parent_hash(node), self._end(node))
        return node, True

    def attach_checkpoint(self, node: Node, slot: int) -> bool:
        """Give `slot` to the node; False (slot not taken) when it already has one or is not aligned."""
        if node.checkpoint is not None or not self.is_checkpoint_position(self._end(node)):
            return False
        node.checkpoint = slot
        self._state_lru[node] = None
        self._settle(node)
        self.events.emit(EventKind.CHECKPOINT_STORED, node.block_hash, self._parent_hash(node), self._end(node))
        return True

    # ---- eviction ------------------------------------------------------------------------------
    def evict_pages(self, count: int) -> int:
        """Free up to `count` KV pages by removing unreferenced leaves, least recently used first."""
        if self.pages is None:
            return 0
        freed = 0
        while freed < count and self._leaf_lru:
            node = next(iter(self._leaf_lru))
            parent = node.parent
            before = self.pages.num_free
            self._remove(node)
            self._settle(parent)  # type: ignore[arg-type]
            freed += self.pages.num_free - before
        return freed

    def evict_checkpoint(self) -> bool:
        """Free the least recently used checkpoint slot; False when no checkpoint is cached."""
        if not self._state_lru:
            return False
        node = next(iter(self._state_lru))
        self._drop_checkpoint(node)
        self._settle(node)
        return True

    def evict_borrowed_checkpoint(self, keep: Node | None = None) -> bool:
        """Free the least recently used checkpoint that sits in a borrowed running-slot row (not `keep`'s), so
        that a request can have the row back; False when there is none."""
        for node in self._state_lru:
            if node is not keep and self.checkpoints.is_borrowed(node.checkpoint):  # type: ignore[arg-type]
                self._drop_checkpoint(node)
                self._settle(node)
                return True
        return False

    def drop_checkpoint(self, node: Node) -> None:
        """Free the node's checkpoint slot (a step that wrote it failed) and re-file the node."""
        if node.checkpoint is None:
            raise RuntimeError(f"radix node at depth {node.depth} holds no checkpoint to drop")
        self._drop_checkpoint(node)
        self._settle(node)

    def allocate_checkpoint(self) -> int | None:
        """A free checkpoint slot, evicting the coldest cached one if needed; None when there is none."""
        if self.checkpoints.capacity == 0:
            return None
        if not self.checkpoints.can_allocate(1) and not self.evict_checkpoint():
            return None
        return self.checkpoints.allocate(1)[0]

    def clear(self) -> None:
        """Drop every unreferenced cached block and checkpoint."""
        while self._state_lru:
            self.evict_checkpoint()

    # ---- inspection ----------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        """Every node except the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def lru_problems(self) -> list[str]:
        """Nodes filed wrongly in the LRU orders (for integrity checks); empty when consistent."""
        problems = []
        nodes = self.nodes()
        for n in nodes:
            if (n in self._leaf_lru) != (n.ref == 0 and not n.children):
                problems.append(f"node at depth {n.depth} (ref {n.ref}) misfiled in the leaf LRU")
            if (n in self._state_lru) != (n.checkpoint is not None):
                problems.append(f"node at depth {n.depth} misfiled in the checkpoint LRU")
        if len(self._leaf_lru) > len(nodes) or len(self._state_lru) > len(nodes) or len(nodes) != self.num_nodes:
            problems.append("the LRU orders or the node count hold removed nodes")
        return problems

    @property
    def num_checkpoints(self) -> int:
        return len(self._state_lru)

    # ---- internals -----------------------------------------------------------------------------
    def _end(self, node: Node) -> int:
        return node.depth * self.block_size

    @staticmethod
    def _parent_hash(node: Node) -> BlockHash | None:
        return None if node.parent is None or node.parent.depth == 0 else node.parent.block_hash

    def _touch(self, node: Node) -> None:
        if node in self._leaf_lru:
            self._leaf_lru.move_to_end(node)
        if node in self._state_lru:
            self._state_lru.move_to_end(node)

    def _settle(self, node: Node) -> None:
        """Re-file a node whose ref, children or checkpoint changed: prune it, or list it as evictable."""
        while node is not self.root and node.ref == 0 and not node.children:
            if node.checkpoint is not None:
                self._leaf_lru[node] = None
                return
            parent = node.parent
            self._remove(node)
            node = parent  # type: ignore[assignment]

    def _drop_checkpoint(self, node: Node) -> None:
        self._state_lru.pop(node, None)
        self.checkpoints.free([node.checkpoint])  # type: ignore[list-item]
        node.checkpoint = None
        self.events.emit(EventKind.CHECKPOINT_REMOVED, node.block_hash, self._parent_hash(node), self._end(node))

    def _remove(self, node: Node) -> None:
        """Delete an unreferenced leaf and free its page and checkpoint (the caller settles the parent)."""
        if node.ref or node.children:
            raise RuntimeError("only unreferenced leaves can be removed from the radix cache")
        if node.checkpoint is not None:
            self._drop_checkpoint(node)
        self._leaf_lru.pop(node, None)
        if node.page is not None and self.pages is not None:
            self.pages.free([node.page])
        parent = node.parent
        assert parent is not None  # the root is never removed
        del parent.children[node.block_hash]
        self.num_nodes -= 1
        self.events.emit(EventKind.BLOCK_REMOVED, node.block_hash, self._parent_hash(node), self._end(node))
