"""Epochs: the one owner of shape changes — scaling expert actors or attention replicas,
rebalancing experts, recovering from a failed step, and the automatic rebalance policy.

An epoch is one placement table and one process group. A change asked for (scale, rebalance)
goes in two halves: :meth:`Epochs.begin` has the router propose the next table and the executor
prepare the new actors while steps go on; :meth:`Epochs.advance`, called by the engine at every
step boundary, commits it once everything is ready (the pause). A change nobody asked for —
recovery — happens at once inside the failed step's :meth:`Epochs.recover`: the scheduler rewinds
the failed steps, the dead actors are replaced at their indices in a recovery epoch, and the next
step redoes the work.

Owns: the change in progress (:class:`Transition`), the changes so far, the dead actors not yet
replaced (``unrecovered``), the automatic policy's clock.
Never: builds a table (the router does), creates or kills an actor (the executor does), assigns
a sequence's fields (the scheduler rewinds them), or records statistics (the engine does, from
what these methods return).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.messages import PlacementTable, SeqChunk
from actors.router import Proposal, Router

from .config import EngineConfig
from .errors import EngineError, StepFailed
from .executor import Executor, MemberId
from .scheduler import Scheduler


@dataclass(frozen=True)
class EpochChange:
    """What one epoch change did: the report of ``moeray scale`` / ``moeray rebalance``."""

    epoch: int
    kind: str  # "experts" | "attention" | "workers" | "rebalance" | "recovery"
    old_shape: str
    new_shape: str
    pause_s: float  # no steps ran for this long (the commit at the step boundary)
    regroup_s: float  # of the pause: leaving the old process group and joining the new one
    prepare_s: float  # creating actors and staging weights, while steps went on
    experts_loaded: int  # (layer, expert) weights read from the checkpoint by kept actors
    moved_sequences: int = 0  # sequences re-prefilled on another attention replica
    imbalance_before: tuple[float, ...] = ()  # per MoE layer, max/mean tokens per expert actor
    imbalance_after: tuple[float, ...] = ()
    replace_s: float = 0.0  # recovery: until the dead actors' replacements (standbys or new actors) had started

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Transition:
    """An epoch change in progress; ``done`` resolves with the :class:`EpochChange` at commit."""

    kind: str
    proposal: Proposal
    old: PlacementTable
    prepared: Any  # the executor's handle of the actors being prepared
    started: float = field(default_factory=time.monotonic)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @property
    def table(self) -> PlacementTable:
        return self.proposal.table


class Epochs:
    def __init__(self, config: EngineConfig, executor: Executor, router: Router, scheduler: Scheduler, *,
                 recompute_state: bool, on_change: Callable[[EpochChange], None] = lambda change: None):
        self.config, self.executor, self.router, self.scheduler = config, executor, router, scheduler
        self.recompute_state = recompute_state  # KDA layers: a failed step's state update cannot be redone in place
        self.on_change = on_change  # told of every change before its requester hears (the engine records it)
        self._heal_tries = 0  # heal() calls since the failure (a retry probes every member's node again)
        self.transition: Transition | None = None
        self.changes: list[EpochChange] = []  # every epoch change so far, oldest first
        self.unrecovered: list[MemberId] | None = None  # dead actors not yet replaced (no capacity)
        self._last_auto = time.monotonic()

    @property
    def settled(self) -> bool:
        """No change in progress and nothing left to recover (a step may be sent ahead)."""
        return self.transition is None and self.unrecovered is None

    # ---- changes asked for -----------------------------------------------------------------
    def begin(self, kind: str, *, num_attention: int | None = None, num_actors: int | None = None,
              redundant_slots: int | None = None) -> Transition:
        """Start an epoch change; it completes at a later step boundary (:meth:`advance`). Raises
        ValueError for a shape the router refuses, or while another change is in progress."""
        if self.transition is not None:
            raise ValueError(f"epoch {self.transition.table.epoch} is still being applied; retry when it is done")
        if kind == "rebalance" and redundant_slots is None:
            redundant_slots = self.config.elastic.redundant_slots
        started = time.monotonic()
        try:
            proposal = self.router.propose(num_attention=num_attention, num_actors=num_actors,
                                           redundant_slots=redundant_slots)
        except RuntimeError as e:  # a change the router cannot make now: the caller's to retry
            raise ValueError(str(e)) from None
        try:
            prepared = self.executor.prepare(kind, proposal.table)
        except BaseException:
            self.router.abort(proposal.table.epoch)
            raise
        self.transition = Transition(kind, proposal, self.executor.table, prepared, started)
        return self.transition

    def advance(self) -> EpochChange | None:
        """At a step boundary: commit the change in progress if its actors are ready; returns it."""
        t = self.transition
        if t is None:
            return None
        try:
            if not self.executor.ready(t.prepared):
                return None
        except EngineError as e:  # the new actors never came up: the change is off, serving goes on
            self._end(e)
            return None
        t0 = time.monotonic()
        shrink = t.table.num_attention < t.old.num_attention
        moved = self.scheduler.resize(t.table.num_attention) if shrink else []
        try:
            regroup, loaded = self.executor.commit(t.prepared)
        except EngineError as e:  # an actor died while the group re-formed: the change is off, recover
            self._end(EngineError(f"the epoch change was interrupted while the group re-formed: {e}"))
            if shrink:
                self.scheduler.resize(t.old.num_attention)
            dead = self.executor.failed_members()
            self.scheduler.rewind([], _attention_replicas(dead), recompute_state=self.recompute_state)
            self.unrecovered, self._heal_tries = dead, 0
            self.heal()  # the old shape in a recovery epoch (raises NoCapacity without room)
            return None
        except BaseException as e:
            self._end(e)
            raise
        if not shrink:
            self.scheduler.resize(t.table.num_attention)
        self.router.commit(t.table.epoch)
        p = t.proposal
        change = EpochChange(t.table.epoch, t.kind, t.old.shape(), t.table.shape(), time.monotonic() - t0, regroup,
                             t0 - t.started, loaded, len(moved), p.imbalance_before, p.imbalance_after)
        self._record(change)
        self._end(change)
        return change

    def abort(self, why: BaseException) -> None:
        """Give up the change in progress (the engine shuts down, or a step failed): its requester hears ``why``."""
        t = self.transition
        if t is not None:
            try:
                self.executor.abort(t.prepared)
            finally:
                self.router.abort(t.table.epoch)
                self._end(why)

    def _end(self, outcome) -> None:
        t, self.transition = self.transition, None
        if t is not None and not t.done.done():
            if isinstance(outcome, BaseException):
                self.router.abort(t.table.epoch)
                t.done.set_exception(outcome)
            else:
                t.done.set_result(outcome)

    # ---- recovery --------------------------------------------------------------------------
    def recover(self, failed: list[list[SeqChunk]], failure: StepFailed) -> list[MemberId]:
        """A step failed (an actor died, a collective failed): give up the change in progress,
        rewind the failed steps' chunks (``failed``, newest step first) in the scheduler and mark
        the dead actors — those the failure names and those that died with their nodes, the nodes
        of the failed members probed once — for :meth:`heal`, which the engine calls next. Returns
        the dead."""
        suspects = sorted(set(failure.dead) | set(failure.errored))
        dead = sorted(set(failure.dead) | set(self.executor.lost(suspects)))
        self.abort(EngineError(f"the epoch change was interrupted: {failure}"))
        self.scheduler.rewind(failed, _attention_replicas(dead), recompute_state=self.recompute_state)
        self.unrecovered, self._heal_tries = dead, 0
        return dead

    def heal(self) -> EpochChange | None:
        """Replace the actors still missing after a failure; raises NoCapacity while there is no room."""
        if self.unrecovered is None:
            return None
        t0 = time.monotonic()
        old = self.executor.table
        self._heal_tries += 1
        if self._heal_tries > 1:  # a retry, after a wait for room: more may have died with their nodes since
            if old.colocated:
                everyone = [("worker", i) for i in range(old.num_actors)]
            else:
                everyone = [("attention", i) for i in range(old.num_attention)]
                everyone += [("expert", j) for j in range(old.num_actors)]
            self.unrecovered = sorted(set(self.unrecovered) | set(self.executor.lost(everyone)))
        table = self.router.propose().table
        try:
            replace_s, regroup_s, loaded = self.executor.replace(self.unrecovered, table)
        except BaseException:
            self.router.abort(table.epoch)
            raise
        self.router.commit(table.epoch)
        self.unrecovered = None
        change = EpochChange(table.epoch, "recovery", old.shape(), table.shape(), time.monotonic() - t0, regroup_s,
                             0.0, loaded, replace_s=replace_s)
        self._record(change)
        return change

    def _record(self, change: EpochChange) -> None:
        self.changes.append(change)
        self.on_change(change)

    # ---- the automatic policy --------------------------------------------------------------
    def auto_rebalance(self, steps: int) -> Transition | None:
        """Every window of steps, begin a rebalance when the measured imbalance (the router's max/mean
        tokens per expert actor, per MoE layer) passed the threshold and the last change is old enough."""
        c = self.config
        if not c.elastic.auto_rebalance or self.transition is not None or steps % c.elastic.rebalance_window_steps:
            return None
        imbalance = self.router.measured_imbalance()
        if imbalance and sum(imbalance) / len(imbalance) > c.elastic.rebalance_threshold and \
                time.monotonic() - self._last_auto >= c.elastic.rebalance_interval_s:
            self._last_auto = time.monotonic()
            return self.begin("rebalance")
        return None


def _attention_replicas(dead: list[MemberId]) -> set[int]:
    """The attention replicas among dead members (a colocated worker is one, with its cache)."""
    return {i for kind, i in dead if kind in ("attention", "worker")}
