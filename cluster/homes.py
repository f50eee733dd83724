"""The fleet's homes: the placement reservations an engine holds and the spare bundles in them.

Every actor of the fleet, standbys included, sits in a bundle (:class:`~cluster.members.Home`) of
a reservation made here. A retired actor's bundle is kept as a spare and reused before anything
new is reserved; a reservation none of whose bundles holds an actor any more is released.

Owns: the reservations (in the order made; a reservation's name counts them) and the spare bundles.
Never: creates, retires or waits on an actor (the fleet and its standbys do), decides how many
actors a shape needs (the fleet carries out the epoch owner's table), or waits for a
reservation without a timeout (one asked for while the cluster has no room is not waited for
here: the shape change that asked watches it).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from .config import EngineConfig
from .errors import NoCapacity
from .members import Home, Member, Prepared
from .preflight import PreflightError
from .probes import node_reachable, unreachable_nodes
from .spec import fmt_resources, plan_bundles
from .topology import ClusterSpec, Kind, Reservation, ReservationTimeoutError, free_nodes, reserve, reserve_pending


class Homes:
    def __init__(self, config: EngineConfig, spec: ClusterSpec):
        self.config, self.spec = config, spec
        self.reservations: list[Reservation] = []
        self.spare: list[Home] = []  # bundles of retired actors, reused before reserving more

    def reserve(self, spec: ClusterSpec, timeout_s: float, exclude: frozenset[str] = frozenset()) -> Reservation:
        """Reserve ``spec``'s bundles (raises like :func:`~cluster.topology.reserve`) and hold the reservation."""
        res = reserve(spec, timeout_s=timeout_s, name=self._name(), exclude=exclude)
        self.reservations.append(res)
        return res

    def _name(self) -> str:
        return f"{self.config.owner}/{len(self.reservations)}" if self.config.owner else ""

    def room(self, attention: int, experts: int) -> bool:
        """Whether ``attention`` and ``experts`` more actors can be placed now: in spare bundles first,
        the rest in the cluster's free resources. Without room, False when ``capacity_wait_s`` says to
        wait for it; else PreflightError (a ValueError: the caller's to fix)."""
        spare = {kind: sum(h.kind == kind for h in self.spare) for kind in ("attention", "expert")}
        new_attention = max(0, attention - spare["attention"])
        new_experts = max(0, experts - spare["expert"])
        if new_attention + new_experts == 0:
            return True
        more = dataclasses.replace(self.spec, attention=new_attention, experts=new_experts)
        nodes = free_nodes()
        plan = plan_bundles(more, nodes)
        if None in plan and self.config.faults.capacity_wait_s:
            return False
        if None in plan:
            free = {k: sum(n.available.get(k, 0.0) for n in nodes) for k in set().union(*more.bundles)}
            raise PreflightError(
                f"no room now for {plan.count(None)} of the {len(plan)} new actors ({more.describe()}): the "
                f"cluster's free resources are {fmt_resources(free)} over {len(nodes)} node(s), the rest is "
                f"held (this deployment's actors and standbys, or other work): free some or add nodes, or set "
                f"capacity_wait_s on a cluster that grows by itself")
        return True

    def for_change(self, kind: Kind, count: int, p: Prepared) -> list[Home]:
        """``count`` bundles for new actors of ``kind``: spare ones first, then one new reservation
        (recorded in ``p``; asked for without waiting when ``p`` waits for capacity)."""
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
            res = (reserve_pending(spec, name=self._name()) if p.waits_for_capacity
                   else reserve(spec, timeout_s=self.config.faults.start_timeout_s, name=self._name()))
        except BaseException:
            self.spare += reuse
            raise
        self.reservations.append(res)
        p.reservations.append(res)
        return reuse + [Home(res, kind, i) for i in range(more)]

    def fresh(self, kind: Kind, timeout_s: float) -> Home:
        """A bundle in a new reservation, on a node that answers (a dead node may still be listed alive)."""
        spec = dataclasses.replace(self.spec, attention=1 if kind == "attention" else 0,
                                   experts=1 if kind == "expert" else 0)
        try:
            res = self.reserve(spec, timeout_s, exclude=unreachable_nodes())
        except (ReservationTimeoutError, ValueError) as e:  # ValueError: a pinned node is gone
            raise NoCapacity(f"no node has room for a replacement {kind} actor: {str(e).splitlines()[0]}") from None
        return Home(res, kind, 0)

    def take_spare(self, kind: Kind) -> Home | None:
        """A spare bundle of ``kind`` whose node answers, out of the spares; None when there is none."""
        home = next((h for h in self.spare if h.kind == kind and node_reachable(h)), None)
        if home is not None:
            self.spare.remove(home)
        return home

    def keep(self, homes: Iterable[Home]) -> None:
        """Keep retired actors' bundles as spares."""
        self.spare += homes

    def release(self, reservations: list[Reservation]) -> None:
        for res in reservations:
            res.release()
            self.reservations.remove(res)

    def release_unused(self, live: list[Member]) -> None:
        """Release reservations none of whose bundles holds one of the ``live`` actors any more."""
        held = {id(m.home.reservation) for m in live}
        for res in [r for r in self.reservations if id(r) not in held]:
            res.release()
            self.reservations.remove(res)
            self.spare = [h for h in self.spare if h.reservation is not res]

    def release_all(self) -> None:
        self.spare = []
        for res in self.reservations:
            res.release()
        self.reservations = []
