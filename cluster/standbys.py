"""The fleet's warm standbys: actors started ahead, with their weights loaded, in no process group.

A recovery takes a standby of the dead actor's kind (:meth:`Standbys.take`), so replacing it is a
regroup rather than a cold start; afterwards the pool is refilled (:meth:`Standbys.refill`), in a
spare bundle or a new reservation, without waiting for the new actors to start. The pool's size
is the engine's ``standby_attention`` and ``standby_experts``.

Owns: the pool (the standby members, each in its own bundle).
Never: builds an actor itself (the fleet's factory does, handed in), forms a process group or
opens a step channel (the fleet does once a standby takes a dead one's index), reserves a bundle
but through the fleet's :class:`~cluster.homes.Homes`, or waits on an actor without a timeout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from actors.messages import PlacementTable

from .config import EngineConfig
from .errors import NoCapacity
from .homes import Homes
from .members import Home, Member, retire
from .topology import ClusterSpec, Kind, ReservationTimeoutError

NewActor = Callable[[Home, PlacementTable, int | None], Member]  # (home, table, index): its actor created, not awaited
AwaitStart = Callable[[Member, float], str]  # "started" | "dead" | "timeout"


class Standbys:
    def __init__(self, config: EngineConfig, spec: ClusterSpec, homes: Homes, new: NewActor,
                 await_start: AwaitStart):
        self.config, self.spec, self.homes = config, spec, homes
        self._new_actor, self._await_start = new, await_start
        self.members: list[Member] = []  # warm actors in no process group, each ready to take a dead one's index

    def start(self, table: PlacementTable, timeout_s: float) -> None:
        """Reserve the configured standbys' bundles (raises like a reservation of the shape does) and
        start them; their start-up is not waited for."""
        c = self.config
        if c.faults.standby_attention + c.faults.standby_experts == 0:
            return
        spec = dataclasses.replace(self.spec, attention=c.faults.standby_attention, experts=c.faults.standby_experts)
        try:
            res = self.homes.reserve(spec, timeout_s)
        except ReservationTimeoutError as e:
            raise ReservationTimeoutError(f"no room for the standby actors (standby_attention={c.faults.standby_attention}, "
                                          f"standby_experts={c.faults.standby_experts}) beside the shape: {e}") from None
        homes = [Home(res, "attention", i) for i in range(c.faults.standby_attention)]
        homes += [Home(res, "expert", j) for j in range(c.faults.standby_experts)]
        self.members += [self._new(h, table) for h in homes]

    def _new(self, home: Home, table: PlacementTable) -> Member:
        return self._new_actor(home, table, None)  # no index: a standby gets one when it takes a dead one's

    def take(self, kind: Kind) -> Member | None:
        """A started standby of ``kind`` out of the pool; None when none is (dead ones are dropped)."""
        while pool := [m for m in self.members if m.home.kind == kind]:
            member = pool[0]
            self.members.remove(member)
            if self._await_start(member, self.config.faults.start_timeout_s) == "started":
                return member
            retire(member)
        return None

    def refill(self, table: PlacementTable, timeout_s: float) -> None:
        """Start standbys until the pool is full: in spare bundles whose node answers, else in a new
        reservation (bounded by ``timeout_s``; without room the pool stays short until the next
        recovery). The new actors' start-up is not waited for."""
        c = self.config
        for kind, want in (("attention", c.faults.standby_attention), ("expert", c.faults.standby_experts)):
            for _ in range(want - sum(m.home.kind == kind for m in self.members)):
                home = self.homes.take_spare(kind)
                if home is None:
                    try:
                        home = self.homes.fresh(kind, timeout_s)
                    except NoCapacity:
                        break
                self.members.append(self._new(home, table))

    def retire_all(self) -> None:
        for m in self.members:
            retire(m)
        self.members = []
