"""The scheduler: which sequences run each step, how many of their tokens, and where their cache
lives (continuous batching, docs/architecture.md "The engine").

Owns: every live :class:`Seq` — the only code that assigns a sequence's fields (a static test
holds it to that) — the waiting queue and running set, each attention replica's block and
KDA-slot allocators, its block pool and KDA snapshot pool (prefix caching), and each sequence's
block table. Every step mixes decodes and (chunked) prefills under a token budget; a decode that
finds its replica's cache full preempts the replica's newest sequence, whose blocks are freed and
which is recomputed later from its prompt plus the tokens it has already produced.

Prefix caching (docs/architecture.md "Prefix caching"): a new sequence goes to the replica where
the longest prefix of it is cached, weighed against load (:meth:`Scheduler._place`), takes those
blocks and computes the rest; a finished sequence's blocks stay cached. Blocks (and KDA
snapshots) are registered only in :meth:`Scheduler.completed`, once the step that wrote them
came back. On hybrid models a hit needs a KDA state snapshot at its boundary: prefill chunks are
cut on the snapshot grid, a snapshot is saved at the last grid boundary of every prompt, and a
finished sequence's answer is prefilled once more from its last snapshot (a *refresh* job, no
sampling) so that its final boundary has a snapshot equal to a from-scratch prefill's.

A step's sampled tokens come back through :meth:`Scheduler.apply` (append, stop checks); a failed
step is undone through :meth:`Scheduler.rewind`.
Never: touches tensors or talks to actors — the engine turns a :class:`Plan` into messages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from actors.messages import SampledToken, SeqChunk
from .config import snapshot_plan
from model.block_pool import BlockPool, SnapshotPool
from model.logits import stateful
from model.runner import Sequence, banned_ids, check_stop


@dataclass(eq=False)
class Seq(Sequence):
    """A sequence as the scheduler sees it: the runner's sequence plus where it lives."""

    replica: int | None = None  # the attention replica it is pinned to while it has cache
    num_preemptions: int = 0
    cache_salt: str | None = None  # its blocks are shared only with sequences of the same salt
    num_hit: int | None = None  # prompt tokens found cached at its first admission (usage's cached_tokens)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks (a memo)
    job: bool = False  # a refresh of a finished sequence (no request, never samples)
    fresh: bool = False  # its next chunk is its first on its replica: zero or restore the KDA state
    snap: int | None = None  # the KDA snapshot it holds: its state after its first snap_at tokens
    snap_at: int = 0
    saving: tuple[int, int] | None = None  # (snapshot, boundary) a step in flight saves into
    aligned: bool = True  # every chunk so far ended on the snapshot grid (its snapshots are exact)
    registered: int = 0  # its first blocks whose content is registered (each is registered once)
    branch: int = 0  # hybrid: a grid boundary where its prompt leaves a cached prefix with no snapshot yet


@dataclass
class Plan:
    """One step: the chunks per replica, and the sequences preempted while planning it."""

    chunks: list[list[SeqChunk]]
    preempted: list[Seq] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not any(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for r in self.chunks for c in r)


class Scheduler:
    def __init__(self, *, num_replicas: int, num_blocks: int, block_size: int, num_slots: int | None,
                 max_num_seqs: int, max_tokens_per_step: int, stop_ids: frozenset[int] = frozenset(),
                 max_context: int = 1 << 62, prefix_caching: bool = False, snapshot_grid: int | None = None,
                 num_snapshots: int = 0, load_weight: float = 256.0):
        """``prefix_caching``: share cached blocks between sequences. ``snapshot_grid`` (hybrid
        models): the token grid KDA snapshots sit on (a multiple of ``block_size``), with
        ``num_snapshots`` of them per replica. ``load_weight``: cached tokens one more running
        sequence on a replica is worth in placement (see :meth:`_place`)."""
        if max_tokens_per_step < 1 or max_num_seqs < 1:
            raise ValueError("max_tokens_per_step and max_num_seqs must be >= 1")
        if snapshot_grid is not None and (snapshot_grid < block_size or snapshot_grid % block_size):
            raise ValueError(f"the snapshot grid ({snapshot_grid}) must be a multiple of block_size ({block_size})")
        self.caching, self.load_weight = prefix_caching, load_weight
        self.grid = snapshot_grid if num_slots else None  # hybrid models only
        self.num_snapshots = num_snapshots if prefix_caching and self.grid else 0
        self.snaps: list[SnapshotPool] | None = [] if self.num_snapshots else None
        self.jobs: dict[int, Seq] = {}  # refresh jobs, by their (negative) ids
        # per replica index, over the engine's life: prompt tokens looked up, found cached, admissions
        self.prefix_queries: dict[int, int] = {}
        self.prefix_hits: dict[int, int] = {}
        self.admitted: dict[int, int] = {}
        self.stop_ids, self.max_context = frozenset(stop_ids), max_context  # the model's stop tokens and context
        self.seqs: dict[int, Seq] = {}  # every sequence added and not finished, by id
        self.block_size, self.max_num_seqs, self.budget = block_size, max_num_seqs, max_tokens_per_step
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.blocks: list[BlockPool] = []
        self.slots: list[BlockAllocator] | None = [] if num_slots else None
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.released: list[list[int]] = []  # per replica: sequences that left it since its last step
        self._loads: list[int] = []  # per replica: sequences holding a place there
        self.resize(num_replicas)

    @classmethod
    def for_engine(cls, config, model_cfg, num_replicas: int, stop_ids=frozenset()) -> "Scheduler":
        """The scheduler an engine with ``config`` (an :class:`~cluster.config.EngineConfig`) runs
        for ``model_cfg`` (the engine's, and the simulator's: the same decisions)."""
        grid, num_snapshots, _ = snapshot_plan(config, model_cfg)
        return cls(num_replicas=num_replicas, num_blocks=config.num_blocks, block_size=config.block_size,
                   num_slots=config.num_slots if model_cfg.kda_layers else None, max_num_seqs=config.max_num_seqs,
                   max_tokens_per_step=config.max_tokens_per_step,
                   stop_ids=frozenset(stop_ids) | frozenset(model_cfg.eos_token_ids),
                   max_context=model_cfg.max_position_embeddings, prefix_caching=config.prefix_caching,
                   load_weight=config.prefix_load_weight, snapshot_grid=grid, num_snapshots=num_snapshots)

    # ---- replicas (an epoch change, at a step boundary) ------------------------------------
    def resize(self, num_replicas: int) -> list[Seq]:
        """Grow to, or shrink to, ``num_replicas`` attention replicas. A new replica starts empty
        and takes new sequences at once (least loaded first); the running sequences of a removed
        one go back to the front of the queue, in order, to be re-prefilled from their prompt plus
        the tokens already generated on the replicas that remain. Returns those sequences."""
        if num_replicas < 1:
            raise ValueError(f"attention replicas must be >= 1, got {num_replicas}")
        while len(self.blocks) < num_replicas:
            self.blocks.append(BlockPool(self.num_blocks, self.block_size))
            self.released.append([])
            self._loads.append(0)
            if self.slots is not None:
                self.slots.append(BlockPool(self.num_slots, 1))
            if self.snaps is not None:
                self.snaps.append(SnapshotPool(self.num_snapshots))
        moved = [s for s in self.running if not s.job and s.replica is not None and s.replica >= num_replicas]
        for job in [j for j in self.running if j.job and j.replica >= num_replicas]:
            self._end_job(job)
        for seq in reversed(moved):
            self.running.remove(seq)
            self._free(seq)
            self.waiting.appendleft(seq)
        del self.blocks[num_replicas:]  # a removed replica's cache goes with it
        del self.released[num_replicas:]
        del self._loads[num_replicas:]
        if self.slots is not None:
            del self.slots[num_replicas:]
        if self.snaps is not None:
            del self.snaps[num_replicas:]
        return moved

    # ---- queue --------------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        need = self.blocks[0].blocks_needed(len(seq.token_ids) + 1, 0)
        if need > self.blocks[0].num_blocks:
            raise ValueError(f"sequence {seq.seq_id} needs {need} cache blocks; a replica has {self.blocks[0].num_blocks}")
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def requeue(self, seqs: list[Seq]) -> None:
        """Back to the front of the queue, in order, for a full re-prefill from prompt plus generated
        tokens (their replica died, or a failed step left their KDA state half-advanced)."""
        for seq in reversed(seqs):
            if seq in self.running:
                self.running.remove(seq)
                self._free(seq)
                self.waiting.appendleft(seq)

    def apply(self, sampled: list[SampledToken]) -> list[tuple[Seq, SampledToken, str | None]]:
        """A finished step's sampled tokens: each is appended to its sequence and the stop checks run
        (a stopped sequence is finished and its cache freed). Tokens of sequences finished or
        aborted meanwhile are dropped. Returns (sequence, token, finish reason or None) per token."""
        out = []
        for tok in sampled:
            seq = self.seqs.get(tok.seq_id)
            if seq is None:
                continue
            seq.token_ids.append(tok.token_id)
            reason = check_stop(seq, self.stop_ids, self.max_context)
            if reason:
                self.finish(seq, reason)
            out.append((seq, tok, reason))
        return out

    def completed(self, plan: Plan) -> None:
        """A step came back whole: what its chunks wrote may now be shared. Registers each running
        sequence's full blocks up to its chunk's end (on hybrid models: up to its newest snapshot,
        the deepest a hit can use there) and the snapshots the step saved; ends the refresh jobs
        it finished. Call before :meth:`apply`, so that a sequence finishing there leaves its blocks
        cached."""
        if not self.caching:
            return
        bs = self.block_size
        for r, chunks in enumerate(plan.chunks):
            for c in chunks:
                seq = self.jobs.get(c.seq_id) if c.seq_id < 0 else self.seqs.get(c.seq_id)
                if seq is None or seq.replica != r:
                    continue  # finished or moved meanwhile
                end = c.num_cached + len(c.token_ids)
                if seq.saving is not None and c.snapshot == seq.saving[0] and seq.saving[1] == end:
                    snap, seq.saving = seq.saving[0], None
                    if self.snaps[r].register(snap, self._snapshot_key(seq, end)):
                        self._hold_snapshot(seq, snap, end)
                    else:
                        self.snaps[r].release(snap)
                n = (min(end, seq.snap_at) if self.grid else end) // bs
                if n > seq.registered:  # only the blocks this step filled: O(new blocks) per step
                    hashes = self._hashes(seq, n)
                    self.blocks[r].register_hashes(seq.block_table[seq.registered:n], hashes[seq.registered:n])
                    seq.registered = n
                if seq.job and end == len(seq.token_ids):
                    self._end_job(seq)

    def rewind(self, failed: list[list[SeqChunk]], dead_replicas: set[int], *, recompute_state: bool) -> None:
        """Make the state what it was before failed steps (their chunks, newest step first).
        Latent-cache writes are idempotent (a retry rewrites the same positions with the same
        values), so the steps' tokens are just computed again; a KDA state update is not (layers
        before the failure already advanced it), so with ``recompute_state`` the steps' sequences
        are re-prefilled from zero (or from their cached prefix), as are all sequences of a dead
        attention replica, whose cache is gone: its pools are emptied. A refresh job restarts from
        its snapshot, or is dropped with its replica."""
        redo = [s for s in self.running if not s.job and s.replica in dead_replicas]
        for job in [j for j in self.running if j.job and j.replica in dead_replicas]:
            self._end_job(job)
        for chunks in failed:
            for c in chunks:
                if c.seq_id < 0:
                    job = self.jobs.get(c.seq_id)
                    if job is not None:
                        self._restart_job(job)
                    continue
                seq = self.seqs.get(c.seq_id)
                if seq is None or seq not in self.running or seq in redo:
                    continue
                if recompute_state:
                    redo.append(seq)
                else:
                    seq.num_cached -= len(c.token_ids)
        self.requeue(sorted(redo, key=self.running.index))
        for r in dead_replicas:
            if r < len(self.blocks):
                self.blocks[r].clear()
                if self.snaps is not None:
                    self.snaps[r].clear()

    def finish(self, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
            job = self._refresh_job(seq) if reason != "abort" else None
            self._free(seq)
            if job is not None:
                self.running.append(job)
                self.jobs[job.seq_id] = job
                self._loads[job.replica] += 1
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def cache_status(self) -> list[dict]:
        """Per replica: its blocks (held, cached, free), KDA snapshots (held, cached) and, over the
        engine's life, prompt tokens looked up and found cached, and sequences placed there."""
        out = []
        for r, pool in enumerate(self.blocks):
            snaps = self.snaps[r] if self.snaps is not None else None
            out.append({"blocks_held": pool.num_held, "blocks_cached": pool.num_cached, "blocks_free": pool.num_free,
                        "snapshots_held": snaps.num_held if snaps else 0,
                        "snapshots_cached": snaps.num_cached if snaps else 0,
                        "snapshots": snaps.num_snapshots if snaps else 0,
                        "queries_tokens": self.prefix_queries.get(r, 0), "hit_tokens": self.prefix_hits.get(r, 0),
                        "admitted": self.admitted.get(r, 0)})
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self, replica: int) -> int:
        """Sequences (refresh jobs included) on ``replica`` now: counted as they come and go."""
        return self._loads[replica]

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> Plan:
        plan = Plan([[] for _ in self.blocks])
        budget = self.budget
        for seq in [s for s in self.running if s.num_uncached == 1 and not s.job]:  # decodes first
            if budget == 0:
                break
            if seq.replica is None or not self._grow(seq, 1, plan):  # None: preempted above, in this plan
                continue
            plan.chunks[seq.replica].append(self._chunk(seq, 1))
            budget -= 1
        for seq in [s for s in self.running if s.num_uncached > 1 or s.job]:  # prefills in progress
            n = self._prefill_len(seq, budget)
            if n == 0 or not self._fits(seq.replica, seq, n):
                continue
            self._take(seq, n)
            plan.chunks[seq.replica].append(self._chunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            placed = self._place(seq, budget)
            if placed is None or self._prefill_len(seq, budget, start=placed[2]) == 0:
                break  # no room, or (hybrid) its first chunk must wait for a budget that reaches the grid
            self.waiting.popleft()
            self._admit(seq, *placed)
            n = self._prefill_len(seq, budget)
            self._take(seq, n)
            self.running.append(seq)
            plan.chunks[seq.replica].append(self._chunk(seq, n))
            budget -= n
        return plan

    def decode_ahead(self, seqs: list[Seq], token: int) -> list[SeqChunk] | None:
        """The next decode chunk of each of ``seqs``, whose last token is not known yet (``token``
        stands for it; the engine's async scheduling): their cache grows by one position each, all
        or none — None when a replica lacks the room (the plain schedule then preempts as usual)."""
        need: dict[int, int] = {}
        for seq in seqs:
            if seq not in self.running:
                return None
            alloc = self.blocks[seq.replica]
            need[seq.replica] = need.get(seq.replica, 0) + alloc.blocks_needed(seq.num_cached + 1, len(seq.block_table))
        if not all(self.blocks[r].can_allocate(n) for r, n in need.items()):
            return None
        chunks = []
        for seq in seqs:
            start = seq.num_cached
            self._take(seq, 1)
            chunks.append(SeqChunk(seq.seq_id, (token,), start, tuple(seq.block_table), seq.state_slot, False, True,
                                   seq.params, seq.num_prompt_tokens, banned_ids(seq, start + 1, self.stop_ids)))
        return chunks

    def take_released(self, replica: int) -> tuple[int, ...]:
        """The sequences that left ``replica`` since this was last asked (its next step says so)."""
        out, self.released[replica] = tuple(self.released[replica]), []
        return out

    def _chunk(self, seq: Seq, n: int) -> SeqChunk:
        start = seq.num_cached - n  # _take already advanced num_cached
        sample = seq.num_cached == len(seq.token_ids) and not seq.job
        reset, seq.fresh = seq.fresh, False
        restore = seq.snap if reset else None
        # a hit sequence's history (penalties, grammar) is rebuilt from the tokens it did not compute
        prefix = tuple(seq.token_ids[:start]) if reset and start and stateful(seq.params) else ()
        return SeqChunk(seq.seq_id, tuple(seq.token_ids[start : start + n]), start, tuple(seq.block_table),
                        seq.state_slot, reset, sample, None if seq.job else seq.params, seq.num_prompt_tokens,
                        banned_ids(seq, seq.num_cached, self.stop_ids) if sample else (),
                        restore=restore, snapshot=self._plan_snapshot(seq, start), prefix=prefix)

    # ---- prefix caching ------------------------------------------------------------------------
    def _hashes(self, seq: Seq, num_blocks: int) -> list[bytes]:
        return self.blocks[0].chain(seq.hashes, seq.token_ids, seq.cache_salt, num_blocks)

    def _snapshot_key(self, seq: Seq, boundary: int) -> bytes:
        """A snapshot's key: the chained hash of the block ending at its boundary."""
        n = boundary // self.block_size
        return self._hashes(seq, n)[n - 1]

    def _target(self, seq: Seq) -> int:
        """The next grid boundary whose KDA snapshot a sequence saves: its branch point while its
        prefill is before it, then the last boundary before its last known token (a prompt's; the
        deepest any longer request can hit), or a refresh's end."""
        if not seq.job and seq.num_cached < seq.branch:
            return seq.branch
        return self._last_target(seq)

    def _last_target(self, seq: Seq) -> int:
        """A sequence's last snapshot boundary: a refresh's end, else the last grid boundary before its
        last known token."""
        return len(seq.token_ids) if seq.job else (len(seq.token_ids) - 1) // self.grid * self.grid

    def _prefill_len(self, seq: Seq, budget: int, start: int | None = None) -> int:
        """Tokens of ``seq``'s prefill to compute now: within ``budget``; on hybrid models with
        prefix caching, ending at the snapshot target when the chunk would cross it, and otherwise
        on the snapshot grid unless it ends the prefill (so each snapshot is what a from-scratch
        prefill chunked the same way reaches, bit for bit)."""
        start = seq.num_cached if start is None else start
        n = min(len(seq.token_ids) - start, budget)
        if self.snaps is None or n == 0:
            return n
        end, target = start + n, self._target(seq)
        if start < target < end:
            return target - start
        if start >= target and not seq.job:
            return n  # past its last snapshot boundary: how the rest is chunked changes no snapshot
        if end < len(seq.token_ids) and end != target:
            aligned = end - end % self.grid
            if aligned > start:
                return aligned - start
            if self.budget >= self.grid:
                return 0  # the rest of this step's budget cannot reach the grid: the next step's will
            seq.aligned = False  # a budget under the grid: no snapshot from this sequence is exact
        return n

    def _plan_snapshot(self, seq: Seq, start: int) -> int | None:
        """The snapshot this chunk saves into (after it), if it ends at one of the sequence's targets."""
        end = seq.num_cached
        targets = (seq.branch, self._last_target(seq)) if self.grid else ()
        if (self.snaps is None or not seq.aligned or end - start < 1 or end not in targets or end == 0
                or end <= seq.snap_at or seq.saving is not None):
            return None
        pool = self.snaps[seq.replica]
        if pool.lookup(self._snapshot_key(seq, end)) is not None:
            return None  # another sequence's snapshot already covers it
        snap = pool.allocate()
        if snap is not None:
            seq.saving = (snap, end)
        return snap

    def _hit(self, seq: Seq, r: int) -> tuple[list[int], int, int | None, int]:
        """(blocks, tokens, snapshot, branch) that ``seq`` would find cached on replica ``r``; changes
        nothing. On hybrid models the hit ends at the deepest grid boundary with a snapshot too, and
        ``branch`` is the deepest grid boundary of the cached blocks beyond it (0: none): saving a
        snapshot there lets the next request sharing that prefix (a system prompt) hit it."""
        if not self.caching:
            return [], 0, None, 0
        n = (len(seq.token_ids) - 1) // self.block_size
        blocks = self.blocks[r].lookup(self._hashes(seq, n)[:n])
        if self.grid is None:
            return blocks, len(blocks) * self.block_size, None, 0
        if self.snaps is None:
            return [], 0, None, 0
        per = self.grid // self.block_size
        top = len(blocks) - len(blocks) % per
        branch = top * self.block_size
        for k in range(top, 0, -per):
            snap = self.snaps[r].lookup(seq.hashes[k - 1])
            if snap is not None:
                return blocks[:k], k * self.block_size, snap, branch if branch > k * self.block_size else 0
        return [], 0, None, branch

    def _place(self, seq: Seq, budget: int) -> tuple[int, list[int], int, int | None, int] | None:
        """Where a waiting sequence goes: (replica, cached blocks, cached tokens, snapshot, branch), or None
        when no replica has room (or a refresh of its own conversation is about to finish).

        The rule: among replicas with room for its first chunk (and a free KDA slot), the one with
        the highest ``cached tokens − load_weight × running sequences``; ties go to fewer running
        sequences, then more room. With ``load_weight`` = 256, a replica running one more
        sequence must hold 256 more of its tokens to be chosen; 0 always follows the cache; a
        huge weight is least-loaded placement. Without prefix caching every hit is 0: least
        loaded."""
        best, best_key = None, None
        for r in range(len(self.blocks)):
            if self.slots is not None and self.slots[r].num_free == 0:
                continue
            blocks, hit, snap, branch = self._hit(seq, r)
            pool = self.blocks[r]
            n = min(len(seq.token_ids) - hit, budget)
            if pool.blocks_needed(hit + n, len(blocks)) > pool.num_available - pool.num_cached_of(blocks):
                continue
            load = self.load(r)
            key = (hit - self.load_weight * load, -load, pool.num_available)
            if best_key is None or key > best_key:
                best, best_key = (r, blocks, hit, snap, branch), key
        if best is not None and self.jobs and self._refresh_pending(seq, best[2]):
            return None
        return best

    def _refresh_pending(self, seq: Seq, hit: int) -> bool:
        """A refresh job in progress will give ``seq`` a deeper hit than ``hit`` within a step or
        two (the next turn of its conversation arrived first): wait for it."""
        bs = self.block_size
        for job in self.jobs.values():
            end = len(job.token_ids)
            if hit < end < len(seq.token_ids) and seq.hashes[end // bs - 1: end // bs] == job.hashes[end // bs - 1: end // bs]:
                return True
        return False

    def _admit(self, seq: Seq, replica: int, blocks: list[int], hit: int, snap: int | None, branch: int) -> None:
        self.blocks[replica].take(blocks, len(seq.token_ids))
        if self.caching:
            self.prefix_queries[replica] = self.prefix_queries.get(replica, 0) + len(seq.token_ids)
            self.prefix_hits[replica] = self.prefix_hits.get(replica, 0) + hit
        self.admitted[replica] = self.admitted.get(replica, 0) + 1
        seq.replica, seq.block_table, seq.num_cached, seq.fresh, seq.aligned = replica, list(blocks), hit, True, True
        self._loads[replica] += 1
        seq.registered, seq.branch = len(blocks), branch
        if seq.num_hit is None:
            seq.num_hit = hit
        if self.slots is not None:
            (seq.state_slot,) = self.slots[replica].allocate(1)
        if snap is not None:
            self.snaps[replica].hold(snap)
            seq.snap, seq.snap_at = snap, hit

    def _hold_snapshot(self, seq: Seq, snap: int, at: int) -> None:
        """``seq`` keeps ``snap`` (held) as its newest snapshot, releasing the one before."""
        if seq.snap is not None:
            self.snaps[seq.replica].release(seq.snap)
        seq.snap, seq.snap_at = snap, at

    def _refresh_job(self, seq: Seq) -> Seq | None:
        """For a hybrid sequence that finished: a job that prefills its answer again from its
        newest snapshot to the last grid boundary before its last token, so the next turn of its
        conversation can hit there with an exact state. Takes over the sequence's blocks up to
        there, its KDA slot and snapshot."""
        if self.snaps is None or seq.replica is None or not seq.aligned:
            return None
        bs, written = self.block_size, len(seq.token_ids) - 1
        end = written // self.grid * self.grid
        if end <= seq.snap_at or self.snaps[seq.replica].lookup(self._snapshot_key(seq, end)) is not None:
            return None
        job = Seq(-1 - seq.seq_id, seq.token_ids[:end], end, seq.params, list(seq.block_table[: end // bs]),
                  seq.state_slot, seq.snap_at, replica=seq.replica, cache_salt=seq.cache_salt,
                  hashes=seq.hashes, job=True, fresh=True, snap=seq.snap, snap_at=seq.snap_at,
                  registered=seq.snap_at // bs)
        del seq.block_table[: end // bs]
        seq.state_slot, seq.snap, seq.snap_at = None, None, 0
        return job

    def _restart_job(self, job: Seq) -> None:
        """A refresh's step failed: start again from its snapshot (its KDA state is half-advanced)."""
        if job.saving is not None:
            self.snaps[job.replica].release(job.saving[0])
            job.saving = None
        job.num_cached, job.fresh = job.snap_at, True

    def _end_job(self, job: Seq) -> None:
        self.running.remove(job)
        self.jobs.pop(job.seq_id, None)
        self._free(job)

    # ---- room ----------------------------------------------------------------------------
    def _fits(self, replica: int, seq: Seq | None, n: int) -> bool:
        have = len(seq.block_table) if seq is not None and seq.replica == replica else 0
        cached = seq.num_cached if seq is not None and seq.replica == replica else 0
        need = self.blocks[replica].blocks_needed(cached + n, have)
        return self.blocks[replica].can_allocate(need)

    def _take(self, seq: Seq, n: int) -> None:
        alloc = self.blocks[seq.replica]
        seq.block_table.extend(alloc.allocate(alloc.blocks_needed(seq.num_cached + n, len(seq.block_table))))
        seq.num_cached += n

    def _grow(self, seq: Seq, n: int, plan: Plan) -> bool:
        """Make room for ``n`` more tokens of a running sequence, preempting the replica's newest
        sequences (possibly ``seq`` itself) until it fits. False if ``seq`` was preempted."""
        while not self._fits(seq.replica, seq, n):
            victim = next(s for s in reversed(self.running) if s.replica == seq.replica)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self._take(seq, n)
        return True

    def _preempt(self, seq: Seq, plan: Plan) -> None:
        for chunks in plan.chunks:  # it may already hold a chunk in this plan
            chunks[:] = [c for c in chunks if c.seq_id != seq.seq_id]
        if seq.job:  # a refresh is only worth its room while there is room
            self._end_job(seq)
            return
        self.running.remove(seq)
        self._free(seq)
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _free(self, seq: Seq) -> None:
        """``seq`` leaves its replica: its blocks (cached if registered), KDA slot and snapshots."""
        if seq.replica < len(self.released):
            self._loads[seq.replica] -= 1
            self.released[seq.replica].append(seq.seq_id)
            self.blocks[seq.replica].free(seq.block_table)
            if self.slots is not None and seq.state_slot is not None:
                self.slots[seq.replica].free([seq.state_slot])
            if self.snaps is not None:
                for snap in (seq.snap, seq.saving[0] if seq.saving else None):
                    if snap is not None:
                        self.snaps[seq.replica].release(snap)
        seq.block_table, seq.state_slot, seq.num_cached, seq.replica = [], None, 0, None
        seq.snap, seq.snap_at, seq.saving, seq.fresh, seq.registered, seq.branch = None, 0, None, False, 0, 0
