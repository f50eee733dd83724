"""The fleet's records: a reserved bundle (:class:`Home`), an actor in it (:class:`Member`), and the
actors of a shape change being prepared (:class:`Prepared`); retiring an actor.
Owned by :class:`cluster.fleet.Fleet` and its parts (:mod:`cluster.homes` hands out homes,
:mod:`cluster.standbys` keeps and retires warm members); nobody else creates or retires a member.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.channel import StepChannel
from actors.messages import PlacementTable

from .topology import Kind, Reservation


@dataclass
class Home:
    """A reserved bundle: bundle ``index`` of ``kind`` in ``reservation``."""

    reservation: Reservation
    kind: Kind
    index: int
    ip: str | None = None  # its node's address, looked up once (a bundle never moves)


@dataclass
class Member:
    """One actor of the fleet, the bundle it sits in, and its step channel (opened when it first
    joins a process group)."""

    actor: Any  # a Ray ActorHandle
    home: Home
    channel: StepChannel | None = None
    blocks: StepChannel | None = None  # its cached blocks' channel (attention members, opened at the first transfer)
    blocks_calls: int = 0  # calls made over it (their numbers)


@dataclass
class Prepared:
    """The actors of a shape change being prepared (the epoch owner's Transition holds it)."""

    kind: str
    table: PlacementTable
    old: PlacementTable
    attention: list[Member]  # the new epoch's members, in rank order
    experts: list[Member]
    retired: list[Member]
    reservations: list[Reservation]  # made for this change
    pending: list  # ObjectRefs: new actors' start-up, then kept experts' staging
    staging: list = field(default_factory=list)  # ObjectRefs of the staging alone: experts read each
    started: float = field(default_factory=time.monotonic)
    waits_for_capacity: bool = False  # its new bundles were asked for before the cluster had room


def retire(member: Member) -> None:
    """Close ``member``'s channels and kill its actor."""
    for ch in (member.channel, member.blocks):
        if ch is not None:
            ch.close()
    member.channel = member.blocks = None
    kill_actor(member.actor)


def kill_actor(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 — already gone
        pass
