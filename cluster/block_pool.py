"""One attention replica's cache blocks, with prefix caching over their contents.

:class:`BlockPool` owns, for ``num_blocks`` blocks of ``block_size`` token slots: each block's
reference count, the content hash of each full block whose writing step has completed, the table
hash → block, the list of truly free blocks and the LRU of cached ones. A block is in exactly one
state:

- *free*: no holder and no content worth keeping (never written, or its hash was dropped);
- *held*: refcount > 0 — one or more sequences have it in their block table;
- *cached*: refcount 0, but its hash is in the table, so a later request with the same prefix can
  take it back (:meth:`match`) until :meth:`allocate` evicts it, least recently used first.

A block's hash chains its content to everything before it: ``H(parent hash, its token ids)``, the
first block's parent being a root derived from the request's extra key (a ``cache_salt``). Equal
tokens after a different prefix, or under another salt, hash differently, because their latent
cache differs. Only full blocks are hashed, and only once the step that wrote them has completed
(:meth:`register`), so a block written by a step in flight, sent ahead, or later redone is never
offered to anyone.

Sharing needs no copy-on-write: a shared block is full, and callers only ever write a sequence's
own tail block — the positions after its matched prefix, which :meth:`match` always leaves at
least one token of — so a block is written only while its one holder is the sequence extending it.

Owned by the engine's prefix cache (:mod:`cluster.prefix_cache`, one per attention replica; the
:class:`~model.cache.BlockAllocator` interface plus :meth:`match`, :meth:`register` and
:meth:`clear`). Never: holds per-sequence state, touches tensors, or decides which sequence gets
evicted — only which blocks.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence

from model.cache import CacheFull

_HASH_BYTES = 32
_ROOT_TAG = b"moeray.block_pool.v1\x00"


def _root_hash(extra_key: str | None) -> bytes:
    """The parent of a sequence's first block: separates salts (None and "" differ too)."""
    key = b"\x00" if extra_key is None else b"\x01" + extra_key.encode("utf-8")
    return hashlib.blake2b(_ROOT_TAG + key, digest_size=_HASH_BYTES).digest()


class _FreeAndCached:
    """What both pools count the same way: a free list and an LRU of cached entries."""

    _free: list[int]
    _lru: OrderedDict[int, None]

    @property
    def num_free(self) -> int:
        """Truly free entries (no holder, no content). Not all the room: cached ones can be evicted."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Entries nobody holds whose content a later request can take (least recently used first)."""
        return len(self._lru)


_GENERATIONS = itertools.count()


class BlockPool(_FreeAndCached):
    """Reference-counted cache blocks with an LRU of cached full blocks, keyed by chained hashes."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # A block's tokens, little-endian int64: the canonical bytes its hash covers.
        self._pack = struct.Struct(f"<{block_size}q").pack
        self.num_queries_tokens = 0  # prompt tokens looked up by match(), cumulative across clear()
        self.num_hit_tokens = 0  # of which found cached or held
        self.num_evicted = 0  # cached blocks whose content allocate() dropped
        self.clear()

    def clear(self) -> None:
        """Forget every hold and every hash: the replica and its cache are gone. Block tables
        handed out before are void (freeing them raises). The counters keep counting."""
        self.generation = next(_GENERATIONS)  # unique to this pool's life until the next clear(): a hold taken
        # under another generation died with the replica (cluster/pd.py's transfers check it)
        self._ref = [0] * self.num_blocks
        # A held block's hash stays here as the chain memo even when another block owns the table
        # entry (a duplicate); a free block has None.
        self._hash: list[bytes | None] = [None] * self.num_blocks
        self._table: dict[bytes, int] = {}  # hash → the one block registered under it
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self._free = list(range(self.num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self._num_held = 0

    # -- counts (num_free, num_cached: _FreeAndCached) ------------------------------------------

    @property
    def num_held(self) -> int:
        return self._num_held

    @property
    def num_available(self) -> int:
        """Blocks :meth:`allocate` can hand out: the free ones, then the cached ones it evicts."""
        return len(self._free) + len(self._lru)

    # -- the BlockAllocator interface ----------------------------------------------------------

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each held once by the caller, with no content: truly free blocks first,
        then the least recently used cached blocks, whose hashes are dropped."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} cache blocks")
        if n > self.num_available:
            raise CacheFull(f"need {n} cache blocks, {len(self._free)} free and {len(self._lru)} cached")
        from_free = min(n, len(self._free))
        out = [self._free.pop() for _ in range(from_free)]
        for _ in range(n - from_free):
            block, _ = self._lru.popitem(last=False)
            del self._table[self._hash[block]]
            self._hash[block] = None
            out.append(block)
        self.num_evicted += n - from_free
        for block in out:
            self._ref[block] = 1
        self._num_held += n
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each of ``blocks`` (a block listed twice drops two). A block left with
        no holder becomes cached if it is registered, else free. Tail blocks go first, so a
        sequence's later blocks are evicted before the prefix others are likelier to share.
        Raises ValueError, changing nothing, if a block is not held that many times."""
        for block, times in Counter(blocks).items():
            self._check_id(block)
            if self._ref[block] < times:
                raise ValueError(f"cache block {block} freed {times} time(s) but held {self._ref[block]} time(s)")
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block]:
                continue
            self._num_held -= 1
            h = self._hash[block]
            if h is not None and self._table.setdefault(h, block) == block:
                self._lru[block] = None  # most recently used end
            else:
                self._hash[block] = None
                self._free.append(block)

    # -- prefix caching ----------------------------------------------------------------------

    def chain(self, hashes: list[bytes], token_ids: Sequence[int], extra_key: str | None, num_blocks: int) -> list[bytes]:
        """Extend ``hashes`` (a sequence's memo of its full blocks' chained hashes under
        ``extra_key``, a prefix of them) to its first ``num_blocks`` blocks, and return it. A
        sequence only ever appends tokens, so its memo never goes stale."""
        bs = self.block_size
        parent = hashes[-1] if hashes else _root_hash(extra_key)
        for i in range(len(hashes), min(num_blocks, len(token_ids) // bs)):
            parent = self._chain(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``hashes``; changes nothing."""
        out = []
        for h in hashes:
            block = self._table.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def num_cached_of(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are cached (not held): taking them takes that much room."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def take(self, blocks: Sequence[int], num_query_tokens: int) -> None:
        """Hold each of ``blocks`` (found by :meth:`lookup`) once more — cached ones leave the LRU —
        and count a query of ``num_query_tokens`` prompt tokens that hit ``len(blocks)`` blocks."""
        self.pin(blocks)
        self.num_queries_tokens += num_query_tokens
        self.num_hit_tokens += len(blocks) * self.block_size

    def pin(self, blocks: Sequence[int]) -> None:
        """Hold each of ``blocks`` once more (cached ones leave the LRU), counting no query: a block
        held while another engine copies it, or while it is written from one (cluster/pd.py)."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._lru[block]
                self._num_held += 1
            self._ref[block] += 1

    def match(self, token_ids: Sequence[int], extra_key: str | None = None) -> list[int]:
        """The blocks holding the longest cached prefix of ``token_ids`` (full blocks whose chained
        hashes match, under ``extra_key``), now held once more by the caller — cached ones leave
        the LRU. At most ``(len(token_ids) - 1) // block_size`` blocks: the last token is always
        left to compute (its logits are needed). A caller that then cannot allocate the rest frees
        them again; the query is counted either way."""
        hashes = self.chain([], token_ids, extra_key, (len(token_ids) - 1) // self.block_size)
        out = self.lookup(hashes)
        self.take(out, len(token_ids))
        return out

    def register_hashes(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        """:meth:`register` with the blocks' chained hashes already computed (``hashes[i]`` is
        ``block_ids[i]``'s; from :meth:`chain`). Same rules: held blocks, idempotent, the first
        of duplicates keeps the table entry."""
        if len(hashes) > len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        for block, h in zip(block_ids, hashes):
            self._check_id(block)
            if self._ref[block] == 0:
                raise ValueError(f"cache block {block} registered but not held")
        for block, h in zip(block_ids, hashes):
            if self._hash[block] is None:
                self._hash[block] = h
                self._table.setdefault(h, block)
            elif self._hash[block] != h:
                raise ValueError(f"cache block {block} registered again with other content")

    def register(self, block_ids: Sequence[int], token_ids: Sequence[int], extra_key: str | None,
                 upto_tokens: int) -> None:
        """Record the content of a sequence's full blocks covering its first ``upto_tokens``
        tokens, so later requests can :meth:`match` them. Call only once the step that wrote them
        has completed — never for a token sampled ahead or a step that may be redone.

        ``block_ids`` is the sequence's block table, ``token_ids`` its tokens (at least
        ``upto_tokens``). Idempotent: blocks that already have a hash keep it and are not hashed
        again (so each block is hashed once over a sequence's life; the hashed blocks are always a
        prefix of the table). If another block is already registered under a block's hash, the
        first one stays in the table and this one is not (it still serves as the chain's parent,
        and takes the entry if it is free when its last holder lets go)."""
        bs = self.block_size
        num_full = upto_tokens // bs
        if not 0 <= upto_tokens <= len(token_ids) or num_full > len(block_ids):
            raise ValueError(f"upto_tokens={upto_tokens} needs {num_full} full blocks and as many tokens; "
                             f"got {len(block_ids)} blocks and {len(token_ids)} tokens")
        start = num_full  # the first block without a hash: blocks before it are already hashed
        while start > 0:
            self._check_id(block_ids[start - 1])
            if self._hash[block_ids[start - 1]] is not None:
                break
            start -= 1
        for block in block_ids[start:num_full]:
            self._check_id(block)
            if self._ref[block] == 0:
                raise ValueError(f"cache block {block} registered but not held")
        parent = self._hash[block_ids[start - 1]] if start else _root_hash(extra_key)
        for i in range(start, num_full):
            block = block_ids[i]
            parent = self._chain(parent, token_ids[i * bs : (i + 1) * bs])
            self._hash[block] = parent
            self._table.setdefault(parent, block)

    def _chain(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        return hashlib.blake2b(parent + self._pack(*block_tokens), digest_size=_HASH_BYTES).digest()

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"cache block {block} out of range [0, {self.num_blocks})")


class SnapshotPool(_FreeAndCached):
    """One attention replica's KDA state snapshots (hybrid models), keyed like the blocks.

    A snapshot is the recurrent state and conv tail of a sequence right after its first ``b``
    tokens, ``b`` a block boundary; its key is the chained hash of the block ending at ``b`` (so
    it names every token before ``b`` and the salt). Same life as a block: *free*, *held* (a
    sequence is saving into it, or holds it to restore from later) or *cached* (registered, no
    holder, in an LRU evicted only when no snapshot is free). A snapshot is registered only once
    the step that wrote it completed. Owns ids only; the tensors are the actor's
    (:class:`~model.cache.KDAStateCache`)."""

    def __init__(self, num_snapshots: int):
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self.num_evicted = 0
        self.clear()

    def clear(self) -> None:
        self._ref = [0] * self.num_snapshots
        self._key: list[bytes | None] = [None] * self.num_snapshots
        self._table: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free = list(range(self.num_snapshots - 1, -1, -1))

    @property
    def num_held(self) -> int:
        return self.num_snapshots - len(self._free) - len(self._lru)

    def lookup(self, key: bytes) -> int | None:
        return self._table.get(key)

    def allocate(self) -> int | None:
        """A snapshot to save into, held once; None when every one is held."""
        if self._free:
            snap = self._free.pop()
        elif self._lru:
            snap, _ = self._lru.popitem(last=False)
            del self._table[self._key[snap]]
            self._key[snap] = None
            self.num_evicted += 1
        else:
            return None
        self._ref[snap] = 1
        return snap

    def hold(self, snap: int) -> None:
        if self._ref[snap] == 0:
            if snap not in self._lru:
                raise ValueError(f"snapshot {snap} is free: nothing to hold")
            del self._lru[snap]
        self._ref[snap] += 1

    def register(self, snap: int, key: bytes) -> bool:
        """The step that saved ``snap`` completed: later sequences may restore it. False (and it
        stays anonymous) when another snapshot already has ``key``."""
        if self._ref[snap] == 0:
            raise ValueError(f"snapshot {snap} registered but not held")
        if self._key[snap] is not None:
            return self._key[snap] == key
        if key in self._table:
            return False
        self._key[snap], self._table[key] = key, snap
        return True

    def release(self, snap: int) -> None:
        if self._ref[snap] <= 0:
            raise ValueError(f"snapshot {snap} released but not held")
        self._ref[snap] -= 1
        if self._ref[snap]:
            return
        if self._key[snap] is not None:
            self._lru[snap] = None
        else:
            self._free.append(snap)
