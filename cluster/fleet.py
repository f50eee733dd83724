"""The fleet: the actors of one engine and the Ray resources they sit in.

Owns: the attention and expert actors (in rank order) — in the colocated layout the workers, each
an attention replica and an expert shard in one process, held as the attention members — and their
step channels, and the process group of the current epoch; through its parts, the placement reservations and the spare bundles
in them (:class:`~cluster.homes.Homes`) and the warm standbys (:class:`~cluster.standbys.Standbys`).
It creates every actor, and carries out what :mod:`cluster.epochs` decides — new actors for a
shape change (:meth:`Fleet.prepare` … :meth:`Fleet.commit`), replacements after a failure
(:meth:`Fleet.replace`) — and answers liveness probes, each about one member's node.
Never: decides which shape comes next (the router proposes, the epoch owner decides), sends a
step (the executor does, over the channels opened here), or waits on an actor without a timeout.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from pathlib import Path

import ray

from actors.channel import TOKEN_BYTES, StepChannel
from actors.group import NCCL_ENV
from actors.messages import GroupInfo, PlacementTable
from actors.remote import RemoteAttention, RemoteExpert, RemoteWorker
from model.config import ModelConfig

from .config import EngineConfig, compiled, snapshot_plan
from .errors import EngineError, NoCapacity
from .kv_transfer import tier_spec
from .executor import MemberId, member_names, parse_name
from .homes import Homes
from .members import Home, Member, Prepared, kill_actor, retire
from .preflight import preflight
from .probes import node_of, node_reachable
from .standbys import Standbys
from .startup import default_load_timeout_s
from .topology import ClusterSpec, Kind, Reservation, remove_orphans

# How much longer than one collective a new group's rendezvous waits for its last member: a survivor
# may still be in the last step, which waits up to the collective timeout on a dead peer, and a new
# actor may be starting on a loaded node (a 5 s collective timeout alone was seen to time out there).
JOIN_SLACK_S = 30.0

class Fleet:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, model_cfg: ModelConfig):
        self.config, self.spec, self.model_cfg = config, spec, model_cfg
        self.path = str(Path(config.model).resolve())
        self.backend = config.data_plane.backend or ("nccl" if spec.gpus else "gloo")
        self.load_timeout_s = config.faults.load_timeout_s or default_load_timeout_s(model_cfg, spec.attention)
        self.table: PlacementTable | None = None
        self.colocated = spec.colocated  # workers: the attention members, each holding an expert shard too
        self.attention: list[Member] = []
        self.experts: list[Member] = []  # empty in the colocated layout
        self.homes = Homes(config, spec)  # the reservations and their spare bundles
        self.standbys = Standbys(config, spec, self.homes, self._new_member, self._await_start)  # the warm pool

    # the parts' lists, read as the fleet's (describe, tests, benches); only the parts change them
    @property
    def reservations(self) -> list[Reservation]:
        return self.homes.reservations

    @property
    def spare(self) -> list[Home]:  # bundles of retired actors, reused before reserving more
        return self.homes.spare

    @property
    def standby(self) -> list[Member]:  # warm actors in no process group, each ready to take a dead one's index
        return self.standbys.members

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, table: PlacementTable) -> None:
        c, spec = self.config, self.spec
        if c.owner:
            remove_orphans(c.owner)
        preflight(self.model_cfg, spec, c.dtype, c)  # refuse a shape this cluster cannot hold, before reserving
        res = self.homes.reserve(spec, c.faults.start_timeout_s)
        try:
            self.attention = [self._new_attention(Home(res, "attention", i), table, i) for i in range(spec.attention)]
            self.experts = [self._new_expert(Home(res, "expert", j), table, j) for j in range(spec.experts)]
            self._form_group(table, self.attention, self.experts, "joining the process group")
            self.table = table
            self.standbys.start(table, c.faults.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        for m in self.attention + self.experts:
            retire(m)
        self.attention, self.experts = [], []
        self.standbys.retire_all()
        self.homes.release_all()

    @property
    def started(self) -> bool:
        return bool(self.attention)

    def node_ip(self, member: Member) -> str:
        home = member.home
        if home.ip is None:
            home.ip = home.reservation.node_ip_of(home.kind, home.index)
        return home.ip

    def reachable(self, member: Member) -> bool:
        """``member``'s node answers (its raylet alone is probed)."""
        return node_reachable(member.home)

    def unresponsive(self, members: list[tuple[str, Member]], timeout_s: float) -> list[tuple[str, Member]]:
        """Of ``members`` (name, member), those whose process does not answer a heartbeat within
        ``timeout_s`` (asked all at once, on Ray's thread of each actor). A dead one raises and is
        not listed: its channel tells."""
        if not members:
            return []
        refs = [m.actor.heartbeat.remote() for _, m in members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        answered = set(ready)
        return [(n, m) for (n, m), ref in zip(members, refs) if ref not in answered]

    def names(self, attention: int | None = None, experts: int | None = None) -> list[str]:
        """The members' names in rank order (``attention[i]``, ``expert[j]``; colocated: ``worker[i]``)."""
        attention = len(self.attention) if attention is None else attention
        experts = len(self.experts) if experts is None else experts
        return [f"worker[{i}]" for i in range(attention)] if self.colocated else member_names(attention, experts)

    def failed_members(self, timeout_s: float) -> list[MemberId]:
        """Members whose actor died or does not answer a heartbeat within ``timeout_s``."""
        named = list(zip([parse_name(n) for n in self.names()], self.attention + self.experts))
        refs = [m.actor.heartbeat.remote() for _, m in named]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for (who, _), ref in zip(named, refs):
            if ref not in ready:
                out.append(who)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                out.append(who)
        return out

    def break_exchanges(self, members: list[Member]) -> None:
        """Have these live actors close their exchange sockets (fire and forget), so their steps blocked
        on a hung peer fail now rather than when that peer's process is gone."""
        for m in members:
            m.actor.break_exchange.remote()

    def kill_member(self, member: Member) -> None:
        """Kill a member's actor at once (a hung one); its step channel and bundle stay until recovery
        replaces it."""
        kill_actor(member.actor)

    # ---- operations ------------------------------------------------------------------------
    def kill(self, kind: str, index: int) -> str:
        """Fault injection (``moeray chaos``): ``ray.kill`` one actor; ValueError for no such actor."""
        kinds = ("worker",) if self.colocated else ("attention", "expert")
        if kind not in kinds:
            raise ValueError(f"there is no {kind} actor in the {'colocated' if self.colocated else 'disaggregated'} "
                             f"layout: kill one of {', '.join(kinds)}")
        members = self.experts if kind == "expert" else self.attention
        if not 0 <= index < len(members):
            raise ValueError(f"there is no {kind}[{index}]: the app has {len(members)}")
        ray.kill(members[index].actor, no_restart=True)
        return f"{kind}[{index}]"

    def describe(self) -> dict:
        """Where the actors are (node addresses, looked up once per bundle), and each expert actor's
        resident weight bytes as futures (the Ray calls are sent here; whoever reads them waits, with
        its own timeout)."""
        experts = self.attention if self.colocated else self.experts  # a worker holds its shard
        return {"layout": "colocated" if self.colocated else "disaggregated",
                "attention": [{"node": self.node_ip(m)} for m in self.attention],
                "experts": [{"node": self.node_ip(m)} for m in experts],
                "standby": len(self.standby),
                "weight_bytes": [m.actor.weight_bytes.remote().future() for m in experts]}

    # ---- shape changes -----------------------------------------------------------------------
    def prepare(self, kind: str, table: PlacementTable) -> Prepared:
        """Start what ``table`` needs beside the running epoch: new actors in spare bundles or a new
        reservation (loading their weights in their constructors), kept expert actors staging their
        new slots in their ``control`` concurrency group. Returns at once."""
        old = self.table
        waits = not self._check_room(table)
        p = Prepared(kind, table, old, self.attention[: table.num_attention], self.experts[: table.num_actors],
                     self.attention[table.num_attention:] + self.experts[table.num_actors:], [], [],
                     waits_for_capacity=waits)
        try:
            homes = self.homes.for_change("attention", table.num_attention - len(p.attention), p)
            p.attention += [self._new_attention(h, table, len(p.attention) + i) for i, h in enumerate(homes)]
            if not self.colocated:
                homes = self.homes.for_change("expert", table.num_actors - len(p.experts), p)
                p.experts += [self._new_expert(h, table, len(p.experts) + i) for i, h in enumerate(homes)]
            new = p.attention[old.num_attention:] + p.experts[old.num_actors:]
            holders = p.attention if self.colocated else p.experts  # the kept members holding shards
            p.staging = [m.actor.prepare.options(concurrency_group="control").remote(table, j)
                         for j, m in enumerate(holders[: old.num_actors])
                         if table.experts_of(j) != old.experts_of(j)]
            p.pending = [m.actor.node_id.remote() for m in new] + p.staging  # node_id: done once constructed
        except BaseException:
            self.abort(p)
            raise
        return p

    def _check_room(self, table: PlacementTable) -> bool:
        """Refuse at once (PreflightError, a ValueError: the caller's to fix) a shape the cluster could
        never hold — the whole new shape against its total resources and the planner's bytes — and new
        actors that its free resources cannot place now, unless ``capacity_wait_s`` says to wait for
        room (then False: ask for it without waiting; True: there is room now)."""
        experts = 0 if self.colocated else table.num_actors
        grown = dataclasses.replace(self.spec, attention=table.num_attention, experts=experts)
        preflight(self.model_cfg, grown, self.config.dtype, self.config)
        return self.homes.room(table.num_attention - len(self.attention), experts - len(self.experts))

    def ready(self, p: Prepared) -> bool:
        """True once every new actor started and every kept one staged its weights. Raises
        EngineError (after aborting the change) when one failed or the start timeout passed."""
        done, _ = ray.wait(p.pending, num_returns=len(p.pending), timeout=0)
        if len(done) == len(p.pending):
            try:
                self._get(p.pending, self.config.faults.step_timeout_s, f"preparing epoch {p.table.epoch}")
            except EngineError:
                self.abort(p)
                raise
            return True
        waited = time.monotonic() - p.started
        if p.waits_for_capacity and not all(r.created() for r in p.reservations):
            if waited > self.config.faults.capacity_wait_s:
                self.abort(p)
                raise EngineError(f"epoch {p.table.epoch}: no room for the new actors appeared within "
                                  f"capacity_wait_s ({self.config.faults.capacity_wait_s:g}s); the change is off")
        elif waited > self.config.faults.start_timeout_s + (self.config.faults.capacity_wait_s if p.waits_for_capacity else 0):
            self.abort(p)
            raise EngineError(f"epoch {p.table.epoch}: the new actors were not ready within "
                              f"{self.config.faults.start_timeout_s:.0f}s")
        return False

    def progress(self, p: Prepared) -> dict:
        """Where a change being prepared stands (for /status)."""
        waiting = p.waits_for_capacity and not all(r.created() for r in p.reservations)
        return {"epoch": p.table.epoch, "kind": p.kind, "for_s": round(time.monotonic() - p.started, 1),
                "state": "waiting for capacity" if waiting else "starting actors"}

    def commit(self, p: Prepared) -> tuple[float, int]:
        """At a step boundary, after ``ready``: every actor of the new epoch joins a new process
        group; retired actors are killed and their bundles kept as spares. (regroup s, experts loaded)."""
        try:
            loaded = sum(self._get(p.staging, self.config.faults.step_timeout_s, "staged weights"))
            t1 = time.monotonic()
            self._form_group(p.table, p.attention, p.experts, f"entering epoch {p.table.epoch}")
            regroup = time.monotonic() - t1
        except BaseException:
            self.abort(p)
            raise
        for m in p.retired:
            retire(m)
            self.homes.keep([m.home])
        self.attention, self.experts, self.table = p.attention, p.experts, p.table
        self.homes.release_unused(self.attention + self.experts + self.standby)
        return regroup, loaded

    def abort(self, p: Prepared) -> None:
        """Undo a change that did not happen: kill the actors it made, free their bundles."""
        for m in p.attention[p.old.num_attention:] + p.experts[p.old.num_actors:]:
            retire(m)
            if m.home.reservation not in p.reservations:
                self.homes.keep([m.home])
        self.homes.release(p.reservations)

    # ---- recovery ----------------------------------------------------------------------------
    def lost(self, suspects: list[MemberId]) -> list[MemberId]:
        """Members on the nodes of ``suspects`` that stopped answering (each such node probed once).
        An actor can answer a failed step with an exchange error just before it dies with its node."""
        members = {parse_name(n): m for n, m in zip(self.names(), self.attention + self.experts)}
        down: dict[str, bool] = {}
        for who in suspects:
            m = members.get(who)
            if m is not None:
                down.setdefault(node_of(m.home), not node_reachable(m.home))
        return sorted(who for who, m in members.items() if down.get(node_of(m.home), False))

    def replace(self, dead: list[MemberId], table: PlacementTable, *,
                reserve_timeout_s: float = 10.0) -> tuple[float, float, int]:
        """A recovery epoch (``table``: the same shape and placement, a new epoch): each dead actor
        replaced at its index — by a warm standby when one is up, else by a new actor in its own
        bundle while its node answers, else in a new reservation on a node with room
        (:class:`NoCapacity` when there is none) — and every actor in a new process group.
        Survivors keep their weights, caches and KDA state. Then the standby pool is refilled (not
        waited for). Returns (seconds to replace, seconds to regroup, experts loaded)."""
        t0 = time.monotonic()
        attention, experts = list(self.attention), list(self.experts)
        made: list[Member] = []
        freed: list[Home] = []
        try:
            for kind, i in dead:
                members = experts if kind == "expert" else attention  # a worker sits in an attention bundle
                home_kind = "expert" if kind == "expert" else "attention"
                retire(members[i])
                freed.append(members[i].home)
                members[i] = self.standbys.take(home_kind) or self._replacement(home_kind, members[i].home, table, i,
                                                                                reserve_timeout_s)
                made.append(members[i])
            t1 = time.monotonic()
            self._form_group(table, attention, experts, f"entering recovery epoch {table.epoch}")
            regroup = time.monotonic() - t1
        except BaseException:
            for m in made:
                retire(m)
            raise
        self.attention, self.experts, self.table = attention, experts, table
        in_use = {id(m.home) for m in attention + experts}  # a replacement can sit in its predecessor's bundle
        self.homes.keep([h for h in freed if id(h) not in in_use and node_reachable(h)])
        self.standbys.refill(table, min(reserve_timeout_s, 2.0))  # off the step path but for a new reservation
        self.homes.release_unused(self.attention + self.experts + self.standby)
        loaded = sum(len(ids) for kind, j in dead if kind in ("expert", "worker") for ids in table.experts_of(j).values())
        return t1 - t0, regroup, loaded

    def _replacement(self, kind: Kind, home: Home, table: PlacementTable, index: int, timeout_s: float) -> Member:
        """A started new actor for a dead one: in ``home`` (the dead one's bundle) while its node answers,
        else in a fresh home. The node can be found dead only now (the GCS marks a node dead seconds
        after it stopped answering): then once more in a fresh home. Never waits on a dead node."""
        new = self._new_attention if kind == "attention" else self._new_expert
        if not node_reachable(home):
            home = self.homes.fresh(kind, timeout_s)
        for attempt in range(2):
            member = new(home, table, index)
            state = self._await_start(member, self.config.faults.start_timeout_s)
            if state == "started":
                return member
            retire(member)
            if state == "timeout":
                raise NoCapacity(f"no node has room for a replacement {kind} actor: it did not start within "
                                 f"{self.config.faults.start_timeout_s:.0f}s")
            if attempt == 0:
                home = self.homes.fresh(kind, timeout_s)
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
            if not node_reachable(member.home):
                return "dead"
            if time.monotonic() >= deadline:
                return "timeout"

    # ---- helpers -------------------------------------------------------------------------------
    def _options(self, opts: dict) -> dict:
        """An actor's Ray options; on NCCL with the environment that makes a dead peer abortable."""
        return {**opts, "runtime_env": {"env_vars": dict(NCCL_ENV)}} if self.backend == "nccl" else opts

    def _new_member(self, home: Home, table: PlacementTable, index: int | None) -> Member:
        new = self._new_attention if home.kind == "attention" else self._new_expert
        return new(home, table, index)

    def _new_attention(self, home: Home, table: PlacementTable, index: int) -> Member:
        """An attention replica; in the colocated layout a worker (an attention replica and an expert shard)."""
        c = self.config
        opts = self._options(home.reservation.attention_options(home.index))
        if self.colocated:
            return Member(RemoteWorker.options(**opts).remote(
                self.path, index=index, table=table, num_blocks=c.cache.num_blocks, block_size=c.cache.block_size,
                num_slots=c.cache.num_slots, dtype=c.dtype, impl=c.data_plane.impl, exchange=c.data_plane.exchange,
                threads=c.data_plane.actor_threads, num_snapshots=snapshot_plan(c, self.model_cfg).count,
                expert_threads=c.data_plane.expert_threads, mtp=c.mtp, tier=tier_spec(c, self.model_cfg), **compiled(c)), home)
        actor = RemoteAttention.options(**opts).remote(
            self.path, index=index, table=table, num_blocks=c.cache.num_blocks, block_size=c.cache.block_size,
            num_slots=c.cache.num_slots, dtype=c.dtype, impl=c.data_plane.impl, exchange=c.data_plane.exchange, threads=c.data_plane.actor_threads,
            num_snapshots=snapshot_plan(c, self.model_cfg).count, mtp=c.mtp, tier=tier_spec(c, self.model_cfg), **compiled(c))
        return Member(actor, home)

    def _new_expert(self, home: Home, table: PlacementTable, index: int) -> Member:
        opts = self._options(home.reservation.expert_options(home.index))
        return Member(RemoteExpert.options(**opts).remote(self.path, index=index, table=table, dtype=self.config.dtype,
                                                          exchange=self.config.data_plane.exchange,
                                                          threads=self.config.data_plane.actor_threads,
                                                          expert_threads=self.config.data_plane.expert_threads), home)

    def _form_group(self, table: PlacementTable, attention: list[Member], experts: list[Member], what: str) -> None:
        c = self.config
        # the first answers from new actors wait for their weights to load
        addr, port = self._get(attention[0].actor.rendezvous.remote(), self.load_timeout_s, f"{what}: rendezvous")
        info = GroupInfo(epoch=table.epoch, address=addr, port=port, backend=self.backend,
                         timeout_s=c.faults.collective_timeout_s, transport=c.data_plane.transport,
                         token=secrets.token_bytes(TOKEN_BYTES),
                         join_timeout_s=c.faults.collective_timeout_s + JOIN_SLACK_S)
        refs = [m.actor.enter_epoch.remote(info, table, i) for i, m in enumerate(attention)]
        refs += [m.actor.enter_epoch.remote(info, table, j) for j, m in enumerate(experts)]
        names = self.names(len(attention), len(experts))
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
                          self.config.faults.step_timeout_s, f"{what}: opening step channels", names=[n for _, n in fresh])
        for (m, name), address, token in zip(fresh, where, tokens):
            try:  # the actor listens already: a reachable one connects at once
                m.channel = StepChannel(name, tuple(address), token, self.config.faults.step_timeout_s,
                                        connect_timeout_s=min(30.0, self.config.faults.step_timeout_s))
            except OSError as e:
                raise EngineError(f"{what}: cannot connect the step channel of {name} at "
                                  f"{address[0]}:{address[1]}: {e}") from None

    def _get(self, refs, timeout: float, what: str, names: list[str] | None = None):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            refs_list = refs if isinstance(refs, list) else [refs]
            _, pending = ray.wait(refs_list, num_returns=len(refs_list), timeout=0)
            names = names or (self.names() if len(refs_list) == len(self.attention) + len(self.experts) else None)
            who = ([n for n, r in zip(names, refs_list) if r in pending] if names
                   else [f"{len(pending)} of {len(refs_list)} actors"])
            raise EngineError(f"{what}: no answer within {timeout:.0f}s from {', '.join(who)}") from None
        except ray.exceptions.RayTaskError as e:
            raise EngineError(f"{what}: {e.cause if e.cause is not None else e}") from None
        except ray.exceptions.RayActorError as e:
            raise EngineError(f"{what}: an actor died: {e}") from None
