"""The router's global prefix index: which worker caches which token blocks, and where Mamba checkpoints are.

A radix tree over chained block hashes (each hash names a whole prefix, see `common/block_hash.py`),
built from every worker's cache events. Each node records the workers holding the block (KV, for models with
attention) and, separately, the workers holding the Mamba checkpoint at the block's end. A recurrent state
cannot be rebuilt from KV, so a worker's usable hit is the deepest checkpointed node on a path it holds
contiguously from the root; KV beyond it counts for nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hybridserve.proto import common_pb2

_Kind = common_pb2.CacheEvent


@dataclass(eq=False)
class _Node:
    block_hash: str
    parent: _Node | None
    num_tokens: int
    blocks: set[str] = field(default_factory=set)  # workers holding the block
    checkpoints: set[str] = field(default_factory=set)  # workers holding the state at the block's end
    children: dict[str, _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerHit:
    """One worker's view of a prompt: block-cached tokens and the usable (checkpointed) hit."""

    block_tokens: int
    checkpoint_tokens: int


class PrefixIndex:
    """Thread-safe; writers are the per-worker event subscribers, readers the routing policy."""

    def __init__(self) -> None:
        self._root = _Node("", None, 0)
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()

    # ---- updates -------------------------------------------------------------------------------
    def apply(self, worker: str, events: Iterable[common_pb2.CacheEvent]) -> None:
        """Apply one worker's events in sequence order."""
        with self._lock:
            for event in events:
                self._apply(worker, event)

    def replace(self, worker: str, events: Iterable[common_pb2.CacheEvent]) -> None:
        """Forget what the worker held and load a snapshot of its cache instead."""
        with self._lock:
            self._drop(worker)
            for event in events:
                self._apply(worker, event)

    def drop_worker(self, worker: str) -> None:
        with self._lock:
            self._drop(worker)

    # ---- lookups -------------------------------------------------------------------------------
    def match(self, hashes: Sequence[str]) -> dict[str, WorkerHit]:
        """Per worker, the prefix of `hashes` it holds contiguously and its deepest checkpoint on it."""
        blocks: dict[str, int] = {}
        checkpoints: dict[str, int] = {}
        with self._lock:
            node = self._root
            for depth, block_hash in enumerate(hashes):
                child = node.children.get(block_hash)
                if child is None:
                    break
                for worker in child.blocks:
                    if blocks.get(worker, 0) == depth:  # contiguous from the root
                        blocks[worker] = depth + 1
                        if worker in child.checkpoints:
                            checkpoints[worker] = child.num_tokens
                node = child
            block_tokens = {w: self._tokens_at(hashes, d) for w, d in blocks.items()}
        return {w: WorkerHit(block_tokens[w], checkpoints.get(w, 0)) for w in blocks}

    def _tokens_at(self, hashes: Sequence[str], depth: int) -> int:
        return self._nodes[hashes[depth - 1]].num_tokens if depth else 0

    def workers(self) -> set[str]:
        with self._lock:
            return {w for n in self._nodes.values() for w in n.blocks | n.checkpoints}

    def num_nodes(self) -> int:
        with self._lock:
            return len(self._nodes)

    # ---- internals (lock held) -----------------------------------------------------------------
    def _apply(self, worker: str, event: common_pb2.CacheEvent) -> None:
        if event.kind in (_Kind.BLOCK_STORED, _Kind.CHECKPOINT_STORED):
            node = self._node(event.block_hash, event.parent_hash, event.num_tokens)
            node.blocks.add(worker)
            if event.kind == _Kind.CHECKPOINT_STORED:
                node.checkpoints.add(worker)
            return
        gone = self._nodes.get(event.block_hash)
        if gone is None:
            return
        node = gone
        node.checkpoints.discard(worker)
        if event.kind == _Kind.BLOCK_REMOVED:
            node.blocks.discard(worker)
        self._prune(node)

    def _node(self, block_hash: str, parent_hash: str, num_tokens: int) -> _Node:
        node = self._nodes.get(block_hash)
        if node is not None:
            return node
        parent = self._root if not parent_hash else self._nodes.get(parent_hash)
        if parent is None:  # the parent is unknown (events of a pruned branch): file it as a placeholder
            parent = self._node(parent_hash, "", 0)
        node = _Node(block_hash, parent, num_tokens)
        parent.children[block_hash] = node
        self._nodes[block_hash] = node
        return node

    def _prune(self, node: _Node | None) -> None:
        while node is not None and node is not self._root and not node.blocks and not node.checkpoints \
                and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.block_hash]
            del self._nodes[node.block_hash]
            node = parent

    def _drop(self, worker: str) -> None:
        for node in list(self._nodes.values()):
            node.blocks.discard(worker)
            node.checkpoints.discard(worker)
        for node in list(self._nodes.values()):
            if node.block_hash in self._nodes:
                self._prune(node)
