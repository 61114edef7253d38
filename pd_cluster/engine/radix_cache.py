"""Prefix cache: a radix tree of token blocks over KV pool slots, so requests share computed prefixes.

Edges hold whole blocks of ``block_size`` tokens and the slots that hold their KV. In-flight
requests pin their prefix (reference counts along the path to the root); unpinned leaves are
evicted least recently used first. The tree owns the slots it holds and frees each exactly once.
Every block that enters or leaves the tree is reported by its chained hash (see ``block_hash``),
which is how the master keeps an approximate index of what each node holds.

Not thread-safe: one engine loop owns the cache.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pd_cluster.block_hash import block_hashes
from pd_cluster.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)

EventSink = Callable[[list[int], list[int]], None]

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
_node_ids = itertools.count()


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree: ``key`` tokens (whole blocks) held in ``slots``.

    ``lock_ref`` counts the pins at or below this node; ``hashes`` are the chained hashes of the
    node's blocks (one per block, chained from the root).
    """

    key: tuple[int, ...] = ()
    slots: torch.Tensor = field(default_factory=lambda: _EMPTY_SLOTS)
    hashes: list[int] = field(default_factory=list)
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.key)


@dataclass
class PrefixMatch:
    """The cached part of a token sequence: its slots and the node where it ends."""

    slots: torch.Tensor
    node: RadixNode
    num_tokens: int


class RadixCache:
    """Longest-prefix matching, insertion, pinning and LRU eviction over a ``KVPool``."""

    def __init__(
        self,
        pool: KVPool,
        block_size: int = 1,
        enabled: bool = True,
        event_sink: EventSink | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.event_sink = event_sink
        self.root = RadixNode()
        self._clock = 0
        self._cached_tokens = 0
        self._pinned_tokens = 0
        self._num_nodes = 0
        # Lazy min-heap of (last_access, id, node) over evictable leaves; entries whose node has
        # since changed (touched, pinned, grown children, evicted) are skipped when popped.
        self._heap: list[tuple[int, int, RadixNode]] = []

    # ----------------------------------------------------------------------------------------
    # Sizes

    @property
    def cached_tokens(self) -> int:
        """All tokens held by the tree."""
        return self._cached_tokens

    @property
    def pinned_tokens(self) -> int:
        """Tokens on some in-flight request's path: never evicted."""
        return self._pinned_tokens

    @property
    def evictable_tokens(self) -> int:
        """Tokens that ``evict`` could free (an unpinned node has only unpinned descendants)."""
        return self._cached_tokens - self._pinned_tokens

    # ----------------------------------------------------------------------------------------
    # Lookup and insertion

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` in whole blocks; refreshes its LRU time, does not pin."""
        if not self.enabled:
            return self._empty_match()
        tokens = _as_list(token_ids)
        n_full = self._full_length(tokens)
        path = self._walk(tokens, n_full)
        self._touch(path)
        return self._match_of(path)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> PrefixMatch:
        """Add ``token_ids``' full blocks with their ``slots``; the cache owns ``slots[:n_full]`` after.

        Positions the tree already holds keep the tree's slot; a different given slot there is a
        duplicate and goes back to the pool. Returns the match of the full blocks after insertion.
        """
        tokens = _as_list(token_ids)
        n_full = self._full_length(tokens)
        if slots.numel() < n_full:
            raise ValueError(f"insert got {slots.numel()} slots for {n_full} tokens")
        given = slots[:n_full].to(device="cpu", dtype=torch.int64)
        if not self.enabled:
            self.pool.free(given)
            return self._empty_match()

        path = self._walk(tokens, n_full)
        duplicates: list[torch.Tensor] = []
        pos = 0
        for node in path:
            mine = given[pos : pos + node.num_tokens]
            duplicates.append(mine[mine != node.slots])  # computed twice: the tree's copy wins
            pos += node.num_tokens
        stored: list[int] = []
        if pos < n_full:
            parent = path[-1] if path else self.root
            key = tuple(tokens[pos:n_full])
            leaf = RadixNode(
                key=key,
                slots=given[pos:n_full].clone(),
                hashes=block_hashes(key, self.block_size, parent=_tail_hash(parent)),
                parent=parent,
            )
            parent.children[key[: self.block_size]] = leaf
            self._cached_tokens += leaf.num_tokens
            self._num_nodes += 1
            path.append(leaf)
            stored = list(leaf.hashes)

        freed = torch.cat(duplicates) if duplicates else _EMPTY_SLOTS
        if freed.numel():
            self.pool.free(freed)
        self._touch(path)
        self._emit(stored, [])
        return self._match_of(path)

    # ----------------------------------------------------------------------------------------
    # Pins

    def inc_ref(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors so that eviction leaves them alone."""
        self._check_attached(node)
        current: RadixNode | None = node
        while current is not None:
            if current.lock_ref == 0 and current is not self.root:
                self._pinned_tokens += current.num_tokens
            current.lock_ref += 1
            current = current.parent

    def dec_ref(self, node: RadixNode) -> None:
        """Undo one ``inc_ref(node)``; unpinning more than was pinned is a bug and raises."""
        self._check_attached(node)
        path = list(self._ancestors(node))
        if any(n.lock_ref <= 0 for n in path):
            raise RuntimeError("dec_ref on a node that is not pinned")
        for current in path:
            current.lock_ref -= 1
            if current.lock_ref == 0 and current is not self.root:
                self._pinned_tokens -= current.num_tokens
                self._offer_leaf(current)

    # ----------------------------------------------------------------------------------------
    # Freeing

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` from unpinned leaves, oldest first, as far as possible.

        Returns the tokens freed (whole nodes, so possibly more than asked; less when not enough
        is evictable).
        """
        freed_tokens = 0
        freed_slots: list[torch.Tensor] = []
        evicted: list[int] = []
        while freed_tokens < num_tokens and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if not self._evictable(node) or node.last_access != last_access:
                continue
            parent = node.parent
            assert parent is not None
            freed_tokens += node.num_tokens
            freed_slots.append(node.slots)
            evicted.extend(node.hashes)
            self._detach(node)
            self._offer_leaf(parent)
        if freed_slots:
            self.pool.free(torch.cat(freed_slots))
        self._emit([], evicted)
        return freed_tokens

    def flush(self) -> int:
        """Free every unpinned node; returns the tokens freed."""
        freed_slots: list[torch.Tensor] = []
        evicted: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref > 0:
                    stack.append(child)
                    continue
                for gone in _subtree(child):
                    freed_slots.append(gone.slots)
                    evicted.extend(gone.hashes)
                    self._detach(gone)
        freed = torch.cat(freed_slots) if freed_slots else _EMPTY_SLOTS
        if freed.numel():
            self.pool.free(freed)
        self._heap = [(n.last_access, n.id, n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(self._heap)
        self._emit([], evicted)
        return int(freed.numel())

    # ----------------------------------------------------------------------------------------
    # Internals

    def _full_length(self, tokens: list[int]) -> int:
        return len(tokens) // self.block_size * self.block_size

    def _empty_match(self) -> PrefixMatch:
        return PrefixMatch(slots=_EMPTY_SLOTS.clone(), node=self.root, num_tokens=0)

    def _match_of(self, path: list[RadixNode]) -> PrefixMatch:
        if not path:
            return self._empty_match()
        slots = torch.cat([node.slots for node in path])
        return PrefixMatch(slots=slots, node=path[-1], num_tokens=int(slots.numel()))

    def _walk(self, tokens: list[int], n_full: int) -> list[RadixNode]:
        """Nodes matching ``tokens[:n_full]`` from the root down, splitting the last one at a block
        boundary when the match ends inside it."""
        bs = self.block_size
        path: list[RadixNode] = []
        node = self.root
        pos = 0
        while pos < n_full:
            child = node.children.get(tuple(tokens[pos : pos + bs]))
            if child is None:
                break
            matched = self._common_blocks(child.key, tokens, pos, n_full)
            if matched < child.num_tokens:
                path.append(self._split(child, matched))
                break
            path.append(child)
            node = child
            pos += matched
        return path

    def _common_blocks(self, key: tuple[int, ...], tokens: list[int], pos: int, end: int) -> int:
        """Tokens of ``key`` equal to ``tokens[pos:end]``, rounded down to whole blocks."""
        limit = min(len(key), end - pos)
        if tuple(tokens[pos : pos + limit]) == key[:limit]:
            return limit
        i = 0
        while key[i] == tokens[pos + i]:
            i += 1
        return i // self.block_size * self.block_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` tokens; the new upper half is returned, ``node`` keeps the lower.

        Both halves keep the pin count and access time, so pins held through ``node`` still cover
        the whole path and handles to ``node`` stay valid.
        """
        parent = node.parent
        assert parent is not None and 0 < at < node.num_tokens and at % self.block_size == 0
        upper = RadixNode(
            key=node.key[:at],
            slots=node.slots[:at],
            hashes=node.hashes[: at // self.block_size],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.key = node.key[at:]
        node.slots = node.slots[at:]
        node.hashes = node.hashes[at // self.block_size :]
        node.parent = upper
        upper.children[node.key[: self.block_size]] = node
        parent.children[upper.key[: self.block_size]] = upper
        self._num_nodes += 1
        return upper

    def _touch(self, path: list[RadixNode]) -> None:
        if not path:
            return
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        self._offer_leaf(path[-1])

    def _evictable(self, node: RadixNode) -> bool:
        return node is not self.root and node.parent is not None and not node.children and node.lock_ref == 0

    def _offer_leaf(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it is an unpinned leaf now."""
        if not self._evictable(node):
            return
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            # Stale entries dominate: rebuild, amortized over the pushes that made them.
            self._heap = [(n.last_access, n.id, n) for n in self._nodes() if self._evictable(n)]
            heapq.heapify(self._heap)

    def _detach(self, node: RadixNode) -> None:
        """Take ``node`` out of the tree (its slots are the caller's to free)."""
        parent = node.parent
        assert parent is not None
        if parent.children.get(node.key[: self.block_size]) is node:
            del parent.children[node.key[: self.block_size]]
        node.parent = None
        self._cached_tokens -= node.num_tokens
        self._num_nodes -= 1

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError("node is no longer in the cache (evicted)")

    def _ancestors(self, node: RadixNode) -> Iterator[RadixNode]:
        current: RadixNode | None = node
        while current is not None:
            yield current
            current = current.parent

    def _nodes(self) -> Iterator[RadixNode]:
        return _subtree(self.root)

    def _emit(self, stored: list[int], evicted: list[int]) -> None:
        if self.event_sink is None or not (stored or evicted):
            return
        try:
            self.event_sink(stored, evicted)
        except Exception:
            # The tree is already consistent; a failing listener must not undo the caller's work.
            logger.exception("radix cache event sink failed")


def _subtree(top: RadixNode) -> Iterator[RadixNode]:
    """``top`` and all its descendants, each listed before its parent's later siblings."""
    stack = [top]
    nodes: list[RadixNode] = []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return iter(nodes)


def _tail_hash(node: RadixNode) -> int:
    return node.hashes[-1] if node.hashes else 0


def _as_list(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)
