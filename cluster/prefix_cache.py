"""The prefix cache: where each attention replica's cache lives, and what of it a later request may
share (docs/architecture.md "Prefix caching").

Owns: per attention replica the block pool (allocation, reference counts, chained content hashes,
the LRU of cached blocks: :class:`~cluster.block_pool.BlockPool`), the KDA-slot allocator and the
KDA snapshot pool (hybrid models); the snapshot grid, branch points and refresh jobs; every
sequence's :class:`CacheHold` — the only code that writes one (a static test holds it to that);
the prompt tokens looked up and found, per replica.

A new sequence takes the longest cached prefix on its replica (:meth:`PrefixCache.hit`,
:meth:`PrefixCache.admit`) and computes the rest; a finished sequence's blocks stay cached. Blocks
(and KDA snapshots) are registered only in :meth:`PrefixCache.completed`, once the step that wrote
them came back. On hybrid models a hit needs a KDA state snapshot at its boundary: prefill chunks
are cut on the snapshot grid (:meth:`PrefixCache.cut`), a snapshot is saved at the last grid
boundary of every prompt and at its branch point, and a finished sequence's answer is prefilled
once more from its newest snapshot (a *refresh* job, no sampling: :meth:`PrefixCache.refresh`) so
that its final boundary has a snapshot a from-scratch prefill chunked on the grid would reach.

Never: decides which sequences run, how many tokens a step takes or which replica a new sequence
goes to (the scheduler does, asking :meth:`PrefixCache.hit`); assigns a sequence's own fields (it
hands the scheduler blocks, slots and refresh jobs to place); touches tensors or talks to actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence

from actors.messages import SeqChunk

from model.cache import CacheFull

from .block_pool import BlockPool, SnapshotPool
from .config import CacheConfig, SnapshotPlan
from .seq import CacheHold, Seq



@dataclass(frozen=True)
class Hit:
    """What a sequence would find cached on one replica; finding it changes nothing."""

    blocks: tuple[int, ...] = ()
    tokens: int = 0  # the prompt tokens those blocks (and the snapshot) cover
    snapshot: int | None = None  # hybrid: the KDA snapshot at ``tokens``
    branch_point: int = 0  # hybrid: the deepest grid boundary of the cached blocks beyond it (0: none)


NO_HIT = Hit()


@dataclass
class TierOut:
    """What one replica registered and has not yet written through to the KV tier (cluster/kv_tier.py): each
    ("block" | "snapshot", id, prefix hash), held so that nothing reuses it before the step that carries it (its
    actor copies them out as that step begins) has come back."""

    replica: int
    generation: int  # the replica's pool generation (a later one: it died since, and the holds with it)
    items: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    snaps: list = field(default_factory=list)


@dataclass(frozen=True)
class Moved:
    """Blocks held on one replica while they cross engines: read out (:meth:`PrefixCache.pin`) or
    written in (:meth:`PrefixCache.adopt`)."""

    replica: int
    hashes: tuple[bytes, ...]
    blocks: tuple[int, ...]
    snapshot: int | None = None  # hybrid models: the KDA snapshot at their end
    fresh: int = 0  # adopt: blocks[fresh:] are new (to write); blocks[:fresh] were cached here already
    new_snapshot: bool = False  # adopt: the snapshot is new (to write)
    generation: int = 0  # the replica's pool generation when they were held (a later one: it died since)


class PrefixCache:
    def __init__(self, cache: CacheConfig, *, hybrid: bool, snapshots: SnapshotPlan, step_budget: int):
        """``cache``: blocks, block size, KDA slots per replica (``hybrid`` models only), whether
        cached blocks are shared. ``snapshots`` (hybrid models): the token grid KDA snapshots sit on
        (a multiple of the block size) and how many per replica. ``step_budget``: the scheduler's
        tokens per step (a prefill that cannot reach the grid within what is left of a step waits
        for the next one)."""
        grid, block_size = snapshots.grid, cache.block_size
        if grid is not None and (grid < block_size or grid % block_size):
            raise ValueError(f"the snapshot grid ({grid}) must be a multiple of block_size ({block_size})")
        self.num_blocks, self.block_size = cache.num_blocks, block_size
        self.num_slots = cache.num_slots if hybrid else None
        self.caching, self.step_budget = cache.prefix_caching, step_budget
        self.grid = grid if hybrid else None  # hybrid models only
        self.num_snapshots = snapshots.count if self.caching and self.grid else 0
        self.blocks: list[BlockPool] = []
        self.slots: list[BlockPool] | None = [] if self.num_slots else None
        self.snaps: list[SnapshotPool] | None = [] if self.num_snapshots else None
        self.jobs: dict[int, Seq] = {}  # refresh jobs, by their (negative) ids
        # per replica index, over the engine's life: prompt tokens looked up, and found cached
        self.queries: dict[int, int] = {}
        self.hits: dict[int, int] = {}
        # the KV tier: every block and snapshot registered is written through (taken by the engine's next step)
        self.tiered = self.caching and bool(cache.kv_offloading_size)
        self._tier_out: dict[int, TierOut] = {}

    # ---- replicas --------------------------------------------------------------------------
    def resize(self, num_replicas: int) -> None:
        """Pools for ``num_replicas`` replicas: a new one starts empty; a removed one's cache goes with
        it (the scheduler moved its sequences away first)."""
        while len(self.blocks) < num_replicas:
            self.blocks.append(BlockPool(self.num_blocks, self.block_size))
            if self.slots is not None:
                self.slots.append(BlockPool(self.num_slots, 1))
            if self.snaps is not None:
                self.snaps.append(SnapshotPool(self.num_snapshots))
        del self.blocks[num_replicas:]
        if self.slots is not None:
            del self.slots[num_replicas:]
        if self.snaps is not None:
            del self.snaps[num_replicas:]

    def forget(self, replicas) -> None:
        """These replicas died with their cache: their pools start empty (their sequences were
        requeued first)."""
        for r in replicas:
            if r < len(self.blocks):
                self.blocks[r].clear()
                if self.snaps is not None:
                    self.snaps[r].clear()

    # ---- room ------------------------------------------------------------------------------
    def max_tokens(self) -> int:
        """The most tokens one sequence's blocks can hold on a replica."""
        return self.num_blocks * self.block_size

    def blocks_to_grow(self, seq: Seq, n: int) -> int:
        """Blocks ``seq`` needs on its replica for ``n`` more tokens."""
        return self.blocks[seq.replica].blocks_needed(seq.num_cached + n, len(seq.block_table))

    def can_allocate(self, replica: int, num_blocks: int) -> bool:
        return self.blocks[replica].can_allocate(num_blocks)

    def fits(self, replica: int, seq: Seq | None, n: int) -> bool:
        """Room on ``replica`` for ``n`` more tokens of ``seq`` (a new sequence when it is not there)."""
        here = seq is not None and seq.replica == replica
        need = self.blocks[replica].blocks_needed((seq.num_cached if here else 0) + n,
                                                  len(seq.block_table) if here else 0)
        return self.blocks[replica].can_allocate(need)

    def allocate(self, seq: Seq, n: int) -> list[int]:
        """New blocks for ``n`` more tokens of ``seq`` on its replica (the scheduler appends them)."""
        return self.blocks[seq.replica].allocate(self.blocks_to_grow(seq, n))

    def has_free_slot(self, replica: int) -> bool:
        return self.slots is None or self.slots[replica].num_free > 0

    def room_for(self, seq: Seq, replica: int, hit: Hit, n: int) -> bool:
        """Room on ``replica`` for ``seq``'s first chunk of ``n`` tokens after ``hit`` (taking
        cached blocks takes room too)."""
        pool = self.blocks[replica]
        need = pool.blocks_needed(hit.tokens + n, len(hit.blocks))
        return need <= pool.num_available - pool.num_cached_of(hit.blocks)

    # ---- hits and admission -----------------------------------------------------------------
    def hit(self, seq: Seq, replica: int) -> Hit:
        """What ``seq`` would find cached on ``replica``. On hybrid models the hit ends at the
        deepest grid boundary with a snapshot too, and its ``branch_point`` is the deepest grid
        boundary of the cached blocks beyond it: saving a snapshot there lets the next request
        sharing that prefix (a system prompt) hit it."""
        if not self.caching:
            return NO_HIT
        n = (len(seq.token_ids) - 1) // self.block_size
        blocks = self.blocks[replica].lookup(self._hashes(seq, n)[:n])
        if self.grid is None:
            return Hit(tuple(blocks), len(blocks) * self.block_size)
        if self.snaps is None:
            return NO_HIT
        per = self.grid // self.block_size
        top = len(blocks) - len(blocks) % per
        branch = top * self.block_size
        for k in range(top, 0, -per):
            snap = self.snaps[replica].lookup(seq.cache.hashes[k - 1])
            if snap is not None:
                return Hit(tuple(blocks[:k]), k * self.block_size, snap,
                           branch if branch > k * self.block_size else 0)
        return Hit(branch_point=branch)

    def admit(self, seq: Seq, replica: int, hit: Hit) -> int | None:
        """``seq`` moves in on ``replica`` with ``hit``: its cached blocks (and snapshot) are held,
        the lookup counted. Returns its KDA slot (hybrid models), else None."""
        self.blocks[replica].take(hit.blocks, len(seq.token_ids))
        if self.caching:
            self.queries[replica] = self.queries.get(replica, 0) + len(seq.token_ids)
            self.hits[replica] = self.hits.get(replica, 0) + hit.tokens
        hold = seq.cache
        hold.on_grid, hold.num_registered_blocks, hold.branch_point = True, len(hit.blocks), hit.branch_point
        if hit.snapshot is not None:
            self.snaps[replica].hold(hit.snapshot)
            hold.snapshot, hold.snapshot_at = hit.snapshot, hit.tokens
        return self.slots[replica].allocate(1)[0] if self.slots is not None else None

    def refresh_pending(self, seq: Seq, hit: Hit) -> bool:
        """A refresh job in progress will give ``seq`` a deeper hit than ``hit`` within a step or
        two (the next turn of its conversation arrived first): it should wait for it."""
        bs = self.block_size
        for job in self.jobs.values():
            end = len(job.token_ids)
            mine, theirs = seq.cache.hashes[end // bs - 1: end // bs], job.cache.hashes[end // bs - 1: end // bs]
            if hit.tokens < end < len(seq.token_ids) and mine == theirs:
                return True
        return False

    def release(self, seq: Seq, *, replica_alive: bool) -> None:
        """``seq`` leaves its replica: its blocks (cached where registered), KDA slot and snapshots go
        back to the pools (unless the replica is gone), and its hold is cleared."""
        r, hold = seq.replica, seq.cache
        if replica_alive:
            self.blocks[r].free(seq.block_table)
            if self.slots is not None and seq.state_slot is not None:
                self.slots[r].free([seq.state_slot])
            if self.snaps is not None:
                for snap in (hold.snapshot, hold.pending_snapshot[0] if hold.pending_snapshot else None):
                    if snap is not None:
                        self.snaps[r].release(snap)
        hold.snapshot, hold.snapshot_at, hold.pending_snapshot = None, 0, None
        hold.num_registered_blocks, hold.branch_point = 0, 0

    def free_tail(self, seq: Seq, keep: int) -> None:
        """Give back ``seq``'s blocks after its first ``keep`` (the positions of rejected draft
        tokens: never registered, as registration stops at a step's verified tokens)."""
        tail = seq.block_table[keep:]
        assert keep >= seq.cache.num_registered_blocks, "a registered block is never given back by a sequence"
        self.blocks[seq.replica].free(tail)

    # ---- the snapshot grid ------------------------------------------------------------------
    def cut(self, seq: Seq, start: int, n: int) -> int:
        """How many of the ``n`` prefill tokens from ``start`` to compute now. On hybrid models with
        prefix caching: ending at the snapshot target when the chunk would cross it, and otherwise
        on the snapshot grid unless it ends the prefill (so each snapshot is what a from-scratch
        prefill chunked the same way reaches, bit for bit); 0 when the rest of the step's budget
        cannot reach the grid (the next step's will)."""
        if self.snaps is None or n == 0:
            return n
        end, target = start + n, self._target(seq)
        if start < target < end:
            return target - start
        if start >= target and not seq.is_refresh:
            return n  # past its last snapshot boundary: how the rest is chunked changes no snapshot
        if end < len(seq.token_ids) and end != target:
            aligned = end - end % self.grid
            if aligned > start:
                return aligned - start
            if self.step_budget >= self.grid:
                return 0
            seq.cache.on_grid = False  # a budget under the grid: no snapshot from this sequence is exact
        return n

    def plan_snapshot(self, seq: Seq, start: int) -> int | None:
        """The snapshot a chunk of ``seq`` from ``start`` to its ``num_cached`` saves into, if it ends
        at one of the sequence's snapshot boundaries (held until :meth:`completed` registers it)."""
        end, hold = seq.num_cached, seq.cache
        if self.snaps is None:
            return None
        targets = (hold.branch_point, self._last_target(seq))
        if (not hold.on_grid or end - start < 1 or end not in targets or end == 0 or end <= hold.snapshot_at
                or hold.pending_snapshot is not None):
            return None
        pool = self.snaps[seq.replica]
        if pool.lookup(self._snapshot_key(seq, end)) is not None:
            return None  # another sequence's snapshot already covers it
        snap = pool.allocate()
        if snap is not None:
            hold.pending_snapshot = (snap, end)
        return snap

    def _target(self, seq: Seq) -> int:
        """The next grid boundary whose KDA snapshot a sequence saves: its branch point while its
        prefill is before it, then its last snapshot boundary."""
        if not seq.is_refresh and seq.num_cached < seq.cache.branch_point:
            return seq.cache.branch_point
        return self._last_target(seq)

    def _last_target(self, seq: Seq) -> int:
        """A sequence's last snapshot boundary: a refresh's end, else the last grid boundary before its
        last known token (a prompt's: the deepest any longer request can hit)."""
        return len(seq.token_ids) if seq.is_refresh else (len(seq.token_ids) - 1) // self.grid * self.grid

    # ---- after a step -----------------------------------------------------------------------
    def completed(self, seq: Seq, replica: int, chunk: SeqChunk, ahead: Sequence[int] = ()) -> bool:
        """The step that computed ``chunk`` of ``seq`` (still on ``replica``) came back whole: what it
        wrote may be shared. Registers its full blocks up to the chunk's end (on hybrid models: up to
        its newest snapshot, the deepest a hit can use there) and the snapshot it saved. True when
        ``seq`` is a refresh job that is done."""
        if not self.caching:
            return False
        hold, end = seq.cache, chunk.num_cached + len(chunk.token_ids)
        saving = hold.pending_snapshot
        if saving is not None and chunk.snapshot == saving[0] and saving[1] == end:
            hold.pending_snapshot = None
            key = self._snapshot_key(seq, end)
            if self.snaps[replica].register(saving[0], key):
                self._keep_snapshot(seq, saving[0], end)
                self._write_through(replica, "snapshot", saving[0], key)
            else:
                self.snaps[replica].release(saving[0])
        n = (min(end, hold.snapshot_at) if self.grid else end) // self.block_size
        if n > hold.num_registered_blocks:  # only the blocks this step filled: O(new blocks) per step
            hashes = self._hashes(seq, n, ahead)
            self.blocks[replica].register_hashes(seq.block_table[hold.num_registered_blocks:n],
                                                 hashes[hold.num_registered_blocks:n])
            for b, h in zip(seq.block_table[hold.num_registered_blocks:n], hashes[hold.num_registered_blocks:n]):
                self._write_through(replica, "block", b, h)
            hold.num_registered_blocks = n
        return seq.is_refresh and end == len(seq.token_ids)

    def _write_through(self, replica: int, kind: str, i: int, h: bytes) -> None:
        if not self.tiered:
            return
        gen = self.blocks[replica].generation
        out = self._tier_out.get(replica)
        if out is None or out.generation != gen:
            out = self._tier_out[replica] = TierOut(replica, gen)
        if kind == "block":
            self.blocks[replica].pin([i])
            out.blocks.append(i)
        else:
            self.snaps[replica].hold(i)
            out.snaps.append(i)
        out.items.append((kind, i, h))

    def tier_pending(self) -> bool:
        """Some replica registered blocks not yet sent to be written through (each held until then); those of a
        replica that died or went since are dropped (their holds went with its pools)."""
        for r in [r for r, out in self._tier_out.items()
                  if r >= len(self.blocks) or out.generation != self.blocks[r].generation]:
            del self._tier_out[r]
        return bool(self._tier_out)

    def take_tier_writes(self, replica: int) -> TierOut | None:
        """What ``replica`` has to write through, for the step being sent to it (held until :meth:`tier_done`)."""
        out = self._tier_out.pop(replica, None)
        if out is not None and (replica >= len(self.blocks) or out.generation != self.blocks[replica].generation):
            return None  # the replica died since: its holds went with its pools
        return out

    def tier_done(self, out: TierOut) -> None:
        """The step that carried ``out`` came back (or failed): let go of its holds."""
        r = out.replica
        if r >= len(self.blocks) or self.blocks[r].generation != out.generation:
            return
        self.blocks[r].free(out.blocks)
        for snap in out.snaps:
            self.snaps[r].release(snap)

    def failed(self, job: Seq) -> int:
        """A refresh job's step failed (its KDA state is half-advanced): it starts again from its
        snapshot, whose boundary this returns; the snapshot it was saving is dropped."""
        hold = job.cache
        if hold.pending_snapshot is not None:
            self.snaps[job.replica].release(hold.pending_snapshot[0])
            hold.pending_snapshot = None
        return hold.snapshot_at

    def _keep_snapshot(self, seq: Seq, snap: int, at: int) -> None:
        """``seq`` keeps ``snap`` (held) as its newest snapshot, releasing the one before."""
        hold = seq.cache
        if hold.snapshot is not None:
            self.snaps[seq.replica].release(hold.snapshot)
        hold.snapshot, hold.snapshot_at = snap, at

    # ---- refresh jobs ------------------------------------------------------------------------
    def refresh(self, seq: Seq) -> tuple[int, CacheHold] | None:
        """For a hybrid sequence that finished: (end, hold) of a job that prefills its answer again
        from its newest snapshot to ``end``, the last grid boundary before its last token, so the
        next turn of its conversation can hit there with an exact state; None when there is nothing
        to gain. The job takes over the sequence's snapshot (the scheduler hands it the blocks up to
        ``end`` and the KDA slot, and :meth:`track` s it)."""
        hold = seq.cache
        if self.snaps is None or seq.replica is None or not hold.on_grid:
            return None
        end = (len(seq.token_ids) - 1) // self.grid * self.grid
        if end <= hold.snapshot_at or self.snaps[seq.replica].lookup(self._snapshot_key(seq, end)) is not None:
            return None
        job = CacheHold(hashes=hold.hashes, snapshot=hold.snapshot, snapshot_at=hold.snapshot_at,
                        num_registered_blocks=hold.snapshot_at // self.block_size)
        hold.snapshot, hold.snapshot_at = None, 0
        return end, job

    def track(self, job: Seq) -> None:
        self.jobs[job.seq_id] = job

    def untrack(self, job: Seq) -> None:
        self.jobs.pop(job.seq_id, None)

    # ---- keys ------------------------------------------------------------------------------
    def _hashes(self, seq: Seq, num_blocks: int, ahead: Sequence[int] = ()) -> list[bytes]:
        """``seq``'s chained block hashes, over its tokens and ``ahead`` (tokens about to be appended:
        a step's accepted drafts)."""
        tokens = seq.token_ids + list(ahead) if ahead else seq.token_ids
        return self.blocks[0].chain(seq.cache.hashes, tokens, seq.cache_salt, num_blocks)

    def _snapshot_key(self, seq: Seq, boundary: int) -> bytes:
        """A snapshot's key: the chained hash of the block ending at its boundary."""
        n = boundary // self.block_size
        return self._hashes(seq, n)[n - 1]

    def snapshot_key(self, token_ids: list[int], salt: str | None, boundary: int) -> bytes:
        """The key a snapshot of ``token_ids``' first ``boundary`` tokens under ``salt`` has."""
        n = boundary // self.block_size
        return self.blocks[0].chain([], token_ids, salt, n)[n - 1]

    # ---- blocks that cross engines (prefill/decode disaggregation: cluster/pd.py) ----------------
    def deepest(self, num_tokens: int) -> int:
        """The most prompt tokens a hit can cover for a prompt of ``num_tokens``: its full blocks before the
        last token (on hybrid models: to the last snapshot-grid boundary before it); 0 without caching."""
        if not self.caching:
            return 0
        step = self.grid or self.block_size
        return (num_tokens - 1) // step * step

    def probe(self, token_ids: list[int], salt: str | None) -> list[Hit]:
        """What a prompt of ``token_ids`` under ``salt`` would find cached on each replica (changes nothing)."""
        seq = Seq(-1, list(token_ids), len(token_ids), None, cache_salt=salt)
        return [self.hit(seq, r) for r in range(len(self.blocks))]

    def chain_of(self, token_ids: list[int], salt: str | None, num_tokens: int) -> list[bytes]:
        """The chained hashes of the first ``num_tokens`` tokens' blocks (a multiple of the block size)."""
        return self.blocks[0].chain([], token_ids, salt, num_tokens // self.block_size)

    def pin(self, replica: int, hashes: list[bytes]) -> Moved | None:
        """Hold the blocks registered under ``hashes`` on ``replica`` (and on hybrid models the snapshot at
        their end) while another engine copies them; None unless every one of them is cached there."""
        blocks = self.blocks[replica].lookup(hashes)
        if len(blocks) < len(hashes) or not hashes:
            return None
        snap = None
        if self.grid is not None:
            snap = self.snaps[replica].lookup(hashes[-1]) if self.snaps is not None else None
            if snap is None:
                return None
            self.snaps[replica].hold(snap)
        self.blocks[replica].pin(blocks)
        return Moved(replica, tuple(hashes), tuple(blocks), snap, generation=self.blocks[replica].generation)

    def adopt(self, replica: int, hashes: list[bytes]) -> Moved | None:
        """Room on ``replica`` for blocks arriving under ``hashes``: those already cached there are held, the
        rest allocated (held, no content yet), and on hybrid models a snapshot for their end. Write the
        arrivals into ``Moved.blocks[Moved.fresh:]`` (and ``Moved.snapshot`` when ``Moved.new_snapshot``),
        then :meth:`commit`; or :meth:`unpin` to give it all back unwritten. None when there is no room."""
        pool = self.blocks[replica]
        have = pool.lookup(hashes)
        pool.pin(have)
        try:
            fresh = pool.allocate(len(hashes) - len(have))
        except CacheFull:
            pool.free(have)
            return None
        snap, new = None, False
        if self.grid is not None:  # hybrid: the KDA state at their end comes too
            snaps = self.snaps[replica] if self.snaps is not None else None
            snap = snaps.lookup(hashes[-1]) if snaps is not None else None
            if snap is not None:
                snaps.hold(snap)
            else:
                snap, new = (snaps.allocate() if snaps is not None else None), True
                if snap is None:
                    pool.free(have + fresh)
                    return None
        return Moved(replica, tuple(hashes), tuple(have + fresh), snap, len(have), new, pool.generation)

    def commit(self, moved: Moved) -> None:
        """The arrivals of :meth:`adopt` are written: register them, so that a prefix hit finds them (they
        stay held until :meth:`unpin`, then cached)."""
        r = moved.replica
        self.blocks[r].register_hashes(list(moved.blocks), list(moved.hashes))
        if moved.new_snapshot:  # (False when another snapshot has the key: this one goes back free on unpin)
            self.snaps[r].register(moved.snapshot, moved.hashes[-1])

    def trim(self, moved: Moved, n: int) -> Moved:
        """The first ``n`` blocks of what :meth:`adopt` held (MLA models: no snapshot at the end); the rest are
        let go unwritten (free again)."""
        if moved.snapshot is not None:
            raise ValueError("an adoption with a KDA snapshot at its end is kept whole or given back")
        if moved.replica < len(self.blocks) and self.blocks[moved.replica].generation == moved.generation:
            self.blocks[moved.replica].free(list(moved.blocks[n:]))
        return Moved(moved.replica, moved.hashes[:n], moved.blocks[:n], None, min(moved.fresh, n), False,
                     moved.generation)

    def unpin(self, moved: Moved) -> None:
        """Let go of what :meth:`pin` or :meth:`adopt` held (unregistered arrivals become free) — nothing
        when the replica died since (its pools were emptied: :meth:`forget`; or removed)."""
        if moved.replica >= len(self.blocks) or self.blocks[moved.replica].generation != moved.generation:
            return
        self.blocks[moved.replica].free(list(moved.blocks))
        if moved.snapshot is not None:
            self.snaps[moved.replica].release(moved.snapshot)

    # ---- status ----------------------------------------------------------------------------
    def status(self, replica: int) -> dict:
        """One replica's blocks (held, cached, free), KDA snapshots (held, cached) and, over the
        engine's life, the prompt tokens looked up and found cached there."""
        pool = self.blocks[replica]
        snaps = self.snaps[replica] if self.snaps is not None else None
        return {"blocks_held": pool.num_held, "blocks_cached": pool.num_cached, "blocks_free": pool.num_free,
                "snapshots_held": snaps.num_held if snaps else 0,
                "snapshots_cached": snaps.num_cached if snaps else 0,
                "snapshots": snaps.num_snapshots if snaps else 0,
                "queries_tokens": self.queries.get(replica, 0), "hit_tokens": self.hits.get(replica, 0)}
