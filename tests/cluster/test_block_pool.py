"""BlockPool: prefix hits only for content whose writing step completed, under the same chained
prefix and salt; the last token always left to compute; truly free blocks before evicting cached
ones, least recently used first; and, over random traffic under eviction pressure, every block in
exactly one state, refcounts equal to the holders' tables, and every hit holding exactly the
cache a fresh computation of that prompt would write (a shadow of each slot's prefix)."""

import random
from collections import Counter

import pytest

from cluster.block_pool import BlockPool
from model.cache import CacheFull

BS = 4


def _fill(pool: BlockPool, tokens: list[int], salt: str | None = None) -> list[int]:
    """A sequence that computes all of ``tokens`` in one completed step: its blocks, registered."""
    table = pool.allocate(pool.blocks_needed(len(tokens), 0))
    pool.register(table, tokens, salt, len(tokens))
    return table


def _cache(pool: BlockPool, tokens: list[int], salt: str | None = None) -> list[int]:
    """As :func:`_fill`, then the sequence finishes: its full blocks stay cached."""
    table = _fill(pool, tokens, salt)
    pool.free(table)
    return table


def test_allocator_interface_and_cache_full():
    pool = BlockPool(4, BS)
    assert (pool.num_blocks, pool.block_size, pool.num_free) == (4, BS, 4)
    assert pool.blocks_needed(9, 0) == 3 and pool.blocks_needed(9, 2) == 1 and pool.blocks_needed(8, 3) == 0
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.num_held == 3
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(CacheFull):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4 and pool.num_held == 0 and pool.num_cached == 0
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_hit_returns_exactly_the_registered_blocks():
    pool = BlockPool(8, BS)
    prompt = list(range(10, 22))  # three full blocks
    table = _cache(pool, prompt)
    assert pool.num_cached == 3 and pool.num_held == 0
    hit = pool.match(prompt + [99], None)
    assert hit == table
    assert pool.num_held == 3 and pool.num_cached == 0  # acquired: out of the LRU
    assert pool.match(prompt[:9] + [7, 7, 7, 7], None) == table[:2]  # diverges in the third block
    assert pool.num_queries_tokens == 26 and pool.num_hit_tokens == 5 * BS


def test_chained_hash_same_block_after_another_prefix_misses():
    pool = BlockPool(8, BS)
    _cache(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    # the second block's tokens, after a different first block: no hit at all
    assert pool.match([9, 9, 9, 9, 5, 6, 7, 8, 0], None) == []
    # and as the first block of a prompt: no hit either (its parent is the root, not [1, 2, 3, 4])
    assert pool.match([5, 6, 7, 8, 0], None) == []
    assert pool.num_hit_tokens == 0


def test_salt_separates_equal_prompts():
    pool = BlockPool(8, BS)
    prompt = [1, 2, 3, 4, 5]
    _cache(pool, prompt, "tenant-a")
    assert pool.match(prompt, "tenant-b") == []
    assert pool.match(prompt, None) == []
    assert pool.match(prompt, "") == []  # an empty salt is a salt, not its absence
    assert len(pool.match(prompt, "tenant-a")) == 1


def test_last_token_is_always_left_to_compute():
    pool = BlockPool(8, BS)
    prompt = list(range(8))  # exactly two full blocks
    table = _cache(pool, prompt)
    hit = pool.match(prompt, None)
    assert hit == table[:1], "an exact block-aligned prompt must recompute its last block"
    pool.free(hit)
    assert pool.match(prompt + [8], None) == table
    assert pool.match(prompt[:1], None) == [] and pool.match([], None) == []


def test_only_completed_steps_are_hit():
    pool = BlockPool(8, BS)
    prompt = list(range(12))
    table = pool.allocate(3)  # written by a step still in flight (or one that may be redone)
    assert pool.match(prompt + [0], None) == []
    pool.register(table, prompt, None, 6)  # the step that completed covered 6 tokens: one full block
    assert pool.match(prompt + [0], None) == table[:1]
    pool.register(table, prompt, None, 12)
    assert pool.match(prompt + [0], None) == table


def test_register_is_idempotent_and_keeps_the_first_duplicate():
    pool = BlockPool(8, BS)
    prompt = list(range(8))
    first = _fill(pool, prompt)
    pool.register(first, prompt, None, 8)  # again: nothing changes
    second = _fill(pool, prompt)  # the same prompt computed concurrently elsewhere
    hit = pool.match(prompt + [0], None)
    assert hit == first
    pool.free(hit)
    pool.free(second)  # unregistered duplicates: back to the free list, not the cache
    assert pool.num_cached == 0 and pool.num_free == 6
    pool.free(first)
    assert pool.num_cached == 2 and pool.match(prompt + [0], None) == first


def test_duplicate_takes_the_entry_once_the_first_is_evicted():
    pool = BlockPool(3, BS)
    prompt = [1, 2, 3, 4]
    first = _cache(pool, prompt)
    second = _fill(pool, prompt)  # a duplicate, held; the one free block left is block 2
    pool.allocate(2)  # block 2, then evicts ``first``
    assert pool.match(prompt + [0], None) == []
    pool.free(second)  # its hash is free now: cached instead of forgotten
    assert pool.num_cached == 1 and pool.match(prompt + [0], None) == second


def test_unregistered_free_goes_to_the_free_list():
    pool = BlockPool(4, BS)
    table = pool.allocate(2)
    pool.register(table, [1, 2, 3, 4, 5, 6], None, 6)  # the tail block is not full
    pool.free(table)
    assert pool.num_cached == 1 and pool.num_free == 3


def test_allocate_takes_free_blocks_before_evicting_cached_ones():
    pool = BlockPool(4, BS)
    a = _cache(pool, [1, 1, 1, 1, 1])  # block 0 cached, block 1 (the tail) free again
    b = _cache(pool, [2, 2, 2, 2, 2])
    assert pool.num_cached == 2 and pool.num_free == 2
    got = pool.allocate(2)
    assert set(got).isdisjoint(a[:1] + b[:1]), "evicted a cached block while free ones were left"
    assert pool.num_cached == 2 and pool.num_evicted == 0
    assert pool.match([1, 1, 1, 1, 1], None) == a[:1]


def test_lru_eviction_order():
    pool = BlockPool(3, BS)
    a = _cache(pool, [1, 1, 1, 1])
    b = _cache(pool, [2, 2, 2, 2])
    c = _cache(pool, [3, 3, 3, 3])
    assert pool.num_free == 0 and pool.num_cached == 3
    pool.free(pool.match([1, 1, 1, 1, 0], None))  # a used again: now the most recent
    (first,) = pool.allocate(1)
    assert [first] == b, "evicted not the least recently used block"
    assert pool.match([2, 2, 2, 2, 0], None) == []  # eviction forgot its content
    (second,) = pool.allocate(1)
    assert [second] == c and pool.num_evicted == 2
    assert pool.match([1, 1, 1, 1, 0], None) == a


def test_a_sequence_tail_is_evicted_before_its_prefix():
    pool = BlockPool(3, BS)
    table = _cache(pool, list(range(12)))
    (evicted,) = pool.allocate(1)
    assert evicted == table[-1]
    assert pool.match(list(range(13)), None) == table[:2]


def test_freeing_a_block_not_held_raises_and_changes_nothing():
    pool = BlockPool(4, BS)
    with pytest.raises(ValueError, match="block 2"):
        pool.free([2])
    table = pool.allocate(2)
    with pytest.raises(ValueError, match=f"block {table[0]}"):
        pool.free([table[1], table[0], table[0]])  # freed twice, held once
    assert pool.num_held == 2
    with pytest.raises(ValueError, match="block -1"):
        pool.free([-1])
    pool.free(table)
    with pytest.raises(ValueError, match=f"block {table[1]}"):
        pool.free(table[1:])
    assert pool.num_free == 4


def test_register_needs_held_blocks_and_enough_tokens():
    pool = BlockPool(4, BS)
    table = pool.allocate(1)
    with pytest.raises(ValueError, match="upto_tokens"):
        pool.register(table, [1, 2, 3], None, 4)
    with pytest.raises(ValueError, match="upto_tokens"):
        pool.register(table, list(range(8)), None, 8)
    with pytest.raises(ValueError, match="block 3"):
        pool.register([3], [1, 2, 3, 4], None, 4)


def test_clear_forgets_holds_and_content():
    pool = BlockPool(4, BS)
    _cache(pool, [1, 2, 3, 4, 5])
    held = pool.allocate(2)
    pool.clear()
    assert (pool.num_free, pool.num_cached, pool.num_held) == (4, 0, 0)
    assert pool.match([1, 2, 3, 4, 5], None) == []
    with pytest.raises(ValueError):
        pool.free(held)


# -- random traffic -------------------------------------------------------------------------------


def _check(pool: BlockPool, tables: list[list[int]]) -> None:
    """Every block in exactly one state, counted right; refcounts equal the live block tables'
    (read from the pool's private fields: this is the oracle for them)."""
    free, cached = Counter(pool._free), set(pool._lru)
    held = {b for b in range(pool.num_blocks) if pool._ref[b] > 0}
    assert all(n == 1 for n in free.values()), "a block twice in the free list"
    for b in range(pool.num_blocks):
        states = (b in free) + (b in cached) + (b in held)
        assert states == 1, f"block {b} is in {states} states"
    assert (pool.num_free, pool.num_cached, pool.num_held) == (len(free), len(cached), len(held))
    assert pool.num_free + pool.num_cached + pool.num_held == pool.num_blocks
    holds = Counter(b for t in tables for b in t)
    assert pool._ref == [holds[b] for b in range(pool.num_blocks)], "refcounts differ from the block tables"
    for t in tables:
        assert len(set(t)) == len(t), f"a block held twice by one sequence: {t}"
    for h, b in pool._table.items():
        assert pool._hash[b] == h
    assert all(pool._hash[b] in pool._table for b in cached) and all(pool._hash[b] is None for b in free)


class _Req:
    def __init__(self, tokens: list[int], salt: str | None, max_len: int):
        self.tokens, self.salt, self.max_len = tokens, salt, max_len
        self.table: list[int] = []
        self.written = 0  # tokens whose cache a launched step wrote
        self.done = 0  # of which the step completed


def test_random_traffic_keeps_the_pool_consistent():
    rng = random.Random(1234)
    pool = BlockPool(24, BS)
    vocab = 2  # 16 distinct blocks of 4: equal blocks after different prefixes are common
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(16, 32))] for _ in range(3)]
    salts = [None, "a", "b"]
    # block → per slot, (salt, every token up to and including that slot): what a real latent
    # cache row depends on. A hit block must hold exactly the rows a fresh prefill would write.
    shadow: dict[int, list] = {b: [None] * BS for b in range(pool.num_blocks)}
    waiting: list[_Req] = []
    for _ in range(200):
        prefix = rng.choice(prefixes)[: rng.randint(0, 32)]
        prompt = prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        waiting.append(_Req(prompt, rng.choice(salts), len(prompt) + rng.randint(0, 10)))
    running: list[_Req] = []
    finished = preempted = 0

    def admit(req: _Req) -> None:
        hit = pool.match(req.tokens, req.salt)
        assert len(hit) <= (len(req.tokens) - 1) // BS
        for i, b in enumerate(hit):
            want = [(req.salt, tuple(req.tokens[: i * BS + j + 1])) for j in range(BS)]
            assert shadow[b] == want, f"hit block {b} holds another prefix's cache"
        req.table, req.written = hit, len(hit) * BS
        req.done = req.written
        running.append(req)

    def launch(req: _Req) -> None:
        nonlocal preempted
        n = min(len(req.tokens) - req.written, rng.randint(1, 8))
        need = pool.blocks_needed(req.written + n, len(req.table))
        if not pool.can_allocate(need):  # preempt it: recomputed later from everything it has
            pool.free(req.table)
            req.table, req.written, req.done = [], 0, 0
            running.remove(req)
            waiting.append(req)
            preempted += 1
            return
        req.table += pool.allocate(need)
        for pos in range(req.written, req.written + n):
            b = req.table[pos // BS]
            assert pool._ref[b] == 1 and pool._hash[b] is None, f"writing shared or registered block {b}"
            shadow[b][pos % BS] = (req.salt, tuple(req.tokens[: pos + 1]))
        req.written += n

    def complete(req: _Req) -> None:
        if rng.random() < 0.1:  # the step failed: it is redone, nothing it wrote is registered
            req.written = req.done
            return
        req.done = req.written
        pool.register(req.table, req.tokens, req.salt, req.done)
        if req.done == len(req.tokens) and len(req.tokens) < req.max_len:
            req.tokens.append(rng.randrange(vocab))  # sampled: computed by the next step

    def finish(req: _Req) -> None:
        nonlocal finished
        pool.free(req.table)
        running.remove(req)
        finished += 1

    for _ in range(20_000):
        if not waiting and not running:
            break
        if waiting and len(running) < 4 and rng.random() < 0.3:
            admit(waiting.pop(rng.randrange(len(waiting))))
        elif running:
            req = rng.choice(running)
            if req.written > req.done:
                complete(req)
            elif req.done == len(req.tokens) >= req.max_len or rng.random() < 0.02:
                finish(req)  # its length limit, or a stop token / an abort at any point
            elif req.written < len(req.tokens):
                launch(req)
        _check(pool, [r.table for r in running])
    assert finished == 200 and not running
    assert pool.num_held == 0 and pool.num_free + pool.num_cached == pool.num_blocks
    # the traffic did exercise what it is meant to
    assert pool.num_evicted > 50 and pool.num_hit_tokens > 0 and preempted > 0
