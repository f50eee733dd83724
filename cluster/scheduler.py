"""The scheduler: which sequences run each step, how many of their tokens, and where their cache
lives (continuous batching, docs/architecture.md "The engine").

Owns: every live :class:`Seq` — the only code that assigns a sequence's fields (a static test
holds it to that) — the waiting queue and running set, each attention replica's block and
KDA-slot allocators, and each sequence's block table. Every step mixes decodes and (chunked)
prefills under a token budget; a decode that finds its replica's cache full preempts the
replica's newest sequence, whose blocks are freed and which is recomputed later from its prompt
plus the tokens it has already produced. New sequences go to the least-loaded replica and stay
there for life. A step's sampled tokens come back through :meth:`Scheduler.apply` (append, stop
checks); a failed step is undone through :meth:`Scheduler.rewind`.
Never: touches tensors or talks to actors — the engine turns a :class:`Plan` into messages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from actors.messages import SampledToken, SeqChunk
from model.cache import BlockAllocator
from model.runner import Sequence, banned_ids, check_stop


@dataclass(eq=False)
class Seq(Sequence):
    """A sequence as the scheduler sees it: the runner's sequence plus where it lives."""

    replica: int | None = None  # the attention replica it is pinned to while it has cache
    num_preemptions: int = 0


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
                 max_context: int = 1 << 62):
        if max_tokens_per_step < 1 or max_num_seqs < 1:
            raise ValueError("max_tokens_per_step and max_num_seqs must be >= 1")
        self.stop_ids, self.max_context = frozenset(stop_ids), max_context  # the model's stop tokens and context
        self.seqs: dict[int, Seq] = {}  # every sequence added and not finished, by id
        self.block_size, self.max_num_seqs, self.budget = block_size, max_num_seqs, max_tokens_per_step
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.blocks: list[BlockAllocator] = []
        self.slots: list[BlockAllocator] | None = [] if num_slots else None
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.released: list[list[int]] = []  # per replica: sequences that left it since its last step
        self.resize(num_replicas)

    # ---- replicas (an epoch change, at a step boundary) ------------------------------------
    def resize(self, num_replicas: int) -> list[Seq]:
        """Grow to, or shrink to, ``num_replicas`` attention replicas. A new replica starts empty
        and takes new sequences at once (least loaded first); the running sequences of a removed
        one go back to the front of the queue, in order, to be re-prefilled from their prompt plus
        the tokens already generated on the replicas that remain. Returns those sequences."""
        if num_replicas < 1:
            raise ValueError(f"attention replicas must be >= 1, got {num_replicas}")
        while len(self.blocks) < num_replicas:
            self.blocks.append(BlockAllocator(self.num_blocks, self.block_size))
            self.released.append([])
            if self.slots is not None:
                self.slots.append(BlockAllocator(self.num_slots, 1))
        moved = [s for s in self.running if s.replica is not None and s.replica >= num_replicas]
        for seq in reversed(moved):
            self.running.remove(seq)
            self._free(seq)
            self.waiting.appendleft(seq)
        del self.blocks[num_replicas:]
        del self.released[num_replicas:]
        if self.slots is not None:
            del self.slots[num_replicas:]
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

    def rewind(self, failed: list[list[SeqChunk]], dead_replicas: set[int], *, recompute_state: bool) -> None:
        """Make the state what it was before failed steps (their chunks, newest step first).
        Latent-cache writes are idempotent (a retry rewrites the same positions with the same
        values), so the steps' tokens are just computed again; a KDA state update is not (layers
        before the failure already advanced it), so with ``recompute_state`` the steps' sequences
        are re-prefilled from zero, as are all sequences of a dead attention replica (their cache
        is gone)."""
        redo = [s for s in self.running if s.replica in dead_replicas]
        for chunks in failed:
            for c in chunks:
                seq = self.seqs.get(c.seq_id)
                if seq is None or seq not in self.running or seq in redo:
                    continue
                if recompute_state:
                    redo.append(seq)
                else:
                    seq.num_cached -= len(c.token_ids)
        self.requeue(sorted(redo, key=self.running.index))

    def finish(self, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self, replica: int) -> int:
        return sum(1 for s in self.running if s.replica == replica)

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> Plan:
        plan = Plan([[] for _ in self.blocks])
        budget = self.budget
        for seq in [s for s in self.running if s.num_uncached == 1]:  # decodes first
            if budget == 0:
                break
            if seq not in self.running or not self._grow(seq, 1, plan):
                continue
            plan.chunks[seq.replica].append(self._chunk(seq, 1, reset=False))
            budget -= 1
        for seq in [s for s in self.running if s.num_uncached > 1]:  # prefills in progress
            n = min(seq.num_uncached, budget)
            if n == 0 or not self._fits(seq.replica, seq, n):
                continue
            self._take(seq, n)
            plan.chunks[seq.replica].append(self._chunk(seq, n, reset=False))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncached, budget)
            replica = self._pick_replica(seq, n)
            if replica is None:
                break
            self.waiting.popleft()
            seq.replica = replica
            if self.slots is not None:
                (seq.state_slot,) = self.slots[replica].allocate(1)
            self._take(seq, n)
            self.running.append(seq)
            plan.chunks[replica].append(self._chunk(seq, n, reset=True))
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

    def _chunk(self, seq: Seq, n: int, reset: bool) -> SeqChunk:
        start = seq.num_cached - n  # _take already advanced num_cached
        sample = seq.num_cached == len(seq.token_ids)
        return SeqChunk(seq.seq_id, tuple(seq.token_ids[start : start + n]), start, tuple(seq.block_table),
                        seq.state_slot, reset, sample, seq.params, seq.num_prompt_tokens,
                        banned_ids(seq, seq.num_cached, self.stop_ids) if sample else ())

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

    def _pick_replica(self, seq: Seq, n: int) -> int | None:
        fits = [r for r in range(len(self.blocks))
                if self._fits(r, None, n) and (self.slots is None or self.slots[r].num_free > 0)]
        return min(fits, key=lambda r: (self.load(r), -self.blocks[r].num_free), default=None)

    def _preempt(self, seq: Seq, plan: Plan) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        for chunks in plan.chunks:  # it may already hold a chunk in this plan
            chunks[:] = [c for c in chunks if c.seq_id != seq.seq_id]

    def _free(self, seq: Seq) -> None:
        if seq.replica < len(self.released):
            self.released[seq.replica].append(seq.seq_id)
        self.blocks[seq.replica].free(seq.block_table)
        if self.slots is not None and seq.state_slot is not None:
            self.slots[seq.replica].free([seq.state_slot])
        seq.block_table, seq.state_slot, seq.num_cached, seq.replica = [], None, 0, None
