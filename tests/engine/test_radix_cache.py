"""Radix prefix cache: block-granular matching, slot ownership, pins, LRU eviction, events."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
import torch

from pd_cluster.block_hash import BlockHashMemo, block_hashes
from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.radix_cache import PrefixMatch, RadixCache
from pd_cluster.kv_spec import KVSpec

SPEC = KVSpec(model="tiny", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")


class Events:
    """Collects what the cache reports, the way a node would forward it to the master."""

    def __init__(self) -> None:
        self.stored: list[int] = []
        self.evicted: list[int] = []
        self.calls = 0

    def __call__(self, stored: list[int], evicted: list[int]) -> None:
        self.calls += 1
        self.stored.extend(stored)
        self.evicted.extend(evicted)


def make(capacity: int = 256, block_size: int = 1, **kwargs: object) -> tuple[KVPool, RadixCache]:
    pool = KVPool(SPEC, num_slots=capacity)
    return pool, RadixCache(pool, block_size=block_size, **kwargs)  # type: ignore[arg-type]


def fill(pool: KVPool, cache: RadixCache, tokens: list[int]) -> tuple[PrefixMatch, torch.Tensor]:
    """What a request does: reuse the cached prefix, compute the rest, hand it all to the cache.

    Returns the insert's match and the slots of the partial tail, which stay the caller's.
    """
    hit = cache.match_prefix(tokens)
    new = pool.alloc(len(tokens) - hit.num_tokens)
    assert new is not None
    slots = torch.cat([hit.slots, new])
    match = cache.insert(tokens, slots)
    n_full = len(tokens) // cache.block_size * cache.block_size
    return match, slots[n_full:]


# --------------------------------------------------------------------------------------------
# Block hashes


def test_block_hashes_follow_the_documented_chain() -> None:
    tokens = list(range(1000, 1010))
    hashes = block_hashes(tokens, 4, parent=7)
    assert len(hashes) == 2  # the partial last block has no hash
    h = 7
    for i, got in enumerate(hashes):
        data = h.to_bytes(8, "little") + struct.pack("<4i", *tokens[4 * i : 4 * i + 4])
        h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        assert got == h


def test_block_hashes_depend_on_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4], 2)
    b = block_hashes([9, 2, 3, 4], 2)
    assert a[1] != b[1]  # same second block, different history
    assert block_hashes([1, 2, 3, 4], 2) == a
    assert block_hashes([3, 4], 2, parent=a[0]) == a[1:]
    assert block_hashes([1, 2, 3], 4) == []
    assert block_hashes(torch.tensor([1, 2, 3, 4]), 2) == a


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_memo_gives_the_chain_of_block_hashes_and_recomputes_only_changed_runs(block_size: int) -> None:
    rng = random.Random(block_size)
    memo = BlockHashMemo(run_blocks=8)
    first = [rng.randrange(50_000) for _ in range(40 * block_size + block_size - 1)]  # 5 runs (and a partial block)
    assert memo.block_hashes(first, block_size) == block_hashes(first, block_size)
    assert (memo.hits, memo.misses) == (0, 5)
    assert memo.block_hashes(first, block_size) == block_hashes(first, block_size)
    assert (memo.hits, memo.misses) == (5, 5)

    # A later turn: the first 20 blocks kept, the rest changed and longer.
    later = first[: 20 * block_size] + [rng.randrange(50_000) for _ in range(30 * block_size)]
    assert memo.block_hashes(later, block_size) == block_hashes(later, block_size)
    assert (memo.hits, memo.misses) == (7, 10)  # runs 0-1 found; run 2 (blocks 16-23) to run 6 computed
    # A change inside the first block changes every hash after it.
    other = [first[0] + 1] + first[1:]
    assert memo.block_hashes(other, block_size) == block_hashes(other, block_size) != block_hashes(first, block_size)
    assert memo.block_hashes([], block_size) == [] and memo.block_hashes(first[: block_size - 1], block_size) == []


def test_the_memo_is_bounded_and_drops_the_least_recently_used_run() -> None:
    memo = BlockHashMemo(run_blocks=4, max_runs=3)
    prompts = [[i] * 8 for i in range(3)]  # two runs each
    for p in prompts:
        memo.block_hashes(p, 1)
    assert len(memo) == 3  # six runs made, three kept: the last prompt's two and the one before
    misses = memo.misses
    assert memo.block_hashes(prompts[2], 1) == block_hashes(prompts[2], 1)
    assert memo.misses == misses  # kept
    assert memo.block_hashes(prompts[0], 1) == block_hashes(prompts[0], 1)
    assert memo.misses == misses + 2  # dropped
    with pytest.raises(ValueError):
        BlockHashMemo(run_blocks=0)


# --------------------------------------------------------------------------------------------
# Match and insert


def test_empty_cache_matches_nothing_at_root() -> None:
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.num_tokens == 0 and m.node is cache.root and m.slots.numel() == 0


def test_insert_then_match_token_level() -> None:
    pool, cache = make(block_size=1)
    tokens = [5, 6, 7, 8, 9]
    match, tail = fill(pool, cache, tokens)
    assert tail.numel() == 0
    assert match.num_tokens == 5 and cache.cached_tokens == 5
    again = cache.match_prefix(tokens + [10, 11])
    assert again.num_tokens == 5 and torch.equal(again.slots, match.slots)
    part = cache.match_prefix([5, 6, 7, 1])
    assert part.num_tokens == 3 and torch.equal(part.slots, match.slots[:3])
    assert cache.match_prefix([6, 7]).num_tokens == 0
    assert cache.match_prefix(torch.tensor([5, 6])).num_tokens == 2
    assert pool.num_free == pool.capacity - 5


def test_partial_last_block_is_never_matched_or_taken() -> None:
    pool, cache = make(block_size=16)
    tokens = list(range(40))
    slots = pool.alloc(40)
    assert slots is not None
    match = cache.insert(tokens, slots)
    assert match.num_tokens == 32 and torch.equal(match.slots, slots[:32])
    assert cache.cached_tokens == 32
    assert cache.match_prefix(tokens).num_tokens == 32
    assert cache.match_prefix(tokens[:31]).num_tokens == 16
    assert cache.match_prefix(tokens[:15]).num_tokens == 0
    # A difference inside the second block keeps only the first.
    assert cache.match_prefix(tokens[:20] + [999] + tokens[21:]).num_tokens == 16
    # The tail is still the caller's: freeing it works, and then everything is accounted for.
    pool.free(slots[32:])
    assert cache.flush() == 32
    assert pool.num_free == pool.capacity


def test_insert_frees_a_concurrent_duplicate_exactly_once() -> None:
    pool, cache = make(block_size=4)
    tokens = list(range(12))
    first, _ = fill(pool, cache, tokens)
    # A second request computed the same prefix without a hit, plus 4 more tokens and a tail.
    mine = pool.alloc(18)
    assert mine is not None
    before = pool.num_free
    match = cache.insert(tokens + [50, 51, 52, 53, 60, 61], mine)
    assert match.num_tokens == 16
    assert torch.equal(match.slots[:12], first.slots)  # the tree's copy wins
    assert torch.equal(match.slots[12:], mine[12:16])
    assert pool.num_free == before + 12  # the 12 duplicate slots, once
    with pytest.raises(RuntimeError):
        pool.free(mine[:1])  # already back in the pool
    assert cache.cached_tokens == 16
    pool.free(mine[16:])  # the tail never left the caller
    assert cache.flush() == 16 and pool.num_free == pool.capacity


def test_insert_keeps_slots_equal_to_the_pinned_prefix() -> None:
    pool, cache = make(block_size=2)
    fill(pool, cache, [1, 2, 3, 4])
    hit = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    cache.inc_ref(hit.node)
    new = pool.alloc(3)
    assert new is not None
    before = pool.num_free
    match = cache.insert([1, 2, 3, 4, 5, 6, 7], torch.cat([hit.slots, new]))
    assert pool.num_free == before  # nothing was a duplicate
    assert torch.equal(match.slots, torch.cat([hit.slots, new[:2]]))
    assert cache.cached_tokens == 6
    cache.dec_ref(hit.node)
    pool.free(new[2:])
    cache.flush()
    assert pool.num_free == pool.capacity


def test_insert_returns_deepest_node_for_pinning() -> None:
    pool, cache = make()
    match, _ = fill(pool, cache, [1, 2, 3])
    cache.inc_ref(match.node)
    assert cache.pinned_tokens == 3 and cache.evictable_tokens == 0
    assert cache.evict(10) == 0
    cache.dec_ref(match.node)
    assert cache.pinned_tokens == 0 and cache.evictable_tokens == 3


def test_insert_rejects_fewer_slots_than_full_tokens() -> None:
    pool, cache = make(block_size=2)
    slots = pool.alloc(3)
    assert slots is not None
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], slots)
    assert pool.num_free == pool.capacity - 3 and cache.cached_tokens == 0


def test_disabled_cache_frees_full_blocks_and_never_matches() -> None:
    events = Events()
    pool, cache = make(block_size=4, enabled=False, event_sink=events)
    slots = pool.alloc(10)
    assert slots is not None
    match = cache.insert(list(range(10)), slots)
    assert match.num_tokens == 0 and match.node is cache.root
    assert pool.num_free == pool.capacity - 2  # the caller keeps the 2-token tail
    assert cache.match_prefix(list(range(10))).num_tokens == 0
    assert cache.cached_tokens == 0 and events.calls == 0
    pool.free(slots[8:])


# --------------------------------------------------------------------------------------------
# Pins and splits


def test_split_keeps_pins_along_the_whole_path() -> None:
    pool, cache = make(block_size=4)
    a = list(range(16))
    ma, _ = fill(pool, cache, a)
    cache.inc_ref(ma.node)
    # Matching half of the pinned node splits it at a block boundary.
    half = cache.match_prefix(a[:8] + [99] * 8)
    assert half.num_tokens == 8 and half.node is not ma.node
    # Inserting a branch off the middle splits it again.
    mb, _ = fill(pool, cache, a[:4] + [70, 71, 72, 73])
    assert mb.num_tokens == 8 and torch.equal(mb.slots[:4], ma.slots[:4])
    assert cache.cached_tokens == 20 and cache.pinned_tokens == 16
    assert cache.evict(1000) == 4  # only the unpinned branch goes
    assert torch.equal(cache.match_prefix(a).slots, ma.slots)
    cache.dec_ref(ma.node)  # the handle from before the splits still unpins everything
    assert cache.pinned_tokens == 0
    assert cache.evict(1000) == 16
    assert pool.num_free == pool.capacity


def test_two_pins_through_a_split_node_need_two_unpins() -> None:
    pool, cache = make(block_size=1)
    ma, _ = fill(pool, cache, [1, 2, 3, 4])
    cache.inc_ref(ma.node)
    hit = cache.match_prefix([1, 2, 9])
    cache.inc_ref(hit.node)
    cache.dec_ref(ma.node)
    assert cache.pinned_tokens == 2
    assert cache.evict(100) == 2  # tokens 3, 4
    assert cache.match_prefix([1, 2, 3]).num_tokens == 2
    cache.dec_ref(hit.node)
    assert cache.evict(100) == 2 and pool.num_free == pool.capacity


def test_dec_ref_below_zero_raises_and_changes_nothing() -> None:
    pool, cache = make()
    m, _ = fill(pool, cache, [1, 2, 3])
    with pytest.raises(RuntimeError):
        cache.dec_ref(m.node)
    cache.inc_ref(m.node)
    cache.dec_ref(m.node)
    with pytest.raises(RuntimeError):
        cache.dec_ref(m.node)
    with pytest.raises(RuntimeError):
        cache.dec_ref(cache.root)
    assert m.node.lock_ref == 0 and cache.root.lock_ref == 0


def test_pinning_an_evicted_node_raises() -> None:
    pool, cache = make()
    m, _ = fill(pool, cache, [1, 2, 3])
    cache.evict(3)
    with pytest.raises(RuntimeError):
        cache.inc_ref(m.node)


def test_empty_match_can_be_pinned_and_unpinned() -> None:
    _, cache = make()
    m = cache.match_prefix([1])
    cache.inc_ref(m.node)
    cache.dec_ref(m.node)
    assert cache.pinned_tokens == 0


# --------------------------------------------------------------------------------------------
# Eviction and flush


def test_evict_takes_least_recently_used_leaf_first() -> None:
    pool, cache = make()
    a, b, c = [1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3, 3]
    for tokens in (a, b, c):
        fill(pool, cache, tokens)
    cache.match_prefix(a)  # a is now the most recent
    assert cache.evict(1) == 4  # b, whole node
    assert cache.match_prefix(b).num_tokens == 0
    assert cache.evict(1) == 5  # then c
    assert cache.match_prefix(a).num_tokens == 3
    assert cache.evict(1) == 3
    assert cache.cached_tokens == 0 and pool.num_free == pool.capacity


def test_split_halves_keep_their_access_time() -> None:
    pool, cache = make()
    fill(pool, cache, [1, 2, 3, 4])
    fill(pool, cache, [9, 9])
    # Inserting a branch off [1, 2, 3, 4] refreshes only [1, 2] and the branch, not [3, 4].
    fill(pool, cache, [1, 2, 7])
    assert cache.evict(1) == 2  # [3, 4] kept the old time of [1, 2, 3, 4]
    assert cache.match_prefix([1, 2, 3]).num_tokens == 2
    assert cache.evict(1) == 2  # then [9, 9]
    assert cache.match_prefix([9, 9]).num_tokens == 0


def test_use_through_a_shared_prefix_refreshes_the_prefix_too() -> None:
    pool, cache = make()
    fill(pool, cache, [1, 2, 3])
    fill(pool, cache, [1, 2, 4])  # [1, 2] is now a shared parent of [3] and [4]
    other, _ = fill(pool, cache, [9])
    cache.match_prefix([1, 2, 3])  # uses [1, 2] after [9] was last used
    cache.inc_ref(other.node)
    assert cache.evict(1) == 1 and cache.evict(1) == 1  # [4], then [3]: [1, 2] is a leaf now
    cache.dec_ref(other.node)
    assert cache.evict(1) == 1  # [9] is older than [1, 2]
    assert cache.match_prefix([1, 2]).num_tokens == 2
    assert cache.match_prefix([9]).num_tokens == 0


def test_evicting_a_leaf_exposes_its_parent() -> None:
    pool, cache = make(block_size=2)
    fill(pool, cache, [1, 2, 3, 4])
    fill(pool, cache, [1, 2, 5, 6])
    fill(pool, cache, [8, 8])
    cache.match_prefix([8, 8])
    assert cache.evict(5) == 6  # both branches, then their shared parent
    assert cache.match_prefix([1, 2]).num_tokens == 0
    assert cache.match_prefix([8, 8]).num_tokens == 2


def test_evict_never_touches_pinned_nodes() -> None:
    pool, cache = make(block_size=2)
    keep, _ = fill(pool, cache, [1, 2, 3, 4])
    fill(pool, cache, [1, 2, 3, 4, 5, 6])
    fill(pool, cache, [7, 8])
    cache.inc_ref(keep.node)
    assert cache.evictable_tokens == 4
    assert cache.evict(10**6) == 4
    assert cache.cached_tokens == 4 == cache.pinned_tokens
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).slots, keep.slots)
    assert pool.num_free == pool.capacity - 4


def test_flush_returns_every_unpinned_slot() -> None:
    pool, cache = make(capacity=256, block_size=4)
    rng = random.Random(1)
    for _ in range(10):
        fill(pool, cache, [rng.randrange(3) for _ in range(rng.randrange(4, 20) // 4 * 4)])
    assert cache.cached_tokens > 0
    cached = cache.cached_tokens
    assert cache.flush() == cached
    assert cache.cached_tokens == 0 and pool.num_free == pool.capacity


def test_flush_keeps_pinned_paths() -> None:
    pool, cache = make(block_size=1)
    keep, _ = fill(pool, cache, [1, 2, 3])
    fill(pool, cache, [1, 2, 4, 5])
    fill(pool, cache, [6])
    cache.inc_ref(keep.node)
    assert cache.flush() == 3
    assert cache.cached_tokens == 3 and pool.num_free == pool.capacity - 3
    # Eviction still works after a flush.
    cache.dec_ref(keep.node)
    assert cache.evict(100) == 3 and pool.num_free == pool.capacity


@pytest.mark.timeout(60)
def test_evict_in_small_steps_over_a_large_tree_frees_it_all() -> None:
    # ~100k tokens in ~3k leaves under a shared prefix, evicted one node per call: a per-call scan of
    # the whole tree would be quadratic here.
    pool, cache = make(capacity=110_000, block_size=1)
    shared = list(range(1000))
    fill(pool, cache, shared)
    for i in range(3000):
        fill(pool, cache, shared + [10_000 + i] * 33)
    total = cache.cached_tokens
    assert total == 1000 + 3000 * 33
    freed = 0
    while cache.cached_tokens:
        got = cache.evict(1)
        assert got > 0
        freed += got
    assert freed == total and pool.num_free == pool.capacity


# --------------------------------------------------------------------------------------------
# Events


def test_events_name_blocks_by_chained_hashes_of_the_full_path() -> None:
    events = Events()
    pool, cache = make(block_size=4, event_sink=events)
    a = list(range(100, 114))  # 3 full blocks + 2 tokens
    fill(pool, cache, a)
    assert events.stored == block_hashes(a, 4) and events.calls == 1
    b = a[:8] + [7, 7, 7, 7, 8, 8, 8, 8]  # shares two blocks, adds two
    fill(pool, cache, b)
    assert events.stored[3:] == block_hashes(b, 4)[2:] and events.calls == 2
    fill(pool, cache, a)  # nothing new: no event
    assert events.calls == 2
    cache.evict(1)  # the least recent leaf: b's two own blocks
    assert events.evicted == block_hashes(b, 4)[2:]
    cache.flush()
    assert sorted(events.evicted) == sorted(events.stored)
    assert len(set(events.stored)) == len(events.stored) == 5


def test_events_after_a_split_keep_hashes_of_the_full_path() -> None:
    events = Events()
    pool, cache = make(block_size=2, event_sink=events)
    a = [1, 2, 3, 4, 5, 6]
    fill(pool, cache, a)
    cache.match_prefix([1, 2, 9, 9])  # splits the node after one block
    fill(pool, cache, [1, 2, 3, 4, 7, 7])  # splits again, adds one block
    assert events.stored == block_hashes(a, 2) + block_hashes([1, 2, 3, 4, 7, 7], 2)[2:]
    cache.flush()
    assert sorted(events.evicted) == sorted(events.stored)


def test_a_failing_event_sink_does_not_break_the_cache() -> None:
    def boom(stored: list[int], evicted: list[int]) -> None:
        raise RuntimeError("listener down")

    pool, cache = make(event_sink=boom)
    match, _ = fill(pool, cache, [1, 2])
    assert match.num_tokens == 2 and cache.cached_tokens == 2
    assert cache.flush() == 2 and pool.num_free == pool.capacity


# --------------------------------------------------------------------------------------------
# Randomized: the cache against a model of which prefix blocks are cached


def _tree_blocks(cache: RadixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every cached block as {full prefix up to the block's end: the block's slots}."""
    bs = cache.block_size
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            assert len(child.key) % bs == 0 and child.key
            slots = child.slots.tolist()
            path = prefix
            for i in range(0, len(child.key), bs):
                path = path + child.key[i : i + bs]
                out[path] = tuple(slots[i : i + bs])
            stack.append((child, path))
    return out


@pytest.mark.parametrize("block_size,seed", [(1, 0), (1, 1), (4, 2), (4, 3), (3, 4)])
def test_random_operations_match_a_simple_model(block_size: int, seed: int) -> None:
    rng = random.Random(seed)
    events = Events()
    capacity = 160
    pool, cache = make(capacity=capacity, block_size=block_size, event_sink=events)
    bs = block_size
    model: dict[tuple[int, ...], tuple[int, ...]] = {}  # prefix (ending at a block) -> block slots
    touched: dict[tuple[int, ...], int] = {}  # prefix -> model time of last match/insert through it
    clock = 0
    pins: list[tuple[PrefixMatch, tuple[int, ...]]] = []
    held: list[torch.Tensor] = []  # partial tails still owned by the test
    live_hashes: set[int] = set()
    seen_events = (0, 0)

    def model_match(tokens: list[int]) -> tuple[int, tuple[int, ...]]:
        n, slots = 0, ()
        while n + bs <= len(tokens) and tuple(tokens[: n + bs]) in model:
            slots += model[tuple(tokens[: n + bs])]
            n += bs
        return n, slots

    def touch(tokens: list[int], n: int) -> None:
        nonlocal clock
        if n:
            clock += 1
            for end in range(bs, n + 1, bs):
                touched[tuple(tokens[:end])] = clock

    def pinned_prefixes() -> set[tuple[int, ...]]:
        return {p[:end] for _, p in pins for end in range(bs, len(p) + 1, bs)}

    def check_eviction(before: dict[tuple[int, ...], tuple[int, ...]], freed: int) -> None:
        after = _tree_blocks(cache)
        gone = set(before) - set(after)
        assert set(after) <= set(before)
        assert all(after[p] == before[p] for p in after)
        assert sum(len(before[p]) for p in gone) == freed
        assert not gone & pinned_prefixes()
        # LRU: nothing evicted is newer than an unpinned leaf that stayed.
        leaves = [p for p in after if not any(len(q) == len(p) + bs and q[: len(p)] == p for q in after)]
        stayed = [touched[p] for p in leaves if p not in pinned_prefixes()]
        if gone and stayed:
            assert max(touched[p] for p in gone) <= min(stayed)
        model.clear()
        model.update(after)

    for _ in range(400):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        if op < 0.45:  # a request: match, compute the rest, insert, maybe keep it pinned
            hit = cache.match_prefix(tokens)
            n, slots = model_match(tokens)
            assert hit.num_tokens == n and tuple(hit.slots.tolist()) == slots
            touch(tokens, n)
            fresh = rng.random() < 0.3  # recomputed without using the hit: duplicates
            need = len(tokens) if fresh else len(tokens) - n
            if need > pool.num_free:
                check_eviction(dict(model), cache.evict(need - pool.num_free))
                hit = cache.match_prefix(tokens)  # the hit may have been evicted
                n, _ = model_match(tokens)
                touch(tokens, n)
                need = len(tokens) if fresh else len(tokens) - n
            new = pool.alloc(need)
            if new is None:
                continue
            given = new if fresh else torch.cat([hit.slots, new])
            match = cache.insert(tokens, given)
            n_full = len(tokens) // bs * bs
            for end in range(bs, n_full + 1, bs):
                model.setdefault(tuple(tokens[:end]), tuple(given[end - bs : end].tolist()))
            n, slots = model_match(tokens)
            assert match.num_tokens == n == n_full and tuple(match.slots.tolist()) == slots
            touch(tokens, n)
            if n_full < len(tokens):
                held.append(given[n_full:])
            if n_full and rng.random() < 0.5:
                cache.inc_ref(match.node)
                pins.append((match, tuple(tokens[:n_full])))
        elif op < 0.65:  # a lookup
            hit = cache.match_prefix(tokens)
            n, slots = model_match(tokens)
            assert hit.num_tokens == n and tuple(hit.slots.tolist()) == slots
            touch(tokens, n)
        elif op < 0.8 and pins:  # a request finishes
            match, _ = pins.pop(rng.randrange(len(pins)))
            cache.dec_ref(match.node)
        elif op < 0.9:
            check_eviction(dict(model), cache.evict(rng.randrange(1, 40)))
        elif op < 0.93:
            check_eviction(dict(model), cache.flush())
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))

        # Invariants after every step.
        assert _tree_blocks(cache) == model
        assert cache.cached_tokens == sum(len(s) for s in model.values())
        held_slots = sum(t.numel() for t in held)
        assert pool.num_free + cache.cached_tokens + held_slots == capacity
        assert cache.pinned_tokens == sum(len(model[p]) for p in pinned_prefixes())
        assert cache.evictable_tokens == cache.cached_tokens - cache.pinned_tokens
        for match, prefix in pins:  # pinned prefixes stay whole, with their slots
            again = cache.match_prefix(list(prefix))
            touch(list(prefix), again.num_tokens)
            assert torch.equal(again.slots, match.slots)
        # Events: stored and evicted hashes track exactly the blocks in the tree.
        new_stored = events.stored[seen_events[0] :]
        new_evicted = events.evicted[seen_events[1] :]
        seen_events = (len(events.stored), len(events.evicted))
        assert not live_hashes & set(new_stored)
        live_hashes |= set(new_stored)
        assert set(new_evicted) <= live_hashes
        live_hashes -= set(new_evicted)
        assert live_hashes == {block_hashes(p, bs)[-1] for p in model}

    while pins:
        cache.dec_ref(pins.pop()[0].node)
    for tail in held:
        pool.free(tail)
    cache.flush()
    assert pool.num_free == capacity and cache.cached_tokens == 0
