"""The engine: one per model deployment — requests and the step loop.

A step: the scheduler plans it → one message per actor, sent through the executor (the step
channels) → the sampled tokens come back → the scheduler applies them (appends, stop checks) →
events for the streams. With async scheduling the next decode step is sent before the last one's
results are back; the engine owns that queue of steps in flight (:attr:`Engine.inflight`, oldest
first, at most two).

Owns: per-request records (arrival, first and last token times, logprobs), the queue of steps in
flight, the step counter, and the statistics (:class:`~cluster.stats.EngineStats`, its one writer).
Holds, and hands to its parts: the scheduler (sequences), the router (placement, token counts), the
executor (the actors, injected: :class:`~cluster.executor.RayExecutor` or a fake) and the epoch owner
(:class:`~cluster.epochs.Epochs`: every shape change, recovery included).
Never: assigns a sequence's fields (the scheduler does), starts a shape change itself (its
``scale_*``/``rebalance`` ask the epoch owner), computes a layer, or waits on an actor without a timeout.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from actors.messages import AHEAD, ExpertStep, PlacementTable, SampledToken, StepRequest
from actors.router import Router
from model.config import ModelConfig, load_config
from model.loader import served_moe_layers
from model.sampling import SamplingParams

from .config import EngineConfig
from .drafts import check_speculative, speculative_status
from .epochs import EpochChange, Epochs, Transition
from .errors import EngineError, NoCapacity, RequestsFailed, StepFailed
from .executor import Executor, Sent
from .scheduler import Applied, Plan, Scheduler, SchedulerSnapshot
from .seq import Seq
from .stats import EngineStats, StepRecord
from .stream import EngineRequest, StreamChunk
from .spec import ClusterSpec
from .tiering import TierLoads

__all__ = ["Engine", "EngineConfig", "EngineError", "EpochChange", "NoCapacity", "Request",
           "RequestsFailed", "Transition"]


@dataclass
class Request:
    """The engine's record of one request (its sequence is the scheduler's)."""

    seq: Seq
    logprobs: list[SampledToken] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # first sent in a step (the end of its wait in the queue)
    first_token: float | None = None
    last_token: float | None = None


@dataclass(frozen=True)
class Launched:
    """A step sent to the actors and not yet finished."""

    step: int
    plan: Plan
    sent: Sent  # where it went, from Executor.launch
    t0: float
    table: PlacementTable  # the epoch it ran in (its statistics are laid out by it)
    t_plan: float = 0.0  # its scheduling began (time.perf_counter, as t0)
    ahead: bool = False  # sent ahead of the step before it (async scheduling)
    tier: tuple = ()  # the KV tier writes it carries (PrefixCache.TierOut), held until it is back


@dataclass(frozen=True)
class StepResults:
    """A finished step's results, until its statistics are recorded (:meth:`Engine._record`)."""

    tokens: int
    attn: list  # [StepResult]
    expert: list  # [ExpertStepResult]
    step_s: float
    table: PlacementTable  # the epoch it ran in
    verifying: bool  # it verified drafts
    # (scheduling began, sending began, every result back, results applied) on time.perf_counter, for the
    # per-token profile; None for a step sent ahead (its timeline overlaps the step before it)
    stamps: tuple[float, float, float, float] | None = None


def check_shape(mc: ModelConfig, spec: ClusterSpec, model: str) -> None:
    """ValueError naming the count when ``spec`` cannot hold the model's routed experts: checked
    before anything starts (the engine, and `moeray generate` before it starts Ray nodes)."""
    if mc.n_routed_experts == 0:
        raise ValueError(f"{model}: the model has no routed experts to place on expert actors")
    if spec.colocated and not 1 <= spec.workers <= mc.n_routed_experts:
        raise ValueError(f"workers must be in 1..{mc.n_routed_experts} (each holds a shard of the routed "
                         f"experts), got {spec.workers}")
    if not spec.colocated and (spec.attention < 1 or not 1 <= spec.experts <= mc.n_routed_experts):
        raise ValueError(f"expert actors must be in 1..{mc.n_routed_experts} (the routed experts) and "
                         f"attention replicas >= 1, got {spec.experts} and {spec.attention}")


class Engine:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, *, stop_ids: frozenset[int] = frozenset(),
                 executor: Executor | None = None):
        """``executor``: the actors' seam; default a :class:`~cluster.executor.RayExecutor` over a
        new :class:`~cluster.fleet.Fleet` (Ray is imported only then)."""
        self.config, self.spec = config, spec
        self.model_cfg: ModelConfig = load_config(config.model)
        mc = self.model_cfg
        check_shape(mc, spec, config.model)
        self.scheduler = Scheduler.for_engine(config, mc, spec.attention, stop_ids)
        check_speculative(mc, config, config.model)
        # the MoE layers whose experts the expert actors serve: with MTP drafts, its layer's too
        layers = served_moe_layers(mc, mtp=config.mtp)
        self.router = Router(mc.n_routed_experts, layers, window_steps=config.elastic.rebalance_window_steps)
        if executor is None:
            from .executor import RayExecutor
            from .fleet import Fleet

            executor = RayExecutor(Fleet(config, spec, mc), config)
        self.executor = executor
        self.epochs = Epochs(config, executor, self.router, self.scheduler, recompute_state=bool(mc.kda_layers),
                             on_change=lambda c: self.stats.observe_epoch(c.epoch, c.pause_s))
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats(len(layers))
        self.inflight: deque[Launched] = deque()  # steps sent and not finished, oldest first (at most two)
        self._ids = itertools.count()
        self.step_no = 0
        self.ping_pong = config.data_plane.ping_pong  # may be switched between steps
        self._unrecorded: StepResults | None = None  # the last finished step's results, until _record()
        self.failed_in_a_row = 0  # steps failed (and recovered) since the last one that completed
        self.snapshot: SchedulerSnapshot = self.scheduler.snapshot()  # what other threads read (publish)
        # after a recovery, ``on_rewound(engine, seqs)`` gets the sequences queued again for a whole re-prefill
        # (prompt plus generated tokens): prefill/decode disaggregation has their blocks made elsewhere (cluster/pd.py)
        self.on_rewound: Callable[["Engine", list], None] | None = None
        self.tier = TierLoads(self) if self.scheduler.cache.tiered else None  # the KV tier's lookups

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self.executor.started:
            raise RuntimeError("engine already started")
        spec = self.spec
        table = self.router.table or (self.router.initial(spec.workers, spec.workers, colocated=True) if spec.colocated
                                      else self.router.initial(spec.attention, spec.experts))  # a retry keeps it
        self.executor.start(table)
        return self

    def shutdown(self) -> None:
        self.epochs.abort(EngineError("the engine shut down during the epoch change"))
        self.inflight.clear()
        self.executor.shutdown()

    def __enter__(self) -> "Engine":
        return self if self.executor.started else self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def table(self) -> PlacementTable:
        """The current epoch's placement, as the router published it."""
        return self.router.current()

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab, ctx = self.model_cfg.vocab_size, self.model_cfg.max_position_embeddings
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) + params.max_tokens > ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context ({ctx})")
        cap = self.config.cache.num_blocks * self.config.cache.block_size
        if len(prompt_ids) + params.max_tokens > cap:
            raise ValueError(f"prompt + max_tokens ({len(prompt_ids) + params.max_tokens}) exceeds one replica's "
                             f"cache ({cap} tokens)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
                    replica: int | None = None) -> int:
        """Check and queue a request (offline use); it shares cached blocks only with requests of the
        same ``cache_salt``; ``replica``: the attention replica it must start on (cluster/pd.py)."""
        self.validate(prompt_ids, params)
        return self.admit(EngineRequest(tuple(prompt_ids), params, cache_salt, replica))

    def admit(self, request: EngineRequest) -> int:
        """Queue a request already checked by :meth:`validate` (the async engine checks on its
        caller's thread, so a bad request is refused before it is queued). Returns its sequence id."""
        seq = Seq(next(self._ids), list(request.prompt_ids), len(request.prompt_ids), request.params,
                  cache_salt=request.cache_salt, home=request.replica)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = Request(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Drop a request (e.g. its client went away); its cache is freed at once."""
        req = self.requests.pop(seq_id, None)
        if req is not None and req.seq.finish_reason is None:
            self.scheduler.finish(req.seq, "abort")

    def release(self, seq_id: int) -> Request | None:
        """Forget a finished request once its last tokens were delivered."""
        return self.requests.pop(seq_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def busy(self) -> bool:
        """Work queued or running, a step in flight, or KV tier writes waiting for a step to carry them."""
        return self.scheduler.has_work or bool(self.inflight) or self.scheduler.cache.tier_pending()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """One whole step, not pipelined: launch, finish, record (a step in flight is finished first)."""
        if not self.inflight and self.launch() is None:
            return []
        events = self.finish()
        self._record()
        return events

    def pipelined(self) -> list[StreamChunk]:
        """One turn of the pipelined loop (the async engine's and :meth:`generate`'s): finish the
        oldest step in flight (launched now if none is), with the next step sent ahead of its
        results where it can be (:meth:`launch_ahead`), else launched once they are applied; the
        finished step's statistics are recorded last, while the actors run the next one. Returns
        the finished step's events."""
        if not self.inflight and self.launch() is None:
            return []
        self.launch_ahead()
        events = self.finish()
        if not self.inflight and self.has_work:
            self.launch()
        self._record()
        return events

    def settle(self, deliver=None) -> list[StreamChunk]:
        """Finish every step in flight, launching none: a boundary where the actors run nothing the engine
        sent (cache blocks may be written from outside: cluster/pd.py). Each finished step's events go to
        ``deliver`` as they come (so a later step's failure loses none); else they are returned."""
        events = []
        while self.inflight:
            done = self.finish()
            self._record()
            if deliver is None:
                events += done
            else:
                for ev in done:
                    deliver(ev)
        return events

    def launch(self) -> Launched | None:
        """Schedule the next step and send it to the actors; None when there is nothing to run.
        Nothing may be in flight (a step boundary: an epoch change whose actors are ready happens
        here first)."""
        if self.inflight:
            raise RuntimeError("launch() with a step in flight: finish it first")
        self.epochs.advance()
        t0 = time.perf_counter()
        if self.tier is not None and self.scheduler.waiting:
            self.tier.before_schedule()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if plan.empty and not self.scheduler.cache.tier_pending():
            return None
        # (an empty step still carries the KV tier's writes: their holds end when it is back, which may be what a
        # waiting request needs room from)
        return self._send(plan, ahead=False, t_plan=t0)

    def launch_ahead(self) -> Launched | None:
        """Async scheduling: send the step after the one in flight before its results are back, so
        the actors find it queued when they finish and the engine's per-step work (results back,
        stop checks, scheduling) overlaps their compute. Only where that next step is known without
        those results: every sequence of the step in flight ends its known tokens there (so it
        decodes the token sampled there next: an :data:`AHEAD` token, read by the attention worker
        from its own last samples), none reaches its length limit there, its cache has room for
        one more token, no request waits to be admitted and no epoch change is pending. A sequence
        that stops at that step (a stop token or string) has its extra token dropped, so the
        streams are exactly those of the plain loop."""
        if (len(self.inflight) != 1 or not self.config.scheduler.async_scheduling or not self.epochs.settled
                or self.scheduler.waiting or self.scheduler.overdue):
            return None
        current = self.inflight[0]
        chunks = [c for replica in current.plan.chunks for c in replica]
        if not chunks or not all(c.sample and not c.draft for c in chunks):
            return None  # (a sequence with drafts: where its next token sits depends on how many are accepted)
        drafts = self.scheduler.drafts
        if drafts is not None and drafts.may_draft(
                [s for c in chunks if (s := self.scheduler.seqs.get(c.seq_id)) is not None]):
            return None  # speculation pauses async scheduling: the next step's drafts follow this one's tokens
        max_ctx, nxt = self.model_cfg.max_position_embeddings, []
        for c in chunks:
            seq = self.scheduler.seqs.get(c.seq_id)
            if seq is None:
                continue
            if len(seq.output_ids) + 1 >= seq.params.max_tokens or len(seq.token_ids) + 1 >= max_ctx:
                continue  # it ends at `current` by length
            nxt.append(seq)
        t0 = time.perf_counter()
        ahead = self.scheduler.decode_ahead(nxt, AHEAD) if nxt else None
        if ahead is None:
            return None
        plan = Plan([[] for _ in current.plan.chunks])
        for seq, chunk in zip(nxt, ahead):
            plan.chunks[seq.replica].append(chunk)
        return self._send(plan, ahead=True, t_plan=t0)

    def _send(self, plan: Plan, *, ahead: bool, t_plan: float) -> Launched:
        self.step_no += 1
        epoch = self.executor.table.epoch
        now = time.monotonic()
        for replica in plan.chunks:  # the request timings: first scheduled
            for c in replica:
                req = self.requests.get(c.seq_id)
                if req is not None and req.scheduled is None:
                    req.scheduled = now
        micro = self._micro_batches(plan.chunks)
        tokens = tuple(tuple(sum(len(c.token_ids) for c in groups[m]) for groups in micro)
                       for m in range(len(micro[0])))
        peers = tokens  # every worker (colocated) or attention actor sends and serves by every sender's count
        skip = self._skip_mtp(plan)
        cache = self.scheduler.cache
        tier = [cache.take_tier_writes(r) if cache.tiered else None for r in range(len(plan.chunks))]
        for r, out in enumerate(tier):
            if out is not None and self.tier is not None:
                self.tier.wrote(r, out.items)  # (the tier index: placement prefers the node that holds a prefix)
        reqs = [StepRequest(self.step_no, epoch, tuple(chunks), tuple(len(g) for g in groups), ahead,
                            self.scheduler.take_released(r), peer_tokens=peers, skip=skip,
                            tier_writes=tuple(out.items) if out is not None else ())
                for r, (chunks, groups, out) in enumerate(zip(plan.chunks, micro, tier))]
        self.stats.micro_batched_steps += len(tokens) > 1
        t1 = time.perf_counter()
        sent = self.executor.launch(reqs, ExpertStep(self.step_no, epoch, tokens, ahead, skip))
        self.stats.add_time(schedule=t1 - t_plan, launch=time.perf_counter() - t1)
        self.stats.ahead_steps += ahead
        launched = Launched(self.step_no, plan, sent, t1, self.executor.table, t_plan, ahead,
                            tuple(out for out in tier if out is not None))
        self.inflight.append(launched)
        return launched

    def _skip_mtp(self, plan: Plan) -> tuple[int, ...]:
        """The MTP layer runs where its guesses may be drafted next step: not in a step whose
        sequences the adaptive length gives no drafts (a large batch), which then costs what it
        costs without speculation. (Positions decoded then hold no MTP latents: later guesses attend
        over them as they are — drafts only, never outputs.)"""
        if not self.config.mtp:
            return ()
        seqs = [s for r in plan.chunks for c in r if (s := self.scheduler.seqs.get(c.seq_id)) is not None]
        return () if self.scheduler.drafts.may_draft(seqs) else (self.model_cfg.num_hidden_layers,)

    def finish(self) -> list[StreamChunk]:
        """Wait for the oldest step in flight and apply its tokens; its statistics wait for
        :meth:`_record` (the loops call it). A failed step is undone, with the step sent ahead of
        it, and the dead actors replaced (raises NoCapacity when that is impossible). After ``max_step_retries`` failed
        redos in a row the failed step's sequences are dropped instead (raises RequestsFailed)."""
        if not self.inflight:
            return []
        launched = self.inflight.popleft()
        t0 = time.perf_counter()
        try:
            attn, expert = self.executor.collect(launched.step, launched.sent)
            t_back = time.perf_counter()
            # the step's results into the scheduler; an answer that contradicts the step's drafts (an
            # actor's bug, a version skew) fails the step as a failed collective does
            update = self.scheduler.update(launched.plan, [t for r in attn for t in r.tokens])
        except StepFailed as failure:
            # a step sent ahead read this one's samples: it is undone too (its actors refuse it)
            failed = [s.plan for s in reversed(self.inflight)] + [launched.plan]
            for s in [launched, *self.inflight]:
                self._tier_done(s)
            self.inflight.clear()
            self._recover(failed, failure, launched.step)
            return []
        self.failed_in_a_row = 0
        self._tier_done(launched)
        t1 = time.perf_counter()
        if self.tier is not None:
            self.tier.observe(attn, launched.plan.num_tokens, t1 - launched.t0)
        if self.inflight:  # the step sent ahead could start only now: its time counts from here
            self.inflight[0] = dataclasses.replace(self.inflight[0], t0=max(self.inflight[0].t0, t1))
        if self.config.mtp:  # the MTP layer's guesses, for the next step's drafts (not of sequences ended)
            seqs = self.scheduler.seqs
            for r in attn:
                self.scheduler.drafts.drafter.record([d for d in r.drafts if d[0] in seqs])
        self._record()  # a step finished before without its statistics recorded (a caller's own loop)
        events = self._events(update.applied)
        if launched.plan.empty:  # a step that only carried KV tier writes: not a step of the statistics
            return events
        self.stats.observe_drafts(update.verified)
        self.stats.add_time(wait=t1 - t0, apply=time.perf_counter() - t1)
        stamps = None if launched.ahead else (launched.t_plan, launched.t0, t_back, t1)
        self._unrecorded = StepResults(launched.plan.num_tokens, attn, expert, t1 - launched.t0, launched.table,
                                    verifying=bool(update.verified), stamps=stamps)
        return events

    def _tier_done(self, launched: Launched) -> None:
        for out in launched.tier:  # its actors copied those blocks out as it began (or it failed): let them go
            self.scheduler.cache.tier_done(out)

    def publish(self) -> None:
        """Take the scheduler's snapshot for readers on other threads (``/metrics``, the queue check):
        the engine thread calls it between steps; nobody else reads the live scheduler."""
        self.snapshot = self.scheduler.snapshot()

    def _record(self) -> None:
        """The finished step's statistics: the router's counts, the engine's, the automatic policy."""
        done, self._unrecorded = self._unrecorded, None
        if done is None:
            return
        t0 = time.perf_counter()
        rec = StepRecord.of(done.tokens, done.attn, done.expert, done.step_s, done.table, done.stamps)
        if rec.expert_tokens is not None:
            self.router.report(rec.expert_tokens, rec.actor_tokens, epoch=rec.epoch)
            if done.verifying:
                self.stats.observe_verify_experts(rec.expert_tokens)
        self.stats.record_step(rec)
        self.epochs.auto_rebalance(self.stats.steps)
        self.stats.add_time(stats=time.perf_counter() - t0)

    def _micro_batches(self, chunks_per_replica: list[list]) -> list[list[list]]:
        """Each replica's chunks in M contiguous micro-batches of about equal tokens (M = 1 without
        ping-pong, or when no replica has two chunks); every replica gets M, some maybe empty."""
        M = self.config.data_plane.micro_batches if self.ping_pong else 1
        M = max(1, min(M, max(len(c) for c in chunks_per_replica)))
        out = []
        for chunks in chunks_per_replica:
            groups: list[list] = [[] for _ in range(M)]
            total, before = sum(len(c.token_ids) for c in chunks) or 1, 0
            for c in chunks:
                n = len(c.token_ids)
                groups[min(M - 1, int(M * (before + n / 2) / total))].append(c)
                before += n
            out.append(groups)
        return out

    def _events(self, applied: list[Applied]) -> list[StreamChunk]:
        """The tokens the scheduler applied, timed, as the streams' events."""
        events = []
        for seq, tok, reason in ((a.seq, a.token, a.reason) for a in applied):
            req = self.requests.get(seq.seq_id)
            now = time.monotonic()
            if req is not None:
                if req.first_token is None:
                    req.first_token = now
                    self.stats.observe_ttft(now - req.arrival)
                else:
                    self.stats.observe_itl(now - req.last_token)
                req.last_token = now
                if seq.params.logprobs is not None:
                    req.logprobs.append(tok)
                if reason:
                    scheduled = req.arrival if req.scheduled is None else req.scheduled
                    self.stats.observe_finished(now - req.arrival, seq, queue_s=scheduled - req.arrival,
                                                prefill_s=req.first_token - scheduled, decode_s=now - req.first_token)
            events.append(StreamChunk((tok.token_id,), reason, (tok,), seq.num_hit or 0, seq.seq_id))
        return events

    # ---- recovery (decided by the epoch owner) --------------------------------------------------
    def _recover(self, failed: list[Plan], failure: StepFailed, step: int) -> None:
        t0 = time.monotonic()
        queued = {s.seq_id for s in self.scheduler.waiting}  # (those queued again by this recovery are not)
        dead = self.epochs.recover([[c for chunks in p.chunks for c in chunks] for p in failed], failure)
        for kind, _ in dead:
            self.stats.observe_failure(kind)
        for kind, index in failure.hung:
            self.stats.observe_hang(kind, index, step)
        self.heal()
        again = [s for s in self.scheduler.waiting if s.seq_id not in queued and not s.is_refresh and not s.num_cached]
        if again and self.on_rewound is not None:
            try:
                self.on_rewound(self, again)
            except Exception:  # noqa: BLE001 — a helper's failure: the sequences are prefilled here, as without it
                logging.getLogger(__name__).exception("on_rewound failed; the sequences are re-prefilled here")
        self.stats.observe_recovery(time.monotonic() - t0)
        self.failed_in_a_row += 1
        if self.failed_in_a_row > self.config.faults.max_step_retries:
            self._give_up(failed, failure)

    def heal(self) -> None:
        """Replace the actors still missing after a failure; raises NoCapacity while there is no room."""
        self.epochs.heal()

    def _give_up(self, failed: list[Plan], failure: StepFailed) -> None:
        """The step failed ``failed_in_a_row`` times, each failure recovered: drop its sequences (the
        cluster itself is whole again) and raise RequestsFailed naming them and the last failure."""
        tries, self.failed_in_a_row = self.failed_in_a_row, 0
        ids = sorted({c.seq_id for plan in failed for chunks in plan.chunks for c in chunks})
        for seq_id in ids:
            self.abort(seq_id)
        raise RequestsFailed(f"the step failed {tries} times in a row, recovered each time, so its "
                             f"{len(ids)} sequence(s) were dropped; the last failure: {failure}", ids)

    # ---- epoch changes (the epoch owner's; these ask it) ----------------------------------------
    def begin_scale_experts(self, n: int) -> Transition:
        """Start moving to ``n`` expert actors; it completes at a later step boundary."""
        self._disaggregated("experts")
        return self.epochs.begin("experts", num_actors=n)

    def begin_scale_attention(self, n: int) -> Transition:
        self._disaggregated("attention")
        return self.epochs.begin("attention", num_attention=n)

    def _disaggregated(self, kind: str) -> None:
        if self.table.colocated:
            raise ValueError(f"scale {kind} is for the disaggregated layout; this engine is colocated: scale "
                             f"workers (each an attention replica and an expert shard)")

    def begin_scale_workers(self, n: int) -> Transition:
        """The colocated layout: move to ``n`` workers (attention replicas and expert shards together)."""
        if not self.table.colocated:
            raise ValueError("scale workers is for the colocated layout; this engine is disaggregated (scale "
                             "attention or experts)")
        return self.epochs.begin("workers", num_attention=n, num_actors=n)

    def begin_rebalance(self, redundant_slots: int | None = None) -> Transition:
        """Re-place experts over the same actors from the router's window of token counts, with
        ``redundant_slots`` copies of hot experts per MoE layer (default: the configured number)."""
        return self.epochs.begin("rebalance", redundant_slots=redundant_slots)

    def scale_experts(self, n: int) -> EpochChange:
        return self.wait(self.begin_scale_experts(n))

    def scale_attention(self, n: int) -> EpochChange:
        return self.wait(self.begin_scale_attention(n))

    def scale_workers(self, n: int) -> EpochChange:
        return self.wait(self.begin_scale_workers(n))

    def rebalance(self, redundant_slots: int | None = None) -> EpochChange:
        return self.wait(self.begin_rebalance(redundant_slots))

    def advance(self) -> None:
        """A step boundary with nothing to run: commit the epoch change in progress if it is ready."""
        self.epochs.advance()

    def wait(self, t: Transition) -> EpochChange:
        """Run steps (when there is work) until ``t`` has happened, then finish the steps in flight;
        for callers that own the step loop (their streams' events of these steps are not returned)."""
        while not t.done.done():
            if self.busy:  # a change pends: nothing is sent ahead, so the loop reaches a step boundary
                self.pipelined()
            else:
                self.advance()
                time.sleep(0.01)
        while self.inflight:
            self.finish()
            self._record()
        return t.done.result()

    # ---- offline use --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 cache_salt: str | None = None) -> list[Seq]:
        """Run requests to completion (offline use and tests), pipelined like the async engine."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, cache_salt) for p, sp in zip(prompts, plist)]
        while self.busy:
            self.pipelined()
        return [self.release(i).seq for i in ids]

    def status(self) -> dict:
        """Plain data for ``/status`` (call on the engine thread; the async engine's ``control``)."""
        sched, stats = self.scheduler, self.stats
        t = self.epochs.transition
        return {"table": self.table, "changes": [c.as_dict() for c in self.epochs.changes],
                "changing": t is not None, "change": self.executor.progress(t.prepared) if t else None,
                "ping_pong": self.ping_pong,
                "running": len(sched.running), "waiting": len(sched.waiting) + len(sched.parked), "steps": stats.steps,
                "failures": dict(stats.actor_failures), "recoveries_s": list(stats.recoveries),
                "hangs": dict(stats.actor_hangs),
                "last_hang": dataclasses.asdict(stats.last_hang) if stats.last_hang else None,
                "breakdown": dict(stats.breakdown), "profile": dict(stats.profile),
                "compile": {"mode": self.config.data_plane.compile, **stats.compiled},
                "actor_tokens": self.router.actor_totals(),
                "cache": [(a.num_held, a.num_blocks) for a in sched.cache.blocks],
                "sequences": [sched.load(r) for r in range(len(sched.cache.blocks))],
                "prefix_cache": sched.cache_status(),
                "kv_tier": self.tier.status() if self.tier is not None else None,
                "speculative": speculative_status(self.config.speculative, self.stats),
                "actors": self.executor.describe()}
