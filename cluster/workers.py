"""The worker group: the engine's one seam to its actors (ARCHITECTURE.md "Engine", "Scaling").

Owns: the placement reservations and the bundles in them, the attention and expert actors, the
Router actor, the rendezvous and process group of the current epoch, and epoch changes in
progress (:class:`Transition`). The engine asks it to ``step`` and to change shape; the Router
decides the next table; this class carries it out:

1. ``begin_*`` (no pause): the router proposes the next table; new actors are created in free
   bundles or a new reservation on nodes with room, and load their experts in their constructors;
   kept expert actors stage their new slots in their ``control`` concurrency group. Steps go on.
2. ``commit`` (the pause, at a step boundary, once everything is staged): every actor of the new
   epoch leaves the old process group and joins a new one on a fresh rendezvous; retired actors
   are killed and their bundles freed; the router publishes the table.

Never: decides which sequences run (the scheduler does), or waits on an actor without a timeout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.channel import TOKEN_BYTES, ChannelClosed, StepChannel, StepError
from actors.group import NCCL_ENV
from actors.messages import ExpertStep, GroupInfo, PlacementTable, StepRequest
from actors.remote import RemoteAttention, RemoteExpert, RemoteRouter
from actors.router import Proposal
from model.config import ModelConfig

from .config import EngineConfig
from .preflight import preflight
from .startup import default_load_timeout_s
from .topology import ClusterSpec, Kind, Reservation, ReservationTimeoutError, remove_orphans, reserve


class EngineError(RuntimeError):
    """The cluster failed: an actor died, a collective timed out, or a step got no answer."""


class StepFailed(EngineError):
    """A step failed. ``dead``: the members that died or never answered (to replace); the others
    answered, possibly with an exchange error, and only need a new process group."""

    def __init__(self, message: str, dead: list[tuple[str, int]]):
        super().__init__(message)
        self.dead = dead  # (kind, index) with kind "attention" or "expert"


class RequestsFailed(EngineError):
    """The same work failed step after step although every failure was recovered (the actors
    replaced or regrouped each time): its sequences ``seq_ids`` are dropped with this error, so that
    work that fails every time (a bug an input meets, say) ends instead of being retried for ever."""

    def __init__(self, message: str, seq_ids: list[int]):
        super().__init__(message)
        self.seq_ids = seq_ids


class NoCapacity(EngineError):
    """Recovery needs a replacement actor that the cluster has no room for right now."""


@dataclass
class Home:
    """A reserved bundle: bundle ``index`` of ``kind`` in ``reservation``."""

    reservation: Reservation
    kind: Kind
    index: int


@dataclass
class Member:
    """One actor of the group, the bundle it sits in, and its step channel (opened when it first
    joins a process group)."""

    actor: Any  # a Ray ActorHandle
    home: Home
    channel: StepChannel | None = None


@dataclass(frozen=True)
class EpochChange:
    """What one epoch change did: the report of ``moeray scale`` / ``moeray rebalance``."""

    epoch: int
    kind: str  # "experts" | "attention" | "rebalance"
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
    attention: list[Member]  # the new epoch's members, in rank order
    experts: list[Member]
    retired: list[Member]
    reservations: list[Reservation]  # made for this change
    pending: list  # ObjectRefs: new actors' start-up, then kept experts' staging
    staging: list = field(default_factory=list)  # ObjectRefs of the staging alone: experts read each
    started: float = field(default_factory=time.monotonic)
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @property
    def table(self) -> PlacementTable:
        return self.proposal.table


class WorkerGroup:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, cfg: ModelConfig):
        self.config, self.spec, self.cfg = config, spec, cfg
        self.path = str(Path(config.model).resolve())
        self.backend = config.backend or ("nccl" if spec.gpus else "gloo")
        self.load_timeout_s = config.load_timeout_s or default_load_timeout_s(cfg, spec.attention)
        self.router = None
        self.table: PlacementTable | None = None
        self.attention: list[Member] = []
        self.experts: list[Member] = []
        self.spare: list[Home] = []  # bundles of retired actors, reused before reserving more
        self.standby: list[Member] = []  # warm actors in no process group, each ready to take a dead one's index
        self.reservations: list[Reservation] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        c, spec = self.config, self.spec
        if c.owner:
            remove_orphans(c.owner)
        preflight(self.cfg, spec, c.dtype)  # refuse a shape this cluster cannot hold, before reserving
        res = self._reserve(spec, c.start_timeout_s)
        self.reservations.append(res)
        try:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.router = RemoteRouter.options(scheduling_strategy=here).remote(  # dies only with the engine's node
                self.cfg.n_routed_experts, self.cfg.moe_layers, window_steps=c.window_steps)
            table = self._get(self.router.initial.remote(spec.attention, spec.experts), c.start_timeout_s,
                              "the router's first table")
            self.attention = [self._new_attention(Home(res, "attention", i), table, i) for i in range(spec.attention)]
            self.experts = [self._new_expert(Home(res, "expert", j), table, j) for j in range(spec.experts)]
            self._form_group(table, self.attention, self.experts, "joining the process group")
            self.table = table
            self._start_standbys(c.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        for m in self.attention + self.experts + self.standby:
            _retire(m)
        if self.router is not None:
            _kill(self.router)
        self.attention, self.experts, self.router, self.spare, self.standby = [], [], None, [], []
        for res in self.reservations:
            res.release()
        self.reservations = []

    @property
    def started(self) -> bool:
        return bool(self.attention)

    def node_ip(self, member: Member) -> str:
        return member.home.reservation.node_ip_of(member.home.kind, member.home.index)

    # ---- the step --------------------------------------------------------------------------
    def launch(self, reqs: list[StepRequest], expert_req: ExpertStep) -> list[tuple[str, Member]]:
        """Send one step over every actor's step channel (:mod:`actors.channel`; no Ray call);
        :meth:`collect` waits for it. Returns where it went: (actor name, member) in rank order."""
        assert len(reqs) == len(self.attention), f"{len(reqs)} step requests for {len(self.attention)} attention actors"
        members = self.attention + self.experts
        for m, req in zip(members, list(reqs) + [expert_req] * len(self.experts)):
            if m.channel is not None:  # None: an actor retired by a recovery that found no room (collect says so)
                m.channel.send(expert_req.step, req)
        return list(zip(_names(len(self.attention), len(self.experts)), members))

    def collect(self, step_no: int, sent: list[tuple[str, Member]]) -> tuple[list, list]:
        """The results of a launched step. Raises :class:`StepFailed` once every actor has answered
        or been given up on, naming the dead (closed channel, node gone) and stuck (no answer)
        actors to replace; the others only need a new process group. After the first failure the
        others get until the collective timeout (and 5 s) from then: a peer of a dead actor answers
        when its exchange times out."""
        deadline = time.monotonic() + self.config.step_timeout_s
        grace = None
        results, dead, causes = [], [], []
        for name, member in sent:
            try:
                if member.channel is None:
                    raise ChannelClosed(f"{name} has no step channel")
                results.append(member.channel.recv(step_no, deadline, alive=lambda m=member: _node_reachable(m.home)))
                continue
            except StepError as e:
                causes.append(f"{name}: {str(e).splitlines()[0]}")
            except TimeoutError:
                dead.append(name)
                causes.append(f"{name} did not answer")
            except ChannelClosed:
                dead.append(name)
                causes.append(f"{name} died")
            if grace is None:
                grace = time.monotonic() + self.config.collective_timeout_s + 5
                deadline = max(deadline, grace)
        if causes:
            kinds = [("attention" if n.startswith("attention") else "expert", int(n.split("[")[1][:-1]))
                     for n in dead]
            raise StepFailed(f"step {step_no} failed: {'; '.join(causes[:4])}", kinds)
        return results[: len(self.attention)], results[len(self.attention):]

    def report(self, expert_tokens, steps: int) -> None:
        self.router.report.remote(expert_tokens, steps)  # fire and forget: off the hot path

    # ---- epoch changes -----------------------------------------------------------------------
    def begin(self, kind: str, *, num_attention: int | None = None, num_actors: int | None = None,
              redundant_slots: int | None = None) -> Transition:
        """Start an epoch change; returns at once. Raises ValueError for a shape the router refuses."""
        old = self.table
        ref = self.router.propose.remote(num_attention=num_attention, num_actors=num_actors,
                                         redundant_slots=redundant_slots)
        try:
            proposal = ray.get(ref, timeout=self.config.step_timeout_s)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (ValueError, RuntimeError)):  # a shape the router refuses: the user's to fix
                raise ValueError(str(e.cause)) from None
            raise EngineError(f"the router's proposal: {e}") from None
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            raise EngineError(f"the router's proposal: {e}") from None
        table = proposal.table
        t = Transition(kind, proposal, old, self.attention[: table.num_attention], self.experts[: table.num_actors],
                       self.attention[table.num_attention:] + self.experts[table.num_actors:], [], [])
        try:
            homes = self._homes("attention", table.num_attention - len(t.attention), t)
            t.attention += [self._new_attention(h, table, len(t.attention) + i) for i, h in enumerate(homes)]
            homes = self._homes("expert", table.num_actors - len(t.experts), t)
            t.experts += [self._new_expert(h, table, len(t.experts) + i) for i, h in enumerate(homes)]
            new = t.attention[old.num_attention:] + t.experts[old.num_actors:]
            t.staging = [m.actor.prepare.options(concurrency_group="control").remote(table, j)
                         for j, m in enumerate(t.experts[: old.num_actors])
                         if table.experts_of(j) != old.experts_of(j)]
            t.pending = [m.actor.node_id.remote() for m in new] + t.staging  # node_id: done once constructed
        except BaseException:
            self.abort(t)
            raise
        return t

    def ready(self, t: Transition) -> bool:
        """True once every new actor started and every kept one staged its weights. Raises
        EngineError (after aborting the change) when one failed or the start timeout passed."""
        done, _ = ray.wait(t.pending, num_returns=len(t.pending), timeout=0)
        if len(done) == len(t.pending):
            try:
                self._get(t.pending, self.config.step_timeout_s, f"preparing epoch {t.table.epoch}")
            except EngineError:
                self.abort(t)
                raise
            return True
        if time.monotonic() - t.started > self.config.start_timeout_s:
            self.abort(t)
            raise EngineError(f"epoch {t.table.epoch}: the new actors were not ready within "
                              f"{self.config.start_timeout_s:.0f}s")
        return False

    def commit(self, t: Transition, moved: int = 0) -> EpochChange:
        """At a step boundary, after ``ready``: switch every actor to the new epoch."""
        t0 = time.monotonic()
        try:
            loaded = sum(self._get(t.staging, self.config.step_timeout_s, "staged weights"))
            t1 = time.monotonic()
            self._form_group(t.table, t.attention, t.experts, f"entering epoch {t.table.epoch}")
            regroup = time.monotonic() - t1
        except BaseException:
            self.abort(t)
            raise
        for m in t.retired:
            _retire(m)
            self.spare.append(m.home)
        self.attention, self.experts = t.attention, t.experts
        self.table = self._get(self.router.commit.remote(t.table.epoch), self.config.step_timeout_s, "publishing")
        self._release_unused()
        pause = time.monotonic() - t0
        p = t.proposal
        return EpochChange(t.table.epoch, t.kind, t.old.shape(), t.table.shape(), pause, regroup, t0 - t.started,
                           loaded, moved, p.imbalance_before, p.imbalance_after)

    def abort(self, t: Transition) -> None:
        """Undo a change that did not happen: kill the actors it made, free their bundles."""
        for m in t.attention[t.old.num_attention:] + t.experts[t.old.num_actors:]:
            _retire(m)
            if m.home.reservation not in t.reservations:
                self.spare.append(m.home)
        for res in t.reservations:
            res.release()
            self.reservations.remove(res)
        try:
            self.router.abort.remote(t.table.epoch)
        except Exception:  # noqa: BLE001 — the router is gone too; shutdown follows
            pass

    # ---- recovery ----------------------------------------------------------------------------
    def lost(self) -> list[tuple[str, int]]:
        """Members whose node stopped answering. (An actor can answer a failed step with an exchange
        error just before it dies with its node: it is dead all the same.)"""
        reachable = _reachable_nodes()
        return [(kind, i) for kind, members in (("attention", self.attention), ("expert", self.experts))
                for i, m in enumerate(members) if not _node_reachable(m.home, reachable)]

    def recover(self, dead: list[tuple[str, int]], *, reserve_timeout_s: float = 10.0) -> EpochChange:
        """A recovery epoch (an epoch change nobody asked for): the same shape and placement, each
        dead actor replaced at its index — by a warm standby when one is up, else by a new actor in
        its own bundle while its node answers, else in a new reservation on a node with room
        (:class:`NoCapacity` when there is none) — and every actor in a new process group. Survivors
        keep their weights, caches and KDA state. Then the standby pool is refilled (not waited for)."""
        t0 = time.monotonic()
        old = self.table
        proposal = self._get(self.router.propose.remote(), self.config.step_timeout_s, "the recovery table")
        table = proposal.table
        attention, experts = list(self.attention), list(self.experts)
        made: list[Member] = []
        freed: list[Home] = []
        dead = sorted(set(dead) | set(self.lost()))
        try:
            for kind, i in dead:
                members = attention if kind == "attention" else experts
                _retire(members[i])
                freed.append(members[i].home)
                members[i] = self._take_standby(kind) or self._replacement(kind, members[i].home, table, i,
                                                                            reserve_timeout_s)
                made.append(members[i])
            t1 = time.monotonic()
            self._form_group(table, attention, experts, f"entering recovery epoch {table.epoch}")
            regroup = time.monotonic() - t1
        except BaseException:
            for m in made:
                _retire(m)
            self.router.abort.remote(table.epoch)
            raise
        self.attention, self.experts = attention, experts
        self.table = self._get(self.router.commit.remote(table.epoch), self.config.step_timeout_s, "publishing")
        in_use = {id(m.home) for m in attention + experts}  # a replacement can sit in its predecessor's bundle
        self.spare += [h for h in freed if id(h) not in in_use and _node_reachable(h)]
        took = time.monotonic() - t0
        self._refill_standbys(min(reserve_timeout_s, 2.0))  # off the step path but for a new reservation
        self._release_unused()
        loaded = sum(len(ids) for kind, j in dead if kind == "expert" for ids in table.experts_of(j).values())
        return EpochChange(table.epoch, "recovery", old.shape(), table.shape(), took, regroup, 0.0, loaded,
                           replace_s=t1 - t0)

    def _replacement(self, kind: Kind, home: Home, table: PlacementTable, index: int, timeout_s: float) -> Member:
        """A started new actor for a dead one: in ``home`` (the dead one's bundle) while its node answers,
        else in a fresh home. The node can be found dead only now (the GCS marks a node dead seconds
        after it stopped answering): then once more in a fresh home. Never waits on a dead node."""
        new = self._new_attention if kind == "attention" else self._new_expert
        if not _node_reachable(home):
            home = self._fresh_home(kind, timeout_s)
        for attempt in range(2):
            member = new(home, table, index)
            state = self._await_start(member, self.config.start_timeout_s)
            if state == "started":
                return member
            _retire(member)
            if state == "timeout":
                raise NoCapacity(f"no node has room for a replacement {kind} actor: it did not start within "
                                 f"{self.config.start_timeout_s:.0f}s")
            if attempt == 0:
                home = self._fresh_home(kind, timeout_s)
        raise NoCapacity(f"no node has room for a replacement {kind} actor: the node it was placed on is gone too")

    def _await_start(self, member: Member, timeout_s: float) -> str:
        """Wait until ``member``'s actor is constructed: "started"; "dead" when it died or the node of
        its bundle stopped answering; "timeout". Checks the node every second."""
        ref = member.actor.node_id.remote()
        deadline = time.monotonic() + timeout_s
        while True:
            done, _ = ray.wait([ref], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            if done:
                try:
                    ray.get(ref)
                    return "started"
                except ray.exceptions.RayActorError:
                    return "dead"
            if not _node_reachable(member.home):
                return "dead"
            if time.monotonic() >= deadline:
                return "timeout"

    def _fresh_home(self, kind: Kind, timeout_s: float) -> Home:
        """A bundle in a new reservation, on a node that answers (a dead node may still be listed alive)."""
        spec = dataclasses.replace(self.spec, attention=1 if kind == "attention" else 0,
                                   experts=1 if kind == "expert" else 0)
        try:
            res = self._reserve(spec, timeout_s, exclude=_unreachable_nodes())
        except (ReservationTimeoutError, ValueError) as e:  # ValueError: a pinned node is gone
            raise NoCapacity(f"no node has room for a replacement {kind} actor: {str(e).splitlines()[0]}") from None
        self.reservations.append(res)
        return Home(res, kind, 0)

    # ---- standbys ----------------------------------------------------------------------------
    def _start_standbys(self, timeout_s: float) -> None:
        """Reserve the configured standbys' bundles (raises like a reservation of the shape does) and
        start them; their start-up is not waited for."""
        c = self.config
        if c.standby_attention + c.standby_experts == 0:
            return
        spec = dataclasses.replace(self.spec, attention=c.standby_attention, experts=c.standby_experts)
        try:
            res = self._reserve(spec, timeout_s)
        except ReservationTimeoutError as e:
            raise ReservationTimeoutError(f"no room for the standby actors (standby_attention={c.standby_attention}, "
                                          f"standby_experts={c.standby_experts}) beside the shape: {e}") from None
        self.reservations.append(res)
        homes = [Home(res, "attention", i) for i in range(c.standby_attention)]
        homes += [Home(res, "expert", j) for j in range(c.standby_experts)]
        self.standby += [self._new_standby(h) for h in homes]

    def _new_standby(self, home: Home) -> Member:
        new = self._new_attention if home.kind == "attention" else self._new_expert
        return new(home, self.table, None)

    def _take_standby(self, kind: Kind) -> Member | None:
        """A started standby of ``kind`` out of the pool; None when none is (dead ones are dropped)."""
        while pool := [m for m in self.standby if m.home.kind == kind]:
            member = pool[0]
            self.standby.remove(member)
            if self._await_start(member, self.config.start_timeout_s) == "started":
                return member
            _retire(member)
        return None

    def _refill_standbys(self, timeout_s: float) -> None:
        """Start standbys until the pool is full: in free bundles whose node answers, else in a new
        reservation (bounded by ``timeout_s``; without room the pool stays short until the next
        recovery). The new actors' start-up is not waited for."""
        c = self.config
        for kind, want in (("attention", c.standby_attention), ("expert", c.standby_experts)):
            for _ in range(want - sum(m.home.kind == kind for m in self.standby)):
                home = next((h for h in self.spare if h.kind == kind and _node_reachable(h)), None)
                if home is not None:
                    self.spare.remove(home)
                else:
                    try:
                        home = self._fresh_home(kind, timeout_s)
                    except NoCapacity:
                        break
                self.standby.append(self._new_standby(home))

    # ---- helpers -------------------------------------------------------------------------------
    def _homes(self, kind: Kind, count: int, t: Transition) -> list[Home]:
        """``count`` bundles for new actors of ``kind``: spare ones first, then one new reservation."""
        if count <= 0:
            return []
        reuse = [h for h in self.spare if h.kind == kind][:count]
        for h in reuse:
            self.spare.remove(h)
        more = count - len(reuse)
        if more == 0:
            return reuse
        spec = dataclasses.replace(self.spec, attention=more if kind == "attention" else 0,
                                   experts=more if kind == "expert" else 0)
        try:
            res = self._reserve(spec, self.config.start_timeout_s)
        except BaseException:
            self.spare += reuse
            raise
        self.reservations.append(res)
        t.reservations.append(res)
        return reuse + [Home(res, kind, i) for i in range(more)]

    def _reserve(self, spec: ClusterSpec, timeout_s: float, exclude: frozenset[str] = frozenset()) -> Reservation:
        name = f"{self.config.owner}/{len(self.reservations)}" if self.config.owner else ""
        return reserve(spec, timeout_s=timeout_s, name=name, exclude=exclude)

    def _release_unused(self) -> None:
        """Release reservations none of whose bundles hold a live actor (or a standby) any more."""
        live = {id(m.home.reservation) for m in self.attention + self.experts + self.standby}
        for res in [r for r in self.reservations if id(r) not in live]:
            res.release()
            self.reservations.remove(res)
            self.spare = [h for h in self.spare if h.reservation is not res]

    def _options(self, opts: dict) -> dict:
        """An actor's Ray options; on NCCL with the environment that makes a dead peer abortable."""
        return {**opts, "runtime_env": {"env_vars": dict(NCCL_ENV)}} if self.backend == "nccl" else opts

    def _new_attention(self, home: Home, table: PlacementTable, index: int) -> Member:
        c = self.config
        opts = self._options(home.reservation.attention_options(home.index))
        actor = RemoteAttention.options(**opts).remote(
            self.path, index=index, table=table, num_blocks=c.num_blocks, block_size=c.block_size,
            num_slots=c.num_slots, dtype=c.dtype, impl=c.impl, exchange=c.exchange, threads=c.actor_threads)
        return Member(actor, home)

    def _new_expert(self, home: Home, table: PlacementTable, index: int) -> Member:
        opts = self._options(home.reservation.expert_options(home.index))
        return Member(RemoteExpert.options(**opts).remote(self.path, index=index, table=table, dtype=self.config.dtype,
                                                          exchange=self.config.exchange,
                                                          threads=self.config.actor_threads,
                                                          expert_threads=self.config.expert_threads), home)

    def _form_group(self, table: PlacementTable, attention: list[Member], experts: list[Member], what: str) -> None:
        c = self.config
        # the first answers from new actors wait for their weights to load
        addr, port = self._get(attention[0].actor.rendezvous.remote(), self.load_timeout_s, f"{what}: rendezvous")
        info = GroupInfo(epoch=table.epoch, address=addr, port=port, backend=self.backend,
                         timeout_s=c.collective_timeout_s, transport=c.transport)
        refs = [m.actor.enter_epoch.remote(info, table, i) for i, m in enumerate(attention)]
        refs += [m.actor.enter_epoch.remote(info, table, j) for j, m in enumerate(experts)]
        names = _names(len(attention), len(experts))
        self._get(refs, self.load_timeout_s, what, names=names)
        self._open_channels(attention + experts, names, what)

    def _open_channels(self, members: list[Member], names: list[str], what: str) -> None:
        """Connect a step channel to each member that has none yet (new actors, standbys taking a
        dead one's place): the actor listens on its node, the token keeps anyone else out."""
        for m, name in zip(members, names):
            if m.channel is not None:
                m.channel.name = m.channel.link.label = name  # its index may have changed with the epoch
        fresh = [(m, n) for m, n in zip(members, names) if m.channel is None]
        tokens = [secrets.token_bytes(TOKEN_BYTES) for _ in fresh]
        where = self._get([m.actor.open_channel.remote(t) for (m, _), t in zip(fresh, tokens)],
                          self.config.step_timeout_s, f"{what}: opening step channels", names=[n for _, n in fresh])
        for (m, name), address, token in zip(fresh, where, tokens):
            try:  # the actor listens already: a reachable one connects at once
                m.channel = StepChannel(name, tuple(address), token, self.config.step_timeout_s,
                                        connect_timeout_s=min(30.0, self.config.step_timeout_s))
            except OSError as e:
                raise EngineError(f"{what}: cannot connect the step channel of {name} at "
                                  f"{address[0]}:{address[1]}: {e}") from None

    def _get(self, refs, timeout: float, what: str, names: list[str] | None = None):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            refs_list = refs if isinstance(refs, list) else [refs]
            _, pending = ray.wait(refs_list, num_returns=len(refs_list), timeout=0)
            names = names or (_names(len(self.attention), len(self.experts))
                              if len(refs_list) == len(self.attention) + len(self.experts) else None)
            who = ([n for n, r in zip(names, refs_list) if r in pending] if names
                   else [f"{len(pending)} of {len(refs_list)} actors"])
            raise EngineError(f"{what}: no answer within {timeout:.0f}s from {', '.join(who)}") from None
        except ray.exceptions.RayTaskError as e:
            raise EngineError(f"{what}: {e.cause if e.cause is not None else e}") from None
        except ray.exceptions.RayActorError as e:
            raise EngineError(f"{what}: an actor died: {e}") from None


def _names(num_attention: int, num_experts: int) -> list[str]:
    return [f"attention[{i}]" for i in range(num_attention)] + [f"expert[{j}]" for j in range(num_experts)]


def _node_reachable(home: Home, reachable: frozenset[str] | None = None) -> bool:
    """The node of ``home``'s bundle is alive in the GCS and its raylet accepts a connection. (The GCS
    marks a node dead only seconds after it stopped answering; a refused connection tells at once.)"""
    try:
        node = home.reservation.node_of(home.kind, home.index)
    except (KeyError, IndexError):  # the bundle is not placed (its node is gone)
        return False
    return node in (_reachable_nodes() if reachable is None else reachable)


def _reachable_nodes() -> frozenset[str]:
    return frozenset(n["NodeID"] for n in ray.nodes() if n["Alive"] and _raylet_answers(n))


def _raylet_answers(node: dict, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


def _unreachable_nodes() -> frozenset[str]:
    """Nodes the GCS still lists alive whose raylet does not answer."""
    return frozenset(n["NodeID"] for n in ray.nodes() if n["Alive"] and not _raylet_answers(n))


def _retire(member: Member) -> None:
    """Close ``member``'s step channel and kill its actor."""
    if member.channel is not None:
        member.channel.close()
        member.channel = None
    _kill(member.actor)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 — already gone
        pass
