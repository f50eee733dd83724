"""The engine: one per model deployment. Turns a :class:`ClusterSpec` into running actors, then
runs the step loop — scheduler plan → one message per actor (its step channel) → sampled tokens → stop checks.

Owns: the scheduler, per-request state, the step statistics and the epoch change in progress;
its actors through one seam, :class:`~cluster.workers.WorkerGroup`. It is the only component the
Serve ingress talks to (through :mod:`cluster.aengine`). Epoch changes (scale experts or
attention, rebalance) begin at once and happen at the first step boundary where their actors are
ready (:meth:`Engine.advance`), so requests keep streaming while new actors load.
Never: computes a layer or moves a token between actors (the attention workers' process group
does), builds a placement table (the Router does), or waits on an actor without a timeout.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from actors.messages import AHEAD, ExpertStep, PlacementTable, SampledToken, StepRequest
from model.config import ModelConfig, load_config
from model.runner import check_stop
from model.sampling import SamplingParams

from .config import EngineConfig
from .scheduler import Plan, Scheduler, Seq
from .stats import EngineStats
from .topology import ClusterSpec
from .workers import EngineError, EpochChange, NoCapacity, RequestsFailed, StepFailed, Transition, WorkerGroup

__all__ = ["Engine", "EngineConfig", "EngineError", "EpochChange", "NoCapacity", "Request", "RequestsFailed",
           "TokenEvent", "Transition"]


@dataclass
class Request:
    seq: Seq
    stop_ids: frozenset[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None


@dataclass(frozen=True)
class Launched:
    """A step sent to the actors and not yet finished."""

    step: int
    plan: object  # the scheduler's Plan
    sent: list  # where it went: (actor name, member), from WorkerGroup.launch
    t0: float
    table: PlacementTable  # the epoch it ran in (its statistics are laid out by it)


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request after a step."""

    seq_id: int
    token_ids: tuple[int, ...]
    sampled: tuple[SampledToken, ...]
    finish_reason: str | None


class Engine:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, *, stop_ids: frozenset[int] = frozenset()):
        self.config, self.spec = config, spec
        self.cfg: ModelConfig = load_config(config.model)
        if self.cfg.n_routed_experts == 0:
            raise ValueError(f"{config.model}: the model has no routed experts to place on expert actors")
        if spec.attention < 1 or not 1 <= spec.experts <= self.cfg.n_routed_experts:
            raise ValueError(f"expert actors must be in 1..{self.cfg.n_routed_experts} (the routed experts) and "
                             f"attention replicas >= 1, got {spec.experts} and {spec.attention}")
        self.model_stop_ids = frozenset(stop_ids) | frozenset(self.cfg.eos_token_ids)
        self.scheduler = Scheduler(
            num_replicas=spec.attention, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_slots if self.cfg.kda_layers else None,
            max_num_seqs=config.max_num_seqs, max_tokens_per_step=config.max_tokens_per_step)
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats(self.cfg.moe_layers, self.cfg.n_routed_experts)
        self._ids = itertools.count()
        self.step_no = 0
        self.workers = WorkerGroup(config, spec, self.cfg)
        self.transition: Transition | None = None
        self.changes: list[EpochChange] = []  # every epoch change so far, oldest first
        self._last_auto = time.monotonic()
        self.unrecovered: list[tuple[str, int]] | None = None  # dead actors not yet replaced (no capacity)
        self.ping_pong = config.ping_pong  # may be switched between steps
        self._ahead: Launched | None = None  # the step sent ahead of the one being finished
        self._unrecorded = None  # the statistics of the last finished step, until record()
        self._unreported, self._unreported_steps = None, 0  # counts not yet sent to the router
        self.failed_in_a_row = 0  # steps failed (and recovered) since the last one that completed

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self.workers.started:
            raise RuntimeError("engine already started")
        self.workers.start()
        return self

    def shutdown(self) -> None:
        if self.transition is not None:
            self.workers.abort(self.transition)
            self._finish_transition(EngineError("the engine shut down during the epoch change"))
        self.workers.shutdown()

    def expert_weight_bytes(self, timeout_s: float = 15.0) -> list[int]:
        """Resident weight bytes of each expert actor (checkpoint bytes + scales when quantised)."""
        w = self.workers
        return w._get([m.actor.weight_bytes.remote() for m in w.experts], timeout_s, "weight bytes")

    def __enter__(self) -> "Engine":
        return self if self.workers.started else self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def table(self) -> PlacementTable:
        """The current epoch's placement, as the Router published it."""
        return self.workers.table

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        V, ctx = self.cfg.vocab_size, self.cfg.max_position_embeddings
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < V)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary (0..{V - 1})")
        if len(prompt_ids) + params.max_tokens > ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context ({ctx})")
        cap = self.config.num_blocks * self.config.block_size
        if len(prompt_ids) + params.max_tokens > cap:
            raise ValueError(f"prompt + max_tokens ({len(prompt_ids) + params.max_tokens}) exceeds one replica's "
                             f"cache ({cap} tokens)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        self.validate(prompt_ids, params)
        seq = Seq(next(self._ids), list(prompt_ids), len(prompt_ids), params)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = Request(seq, self.model_stop_ids)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Drop a request (e.g. its client went away); its cache is freed at once."""
        req = self.requests.pop(seq_id, None)
        if req is not None and req.seq.finish_reason is None:
            self.scheduler.finish(req.seq, "abort")

    def release(self, seq_id: int) -> Request | None:
        """Forget a finished request once its last tokens were delivered (``requests`` has this one
        writer: the engine)."""
        return self.requests.pop(seq_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One whole step: launch, finish, record (the async engine interleaves these: it launches the
        next step before recording and delivering this one)."""
        events = self.finish(self.launch())
        self.record()
        return events

    def launch(self) -> Launched | None:
        """Schedule the next step and send it to the actors (it runs while the caller does other
        work); None when there is nothing to run. Nothing may be in flight: a step sent ahead
        (:meth:`launch_ahead`) is finished first."""
        if self._ahead is not None:
            raise RuntimeError("launch() while a step sent ahead is in flight: finish it first")
        self.advance()  # a step boundary: an epoch change whose actors are ready happens here
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if plan.empty:
            return None
        return self._send(plan, ahead=False, t_plan=t0)

    def _send(self, plan: Plan, *, ahead: bool, t_plan: float) -> Launched:
        self.step_no += 1
        micro = self._micro_batches(plan.chunks)
        reqs = [StepRequest(self.step_no, self.table.epoch, tuple(chunks), tuple(len(g) for g in groups), ahead)
                for chunks, groups in zip(plan.chunks, micro)]
        tokens = tuple(tuple(sum(len(c.token_ids) for c in groups[m]) for groups in micro)
                       for m in range(len(micro[0])))
        self.stats.micro_batched_steps += len(tokens) > 1
        t1 = time.perf_counter()
        sent = self.workers.launch(reqs, ExpertStep(self.step_no, self.table.epoch, tokens, ahead))
        self.stats.add_time(schedule=t1 - t_plan, launch=time.perf_counter() - t1)
        self.stats.ahead_steps += ahead
        return Launched(self.step_no, plan, sent, t1, self.table)

    def launch_ahead(self, current: Launched | None) -> Launched | None:
        """Async scheduling: send the step after ``current`` before ``current``'s results are back,
        so the actors find it queued when they finish and the engine's and Ray's per-step work
        (results back, stop checks, scheduling, the next call) overlaps their compute. Only where
        that next step is known without those results: every sequence of ``current`` ends its known
        tokens there (so it decodes the token sampled there next: an :data:`AHEAD` token, read by
        the attention worker from its own last samples), none reaches its length limit there, its
        cache has room for one more token, no request waits to be admitted and no epoch change is
        pending. A sequence that stops at ``current`` (a stop token or string) has its extra token
        dropped, so the streams are exactly those of the plain loop. :meth:`take_ahead` hands it on."""
        if (current is None or not self.config.async_scheduling or self._ahead is not None
                or self.transition is not None or self.unrecovered is not None or self.scheduler.waiting):
            return None
        chunks = [c for replica in current.plan.chunks for c in replica]
        if not chunks or not all(c.sample for c in chunks):
            return None
        max_ctx, nxt = self.cfg.max_position_embeddings, []
        for c in chunks:
            req = self.requests.get(c.seq_id)
            if req is None or req.seq.finish_reason is not None:
                continue
            seq = req.seq
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
        launched = self._send(plan, ahead=True, t_plan=t0)
        self._ahead = launched
        return launched

    def take_ahead(self) -> Launched | None:
        """The step :meth:`launch_ahead` sent (None if none), now the next one to finish."""
        launched, self._ahead = self._ahead, None
        return launched

    def pipelined(self, launched: Launched | None) -> tuple[list[TokenEvent], Launched | None]:
        """One turn of the pipelined loop (the async engine's and :meth:`generate`'s): finish
        ``launched`` (or a step launched now), the next step sent ahead of its results where it can
        be, else launched once they are applied. Returns the finished step's events and the step now
        in flight; its statistics wait for :meth:`record`."""
        current = launched or self.launch()
        self.launch_ahead(current)
        events = self.finish(current)
        nxt = self.take_ahead()
        if nxt is None and self.has_work:
            nxt = self.launch()
        return events, nxt

    def finish(self, launched: Launched | None) -> list[TokenEvent]:
        """Wait for a launched step and apply its tokens (stop checks); its statistics wait for
        :meth:`record`. A failed step is undone, with the step sent ahead of it, and the dead actors
        replaced (raises NoCapacity when that is impossible). After ``max_step_retries`` failed
        redos in a row the failed step's sequences are dropped instead (raises RequestsFailed)."""
        if launched is None:
            return []
        t0 = time.perf_counter()
        try:
            attn, expert = self.workers.collect(launched.step, launched.sent)
        except StepFailed as failure:
            plans = [launched.plan]
            if self._ahead is not None:  # it read this step's samples: undone too (its actors refuse it)
                plans.insert(0, self.take_ahead().plan)
            self._recover(plans, failure)
            self.failed_in_a_row += 1
            if self.failed_in_a_row > self.config.max_step_retries:
                self._give_up(plans, failure)
            return []
        self.failed_in_a_row = 0
        t1 = time.perf_counter()
        if self._ahead is not None:  # its actors could start it only now: its time counts from here
            self._ahead = dataclasses.replace(self._ahead, t0=max(self._ahead.t0, t1))
        events = self._apply([t for r in attn for t in r.tokens])
        self.stats.add_time(wait=t1 - t0, apply=time.perf_counter() - t1)
        self._unrecorded = (launched.plan.num_tokens, attn, expert, t1 - launched.t0, launched.table)
        return events

    def record(self) -> None:
        """The finished step's statistics: the router's window, metrics, the automatic policy."""
        if self._unrecorded is None:
            return
        t0 = time.perf_counter()
        tokens, attn, expert, step_s, table = self._unrecorded  # the next step may be in a new epoch already
        self._unrecorded = None
        self.stats.record_step(tokens, attn, expert, step_s, table)
        if self.stats.last_expert_tokens is not None:
            step = self.stats.last_expert_tokens
            self._unreported = step if self._unreported is None else self._unreported + step
            self._unreported_steps += 1
            if self._unreported_steps >= self.config.report_every_steps:
                self._report()
        self._auto_rebalance()
        self.stats.add_time(stats=time.perf_counter() - t0)

    def _report(self) -> None:
        """Send the router the token counts of the steps since the last report (one Ray call)."""
        if self._unreported is not None:
            self.workers.report(self._unreported, self._unreported_steps)
        self._unreported, self._unreported_steps = None, 0

    def _micro_batches(self, chunks_per_replica: list[list]) -> list[list[list]]:
        """Each replica's chunks in M contiguous micro-batches of about equal tokens (M = 1 without
        ping-pong, or when no replica has two chunks); every replica gets M, some maybe empty."""
        M = self.config.micro_batches if self.ping_pong else 1
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

    # ---- recovery -------------------------------------------------------------------------------
    def _recover(self, plans: list, failure: StepFailed) -> None:
        """An actor died or a collective failed: undo the failed step (and one sent ahead of it,
        first) in the scheduler, replace the dead actors in a recovery epoch, and let the next step
        redo the work. Raises NoCapacity (the engine is then unavailable until :meth:`heal` succeeds)."""
        t0 = time.monotonic()
        dead = sorted(set(failure.dead) | set(self.workers.lost()))  # and those dying with their node
        for kind, _ in dead:
            self.stats.observe_failure(kind)
        if self.transition is not None:  # the change in progress is off; its requester hears why
            self.workers.abort(self.transition)
            self._finish_transition(EngineError(f"the epoch change was interrupted: {failure}"))
        self._undo(plans, {i for kind, i in dead if kind == "attention"})
        self.unrecovered = dead
        self.heal()
        self.stats.observe_recovery(time.monotonic() - t0)

    def _give_up(self, plans: list, failure: StepFailed) -> None:
        """The step failed ``failed_in_a_row`` times, each failure recovered: drop its sequences (the
        cluster itself is whole again) and raise RequestsFailed naming them and the last failure."""
        tries, self.failed_in_a_row = self.failed_in_a_row, 0
        ids = sorted({c.seq_id for plan in plans for chunks in plan.chunks for c in chunks})
        for seq_id in ids:
            self.abort(seq_id)
        raise RequestsFailed(f"the step failed {tries} times in a row, recovered each time, so its "
                             f"{len(ids)} sequence(s) were dropped; the last failure: {failure}", ids)

    def _undo(self, plans: list, dead_replicas: set[int]) -> None:
        """Make the scheduler state what it was before the failed steps (``plans``, newest first).
        Latent-cache writes are idempotent (a retry rewrites the same positions with the same
        values), so MLA-only models just recompute the steps' tokens; a KDA state update is not
        (layers before the failure already advanced it), so on hybrid models the steps' sequences
        are re-prefilled from zero, as are all sequences of a dead attention replica (their cache is
        gone)."""
        by_id = {s.seq_id: s for s in self.scheduler.running}
        redo = [s for s in self.scheduler.running if s.replica in dead_replicas]
        for plan in plans:
            for c in (c for chunks in plan.chunks for c in chunks):
                seq = by_id.get(c.seq_id)
                if seq is None or seq in redo:
                    continue
                if self.cfg.kda_layers:
                    redo.append(seq)
                else:
                    seq.num_cached -= len(c.token_ids)
        self.scheduler.requeue(sorted(redo, key=self.scheduler.running.index))

    def heal(self) -> None:
        """Replace the actors still missing after a failure; raises NoCapacity while there is no room."""
        if self.unrecovered is None:
            return
        change = self.workers.recover(self.unrecovered)
        self.unrecovered = None
        self.changes.append(change)
        self.stats.observe_epoch(change.epoch, change.pause_s)

    # ---- epoch changes ------------------------------------------------------------------------
    def begin_scale_experts(self, n: int) -> Transition:
        """Start moving to ``n`` expert actors; it completes at a later step boundary."""
        return self._begin("experts", num_actors=n)

    def begin_scale_attention(self, n: int) -> Transition:
        return self._begin("attention", num_attention=n)

    def begin_rebalance(self, redundant_slots: int | None = None) -> Transition:
        """Re-place experts over the same actors from the router's window of token counts, with
        ``redundant_slots`` copies of hot experts per MoE layer (default: the configured number)."""
        r = self.config.redundant_slots if redundant_slots is None else redundant_slots
        return self._begin("rebalance", redundant_slots=r)

    def scale_experts(self, n: int) -> EpochChange:
        return self.wait(self.begin_scale_experts(n))

    def scale_attention(self, n: int) -> EpochChange:
        return self.wait(self.begin_scale_attention(n))

    def rebalance(self, redundant_slots: int | None = None) -> EpochChange:
        return self.wait(self.begin_rebalance(redundant_slots))

    def wait(self, t: Transition) -> EpochChange:
        """Run steps (when there is work) until ``t`` has happened; for callers that own the step loop."""
        while not t.done.done():
            if self.has_work:
                self.step()
            else:
                self.advance()
                time.sleep(0.01)
        return t.done.result()

    def advance(self) -> None:
        """Commit the epoch change in progress if its actors are ready (call at step boundaries)."""
        t = self.transition
        if t is None:
            return
        try:
            if not self.workers.ready(t):
                return
        except EngineError as e:  # the new actors never came up: the change is off, serving goes on
            self._finish_transition(e)
            return
        try:
            moved = self.scheduler.resize(t.table.num_attention) if t.table.num_attention < t.old.num_attention else []
            change = self.workers.commit(t, moved=len(moved))
            if t.table.num_attention > t.old.num_attention:
                self.scheduler.resize(t.table.num_attention)
        except BaseException as e:  # the old group is gone: fatal until recovery exists (issue 9)
            self._finish_transition(e)
            raise
        self.changes.append(change)
        self.stats.observe_epoch(change.epoch, change.pause_s)
        self._finish_transition(change)

    def _begin(self, kind: str, **shape) -> Transition:
        if self.transition is not None:
            raise ValueError(f"epoch {self.transition.table.epoch} is still being applied; retry when it is done")
        self._report()  # the router proposes from every step's counts
        self.transition = self.workers.begin(kind, **shape)
        return self.transition

    def _finish_transition(self, outcome) -> None:
        t, self.transition = self.transition, None
        if t is not None and not t.done.done():
            if isinstance(outcome, BaseException):
                t.done.set_exception(outcome)
            else:
                t.done.set_result(outcome)

    def _auto_rebalance(self) -> None:
        """The automatic policy (off by default): every window of steps, rebalance when the measured
        imbalance passed the threshold and the last change is old enough."""
        c = self.config
        if not c.auto_rebalance or self.transition is not None or self.stats.steps % c.window_steps:
            return
        imbalance = self.stats.actor_imbalance(c.window_steps)
        if imbalance and sum(imbalance) / len(imbalance) > c.rebalance_threshold and \
                time.monotonic() - self._last_auto >= c.rebalance_interval_s:
            self._last_auto = time.monotonic()
            self.begin_rebalance()

    def _apply(self, sampled: list[SampledToken]) -> list[TokenEvent]:
        events = []
        max_ctx = self.cfg.max_position_embeddings
        for tok in sampled:
            req = self.requests.get(tok.seq_id)
            if req is None or req.seq.finish_reason is not None:  # aborted meanwhile
                continue
            seq = req.seq
            seq.token_ids.append(tok.token_id)
            now = time.monotonic()
            if req.first_token is None:
                req.first_token = now
                self.stats.observe_ttft(now - req.arrival)
            else:
                self.stats.observe_itl(now - req.last_token)
            req.last_token = now
            if seq.params.logprobs is not None:
                req.logprobs.append(tok)
            reason = check_stop(seq, req.stop_ids, max_ctx)
            if reason:
                self.scheduler.finish(seq, reason)
                self.stats.observe_finished(time.monotonic() - req.arrival, seq)
            events.append(TokenEvent(seq.seq_id, (tok.token_id,), (tok,), reason))
        return events

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Seq]:
        """Run requests to completion (offline use and tests), pipelined like the async engine: each
        step is sent ahead of the last one's results where it can be (:meth:`launch_ahead`)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        launched = None
        while self.has_work or launched is not None:
            _, launched = self.pipelined(launched)
            self.record()
        return [self.release(i).seq for i in ids]
