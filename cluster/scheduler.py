"""The scheduler: which sequences run each step, how many of their tokens, and where they go
(continuous batching, docs/architecture.md "The engine").

Owns: every live :class:`Seq` — the only code that assigns a sequence's fields (a static test
holds it to that) — the waiting queue and running set, the token budget, chunking, placement of
new sequences, preemption, each sequence's block table, and the load per attention replica. Every
step mixes decodes and (chunked) prefills under a token budget; a decode that finds its replica's
cache full preempts the replica's newest sequence, whose blocks are freed and which is recomputed
later from its prompt plus the tokens it has already produced. Where the cache lives and what of it
can be shared is the :class:`~cluster.prefix_cache.PrefixCache`'s, which the scheduler asks: a new
sequence goes to the replica with most of it cached, weighed against load (:meth:`Scheduler._place`).

A step's results come back through :meth:`Scheduler.update` (drafts verified, blocks registered,
tokens appended and the stop checks run); a failed step is undone through :meth:`Scheduler.rewind`.
Never: touches tensors or talks to actors — the engine turns a :class:`Plan` into messages; writes a
sequence's :class:`~cluster.seq.CacheHold` (the prefix cache does).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field

from actors.messages import SampledToken, SeqChunk
from model.logits import stateful
from model.runner import banned_ids, check_stop

from .config import CacheConfig, SchedulerConfig, SnapshotPlan, SpeculativeConfig, snapshot_plan
from .drafts import DraftPolicy
from .errors import StepFailed
from .prefix_cache import Hit, PrefixCache
from .seq import Seq




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


@dataclass(frozen=True)
class Verified:
    """One sequence's drafts in a finished step: how many it carried and how many were accepted."""

    seq_id: int
    drafted: int
    accepted: int


@dataclass(frozen=True)
class Applied:
    """One sampled token appended to its sequence, and the reason the sequence finished there, if it did."""

    seq: Seq
    token: SampledToken
    reason: str | None


@dataclass(frozen=True)
class StepUpdate:
    """What a finished step changed (:meth:`Scheduler.update`): the drafts verified, the tokens applied."""

    verified: list[Verified]
    applied: list[Applied]


@dataclass(frozen=True)
class SchedulerSnapshot:
    """What readers on other threads see of the scheduler (``/metrics``, the queue check): taken by
    the engine thread between steps (:meth:`Scheduler.snapshot`, published by ``Engine.publish``),
    never the live queues and pools."""

    running: int  # sequences running (refresh jobs are not requests)
    waiting: int  # new or preempted sequences queued
    blocks_held: tuple[int, ...]  # per attention replica: blocks held by running sequences
    blocks_available: tuple[int, ...]  # … a new sequence can take (free or cached)
    blocks_cached: tuple[int, ...]  # … nobody holds whose content a prefix hit can reuse
    blocks_total: tuple[int, ...]
    prefix_queries: tuple[tuple[int, int], ...] = ()  # (replica, prompt tokens looked up), over the engine's life
    prefix_hits: tuple[tuple[int, int], ...] = ()  # (replica, prompt tokens found cached)


class Scheduler:
    def __init__(self, scheduler: SchedulerConfig, cache: CacheConfig, *, num_replicas: int, hybrid: bool = False,
                 stop_ids: frozenset[int] = frozenset(), max_context: int = 1 << 62,
                 snapshots: SnapshotPlan = SnapshotPlan(), speculative: SpeculativeConfig | None = None):
        """``scheduler``: the budget and the running sequences' cap; ``cache``: the prefix cache's
        (blocks, KDA slots for ``hybrid`` models, sharing) and ``prefix_load_weight``, the cached
        tokens one more running sequence on a replica is worth in placement (see :meth:`_place`).
        ``snapshots`` (hybrid models): the KDA snapshots' grid and count per replica.
        ``speculative``: decoding sequences carry draft tokens (:class:`~cluster.drafts.DraftPolicy`)."""
        max_num_seqs, max_tokens_per_step = scheduler.max_num_seqs, scheduler.max_tokens_per_step
        block_size = cache.block_size
        self.cache = PrefixCache(cache, hybrid=hybrid, snapshots=snapshots, step_budget=max_tokens_per_step)
        self.load_weight = cache.prefix_load_weight
        self.speculative = speculative
        self.drafts = DraftPolicy(speculative, stop_ids, max_context) if speculative is not None else None
        self.lookahead = speculative is not None and speculative.method == "mtp"  # chunks say the token after them
        self.admitted: dict[int, int] = {}  # per replica index, over the engine's life: sequences placed there
        self.stop_ids, self.max_context = frozenset(stop_ids), max_context  # the model's stop tokens and context
        self.seqs: dict[int, Seq] = {}  # every sequence added and not finished, by id
        self.block_size, self.max_num_seqs, self.budget = block_size, max_num_seqs, max_tokens_per_step
        self.waiting: deque[Seq] = deque()
        # waiting sequences set aside until their blocks arrive from elsewhere (cluster/apd.py, after a recovery):
        # by id, with the time past which they wait no longer (:meth:`park`)
        self.parked: dict[int, tuple[Seq, float, int]] = {}
        self.running: list[Seq] = []
        self.released: list[list[int]] = []  # per replica: sequences that left it since its last step
        self._loads: list[int] = []  # per replica: sequences holding a place there
        self.resize(num_replicas)

    @classmethod
    def for_engine(cls, config, model_cfg, num_replicas: int, stop_ids=frozenset()) -> "Scheduler":
        """The scheduler an engine with ``config`` (an :class:`~cluster.config.EngineConfig`) runs
        for ``model_cfg`` (the engine's, and the simulator's: the same decisions)."""
        return cls(config.scheduler, config.cache, num_replicas=num_replicas, hybrid=bool(model_cfg.kda_layers),
                   stop_ids=frozenset(stop_ids) | frozenset(model_cfg.eos_token_ids),
                   max_context=model_cfg.max_position_embeddings, snapshots=snapshot_plan(config, model_cfg),
                   speculative=config.speculative)

    @property
    def num_replicas(self) -> int:
        return len(self._loads)

    # ---- replicas (an epoch change, at a step boundary) ------------------------------------
    def resize(self, num_replicas: int) -> list[Seq]:
        """Grow to, or shrink to, ``num_replicas`` attention replicas. A new replica starts empty
        and takes new sequences at once (least loaded first); the running sequences of a removed
        one go back to the front of the queue, in order, to be re-prefilled from their prompt plus
        the tokens already generated on the replicas that remain. Returns those sequences."""
        if num_replicas < 1:
            raise ValueError(f"attention replicas must be >= 1, got {num_replicas}")
        self.cache.resize(max(num_replicas, self.num_replicas))
        while self.num_replicas < num_replicas:
            self.released.append([])
            self._loads.append(0)
        moved = [s for s in self.running if not s.is_refresh and s.replica is not None and s.replica >= num_replicas]
        for job in [j for j in self.running if j.is_refresh and j.replica >= num_replicas]:
            self._end_job(job)
        for seq in reversed(moved):
            self.running.remove(seq)
            self._free(seq)
            self.waiting.appendleft(seq)
        self.cache.resize(num_replicas)  # a removed replica's cache goes with it
        del self.released[num_replicas:]
        del self._loads[num_replicas:]
        return moved

    # ---- queue --------------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        if len(seq.token_ids) + 1 > self.cache.max_tokens():
            raise ValueError(f"sequence {seq.seq_id} needs {len(seq.token_ids) + 1} tokens of cache; a replica "
                             f"holds {self.cache.max_tokens()}")
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def rehome(self, seq: Seq, replica: int) -> None:
        """A waiting sequence's prefix was brought to ``replica`` (cluster/pd.py, after a recovery): its next
        admission takes that replica when it has room (as a request's ``home``)."""
        if seq in self.waiting and seq.replica is None:
            seq.home = replica

    def park(self, seq: Seq, until: float, token: int = 0) -> None:
        """Set a waiting sequence aside (not admitted) until :meth:`unpark` with the same ``token``, or ``until``
        (``time.monotonic``), when the scheduler takes it back itself."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.parked[seq.seq_id] = (seq, until, token)

    def unpark(self, seq_id: int, home: int | None = None, token: int = 0) -> bool:
        """Back to the front of the queue (its prefix brought to replica ``home``, when given); False, and
        nothing done, unless it is parked under ``token`` (it ended, or waited past its time, meanwhile)."""
        seq, _, parked_as = self.parked.get(seq_id, (None, 0.0, None))
        if seq is None or parked_as != token:
            return False
        del self.parked[seq_id]
        if home is not None:
            seq.home = home
        self.waiting.appendleft(seq)
        return True

    @property
    def overdue(self) -> bool:
        """A parked sequence waited past its time (the next :meth:`schedule` takes it back)."""
        return bool(self.parked) and bool(self._overdue())

    def _overdue(self) -> list[int]:
        now = time.monotonic()
        return [i for i, (_, until, _) in self.parked.items() if until <= now]

    def requeue(self, seqs: list[Seq]) -> None:
        """Back to the front of the queue, in order, for a full re-prefill from prompt plus generated
        tokens (their replica died, or a failed step left their KDA state half-advanced)."""
        for seq in reversed(seqs):
            if seq in self.running:
                self.running.remove(seq)
                self._free(seq)
                self.waiting.appendleft(seq)

    def update(self, plan: Plan, sampled: list[SampledToken]) -> StepUpdate:
        """A finished step's results, whole (vLLM's ``update_from_output``): its drafts verified
        (an answer that contradicts them raises :class:`~cluster.errors.StepFailed` before anything
        changes), what it wrote registered with the prefix cache, then its tokens applied — in that
        order, so that a sequence finishing in this step leaves its blocks, accepted drafts
        included, cached."""
        verified = self._verified(plan, sampled)
        self._completed(plan, verified)
        return StepUpdate(verified, self._apply(sampled))

    def _apply(self, sampled: list[SampledToken]) -> list[Applied]:
        """A finished step's sampled tokens: each is appended to its sequence and the stop checks run
        (a stopped sequence is finished and its cache freed). Tokens of sequences finished or
        aborted meanwhile are dropped."""
        out = []
        for tok in sampled:
            seq = self.seqs.get(tok.seq_id)
            if seq is None:
                continue
            seq.token_ids.append(tok.token_id)
            reason = check_stop(seq, self.stop_ids, self.max_context)
            if reason:
                self.finish(seq, reason)
            out.append(Applied(seq, tok, reason))
        return out

    def _verified(self, plan: Plan, sampled: list[SampledToken]) -> list[Verified]:
        """A finished step's drafts: each sequence that carried some keeps the cache of its input
        token and of the drafts accepted (the attention actor returned them and one more token);
        the positions of the rejected ones are given back (overwritten later) and its acceptance
        rate moves. Returns what each sequence drafted and got accepted."""
        if self.speculative is None:
            return []
        got: dict[int, list[int]] = {}
        for t in sampled:
            got.setdefault(t.seq_id, []).append(t.token_id)
        drafted = [(c, seq) for chunks in plan.chunks for c in chunks
                   if c.draft and (seq := self.seqs.get(c.seq_id)) is not None and seq.replica is not None]
        for c, _ in drafted:  # every answer checked before any sequence changes: a bad one fails the step whole
            n = len(got.get(c.seq_id, ()))
            if not 1 <= n <= c.draft + 1:
                raise StepFailed(f"step answer inconsistent: sequence {c.seq_id} carried {c.draft} drafts and got "
                                 f"{n} tokens back (1 to {c.draft + 1} expected)", dead=[])
        out = []
        for c, seq in drafted:
            tokens = got[c.seq_id]
            # the accepted drafts apply() keeps: none past a stop token (a draft may be one; it ends the sequence)
            accepted = min(self._kept(seq, tokens), len(tokens) - 1)
            seq.num_cached = c.num_cached + 1 + accepted  # its input and those drafts
            keep = math.ceil(seq.num_cached / self.block_size)
            if len(seq.block_table) > keep:
                self.cache.free_tail(seq, keep)
                del seq.block_table[keep:]
            self.drafts.verified(seq, c.draft, len(tokens) - 1)
            out.append(Verified(c.seq_id, c.draft, accepted))
        return out

    def _kept(self, seq: Seq, tokens: list[int]) -> int:
        """Of a step's ``tokens`` for ``seq``, how many :meth:`apply` keeps: up to its first stop token
        (the tokens after it are dropped). Length limits need no check here: drafts never pass them
        (:meth:`DraftPolicy.propose <cluster.drafts.DraftPolicy.propose>`), and drafts are never made while stops are banned (``min_tokens``)."""
        p = seq.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.stop_ids)
        return next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))

    def _completed(self, plan: Plan, verified: list[Verified]) -> None:
        """A step came back whole: what its chunks wrote may now be shared (the prefix cache
        registers it), and the refresh jobs it finished end. Of a chunk's drafts, only those
        accepted count (``verified``: :meth:`_verified`'s answer for the step)."""
        accepted = {v.seq_id: v.accepted for v in verified}
        for r, chunks in enumerate(plan.chunks):
            for c in chunks:
                seq = self.cache.jobs.get(c.seq_id) if c.seq_id < 0 else self.seqs.get(c.seq_id)
                if seq is None or seq.replica != r:
                    continue  # finished or moved meanwhile
                ahead = ()
                if c.draft:
                    known = len(c.token_ids) - c.draft
                    ahead = c.token_ids[known : known + accepted.get(c.seq_id, 0)]  # the accepted drafts
                    c = dataclasses.replace(c, token_ids=c.token_ids[:known] + ahead, draft=0)
                if self.cache.completed(seq, r, c, ahead):
                    self._end_job(seq)

    def rewind(self, failed: list[list[SeqChunk]], dead_replicas: set[int], *, recompute_state: bool) -> None:
        """Make the state what it was before failed steps (their chunks, newest step first).
        Latent-cache writes are idempotent (a retry rewrites the same positions with the same
        values), so the steps' tokens are just computed again; a KDA state update is not (layers
        before the failure already advanced it), so with ``recompute_state`` the steps' sequences
        are re-prefilled from zero (or from their cached prefix), as are all sequences of a dead
        attention replica, whose cache is gone: its pools are emptied. A refresh job restarts from
        its snapshot, or is dropped with its replica."""
        redo = [s for s in self.running if not s.is_refresh and s.replica in dead_replicas]
        for job in [j for j in self.running if j.is_refresh and j.replica in dead_replicas]:
            self._end_job(job)
        for chunks in failed:
            for c in chunks:
                if c.seq_id < 0:
                    job = self.cache.jobs.get(c.seq_id)
                    if job is not None:
                        job.num_cached, job.reset_state_next = self.cache.failed(job), True
                    continue
                seq = self.seqs.get(c.seq_id)
                if seq is None or seq not in self.running or seq in redo:
                    continue
                if recompute_state:
                    redo.append(seq)
                else:  # its next chunk brings its params again (its actor may not have taken them)
                    seq.num_cached -= len(c.token_ids)
                    seq.reset_state_next = True
        self.requeue(sorted(redo, key=self.running.index))
        self.cache.forget(dead_replicas)

    def finish(self, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if self.drafts is not None and not seq.is_refresh:
            self.drafts.finished(seq)
        if seq in self.running:
            self.running.remove(seq)
            job = self._refresh_job(seq) if reason != "abort" else None
            self._free(seq)
            if job is not None:
                self.running.append(job)
                self.cache.track(job)
                self._loads[job.replica] += 1
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.parked.pop(seq.seq_id, None)

    def cache_status(self) -> list[dict]:
        """Per replica: the prefix cache's status there and the sequences placed there."""
        return [{**self.cache.status(r), "admitted": self.admitted.get(r, 0)} for r in range(self.num_replicas)]

    def snapshot(self) -> SchedulerSnapshot:
        pools = self.cache.blocks
        return SchedulerSnapshot(
            running=len(self.running) - len(self.cache.jobs), waiting=len(self.waiting) + len(self.parked),
            blocks_held=tuple(p.num_held for p in pools), blocks_available=tuple(p.num_available for p in pools),
            blocks_cached=tuple(p.num_cached for p in pools), blocks_total=tuple(p.num_blocks for p in pools),
            prefix_queries=tuple(sorted(self.cache.queries.items())), prefix_hits=tuple(sorted(self.cache.hits.items())))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.overdue)

    def load(self, replica: int) -> int:
        """Sequences (refresh jobs included) on ``replica`` now: counted as they come and go."""
        return self._loads[replica]

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> Plan:
        for seq_id in self._overdue():  # (what was to bring their blocks failed to say so: prefilled here)
            self.unpark(seq_id, None, self.parked[seq_id][2])
        plan = Plan([[] for _ in range(self.num_replicas)])
        budget = self.budget
        decodes = [s for s in self.running if s.num_uncached == 1 and not s.is_refresh]
        k = self.drafts.length(len(decodes)) if self.drafts is not None else 0
        grown = []
        for seq in decodes:  # decodes first, each its one token (preempting the newest where it must) ...
            if budget == 0:
                break
            if seq.replica is None or not self._grow(seq, 1, plan):  # preempted above, or now
                continue
            grown.append(seq)
            budget -= 1
        for seq in grown:  # ... then drafts, from the room and budget left: drafts never preempt anything
            if seq.replica is None:  # preempted by a later decode's token
                continue
            draft = self.drafts.propose(seq, min(k, budget)) if k else []
            if draft and not self.cache.fits(seq.replica, seq, len(draft)):
                draft = []
            self._take(seq, len(draft))
            plan.chunks[seq.replica].append(self._chunk(seq, 1 + len(draft), draft))
            budget -= len(draft)
        blocked: dict[int, Seq] = {}  # replica → a prefill in progress that found no room there
        for seq in [s for s in self.running if s.num_uncached > 1 or s.is_refresh]:  # prefills in progress
            n = self._prefill_len(seq, budget)
            if n == 0:
                continue
            if not self.cache.fits(seq.replica, seq, n):
                blocked.setdefault(seq.replica, seq)
                continue
            self._take(seq, n)
            plan.chunks[seq.replica].append(self._chunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            placed = self._place(seq, budget)
            if placed is None or self._prefill_len(seq, budget, start=placed[1].tokens) == 0:
                break  # no room, or (hybrid) its first chunk must wait for a budget that reaches the grid
            self.waiting.popleft()
            self._admit(seq, *placed)
            n = self._prefill_len(seq, budget)
            self._take(seq, n)
            self.running.append(seq)
            plan.chunks[seq.replica].append(self._chunk(seq, n))
            budget -= n
        for replica in blocked:
            if not plan.chunks[replica]:  # nothing runs there: its prefills hold each other's room (they were
                # admitted on prefix hits, which took the room first) — the newest goes back to wait, its
                # registered blocks cached for its return, so the others can finish
                self._preempt(next(s for s in reversed(self.running) if s.replica == replica), plan)
        return plan

    def decode_ahead(self, seqs: list[Seq], token: int) -> list[SeqChunk] | None:
        """The next decode chunk of each of ``seqs``, whose last token is not known yet (``token``
        stands for it; the engine's async scheduling): their cache grows by one position each, all
        or none — None when a replica lacks the room (the plain schedule then preempts as usual)."""
        need: dict[int, int] = {}
        for seq in seqs:
            if seq not in self.running:
                return None
            need[seq.replica] = need.get(seq.replica, 0) + self.cache.blocks_to_grow(seq, 1)
        if not all(self.cache.can_allocate(r, n) for r, n in need.items()):
            return None
        chunks = []
        for seq in seqs:
            if self.drafts is not None:
                self.drafts.rest(seq)  # a step without drafts: a resting sequence comes closer to its probe
            start = seq.num_cached
            self._take(seq, 1)
            chunks.append(SeqChunk(seq.seq_id, (token,), start, tuple(seq.block_table), seq.state_slot,
                                   sample=True, prompt_len=seq.num_prompt_tokens,
                                   banned=banned_ids(seq, start + 1, self.stop_ids)))
        return chunks

    def take_released(self, replica: int) -> tuple[int, ...]:
        """The sequences that left ``replica`` since this was last asked (its next step says so)."""
        out, self.released[replica] = tuple(self.released[replica]), []
        return out

    def _chunk(self, seq: Seq, n: int, draft: list[int] = ()) -> SeqChunk:
        """``seq``'s next ``n`` tokens (``_take`` already advanced ``num_cached``), the last
        ``len(draft)`` of them ``draft``: tokens proposed, not yet known, verified by the actor."""
        start = seq.num_cached - n
        known = seq.num_cached - len(draft)
        sample = known == len(seq.token_ids) and not seq.is_refresh
        reset, seq.reset_state_next = seq.reset_state_next, False
        # a sequence's params go to its replica once, with its first chunk there (reset_state)
        params = seq.params if reset and not seq.is_refresh else None
        # a hit sequence's history (penalties, grammar) is rebuilt from the tokens it did not compute
        prefix = tuple(seq.token_ids[:start]) if reset and start and stateful(seq.params) else ()
        return SeqChunk(seq.seq_id, tuple(seq.token_ids[start:known]) + tuple(draft), start, tuple(seq.block_table),
                        seq.state_slot, reset_state=reset, sample=sample, params=params,
                        prompt_len=seq.num_prompt_tokens,
                        banned=banned_ids(seq, known, self.stop_ids) if sample else (),
                        restore=seq.cache.snapshot if reset else None,
                        snapshot=self.cache.plan_snapshot(seq, start), prefix=prefix, draft=len(draft),
                        lookahead=seq.token_ids[known] if self.lookahead and not sample and known < len(seq.token_ids)
                        else -1)

    def _prefill_len(self, seq: Seq, budget: int, start: int | None = None) -> int:
        """Tokens of ``seq``'s prefill to compute now: within ``budget``, cut on the prefix cache's
        snapshot grid (hybrid models)."""
        start = seq.num_cached if start is None else start
        return self.cache.cut(seq, start, min(len(seq.token_ids) - start, budget))

    def _place(self, seq: Seq, budget: int) -> tuple[int, Hit] | None:
        """Where a waiting sequence goes: (replica, what it finds cached there), or None when no
        replica has room (or a refresh of its own conversation is about to finish).

        The rule: among replicas with room for its first chunk (and a free KDA slot), the one with
        the highest ``cached tokens − load_weight × running sequences``; ties go to fewer running
        sequences, then more room. With ``load_weight`` = 256, a replica running one more
        sequence must hold 256 more of its tokens to be chosen; 0 always follows the cache; a
        huge weight is least-loaded placement. Without prefix caching every hit is 0: least
        loaded. A sequence with a ``home`` (its prompt's blocks were sent there: cluster/pd.py) goes there
        when it has room, else where the rule says."""
        home = seq.home if seq.home is not None and seq.home < self.num_replicas else None
        if home is not None:  # its prompt's blocks were sent there (cluster/pd.py): there if it has room
            best = self._best(seq, budget, [home])
            if best is not None:
                return best
        return self._best(seq, budget, range(self.num_replicas))

    def _best(self, seq: Seq, budget: int, where) -> tuple[int, Hit] | None:
        """:meth:`_place` among the replicas ``where``."""
        best, best_key = None, None
        for r in where:
            if not self.cache.has_free_slot(r):
                continue
            hit = self.cache.hit(seq, r)
            if not self.cache.room_for(seq, r, hit, min(len(seq.token_ids) - hit.tokens, budget)):
                continue
            load = self.load(r)
            key = (hit.tokens - self.load_weight * load, -load, self.cache.blocks[r].num_available)
            if best_key is None or key > best_key:
                best, best_key = (r, hit), key
        if best is not None and self.cache.jobs and self.cache.refresh_pending(seq, best[1]):
            return None
        return best

    def _admit(self, seq: Seq, replica: int, hit: Hit) -> None:
        slot = self.cache.admit(seq, replica, hit)
        self.admitted[replica] = self.admitted.get(replica, 0) + 1
        seq.replica, seq.block_table, seq.num_cached, seq.reset_state_next = replica, list(hit.blocks), hit.tokens, True
        seq.home = None  # (a later re-admission, after its replica's loss, goes wherever placement likes)
        self._loads[replica] += 1
        if seq.num_hit is None:
            seq.num_hit = hit.tokens
        if slot is not None:
            seq.state_slot = slot

    def _refresh_job(self, seq: Seq) -> Seq | None:
        """For a hybrid sequence that finished: the prefix cache's refresh job, which takes over the
        sequence's blocks up to its end, its KDA slot and its snapshot."""
        made = self.cache.refresh(seq)
        if made is None:
            return None
        end, hold = made
        keep = end // self.block_size
        job = Seq(-1 - seq.seq_id, seq.token_ids[:end], end, seq.params, seq.block_table[:keep], seq.state_slot,
                  hold.snapshot_at, replica=seq.replica, cache_salt=seq.cache_salt, is_refresh=True,
                  reset_state_next=True, cache=hold)
        del seq.block_table[:keep]
        seq.state_slot = None
        return job

    def _end_job(self, job: Seq) -> None:
        self.running.remove(job)
        self.cache.untrack(job)
        self._free(job)

    # ---- room ----------------------------------------------------------------------------
    def _take(self, seq: Seq, n: int) -> None:
        seq.block_table.extend(self.cache.allocate(seq, n))
        seq.num_cached += n

    def _grow(self, seq: Seq, n: int, plan: Plan) -> bool:
        """Make room for ``n`` more tokens of a running sequence, preempting the replica's newest
        sequences (possibly ``seq`` itself) until it fits. False if ``seq`` was preempted."""
        while not self.cache.fits(seq.replica, seq, n):
            victim = next(s for s in reversed(self.running) if s.replica == seq.replica)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self._take(seq, n)
        return True

    def _preempt(self, seq: Seq, plan: Plan) -> None:
        for chunks in plan.chunks:  # it may already hold a chunk in this plan
            chunks[:] = [c for c in chunks if c.seq_id != seq.seq_id]
        if seq.is_refresh:  # a refresh is only worth its room while there is room
            self._end_job(seq)
            return
        self.running.remove(seq)
        self._free(seq)
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _free(self, seq: Seq) -> None:
        """``seq`` leaves its replica: its blocks (cached if registered), KDA slot and snapshots."""
        alive = seq.replica < self.num_replicas
        if alive:
            self._loads[seq.replica] -= 1
            self.released[seq.replica].append(seq.seq_id)
        self.cache.release(seq, replica_alive=alive)
        seq.block_table, seq.state_slot, seq.num_cached, seq.replica = [], None, 0, None
        seq.reset_state_next = False
