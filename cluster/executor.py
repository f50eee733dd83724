"""The step executor: the engine's one seam to whatever computes its steps.

:class:`Executor` is the protocol the engine (the step loop) and :mod:`cluster.epochs` (shape
changes) call. :class:`RayExecutor` carries it out on Ray actors: each step's messages travel over
one step channel per actor (:mod:`actors.channel`), never as a Ray call; the actors themselves —
reservations, creation, standbys, process groups, liveness probes — are its :class:`~cluster.fleet.Fleet`'s.
A fake executor (``tests/cluster/fake_executor.py``) drives the same engine in one process, without Ray.

Owns (RayExecutor): the step transport's view of the fleet (who a step went to, what came back).
Never: decides which sequences run (the scheduler), which shape comes next (the router and the
epoch owner), or waits on an actor without a timeout.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Protocol

from actors.channel import TOKEN_BYTES, ChannelClosed, StepChannel, StepError
from actors.messages import ExpertStep, PlacementTable, StepRequest, WorkerStepResult

from .errors import StepFailed
from .kv_transfer import TRANSPORTS, TransportError
from .watchdog import HangWatch

Sent = list[tuple[str, Any]]  # where a step went: (actor name, member) in rank order
MemberId = tuple[str, int]  # (kind, index): kind "attention" or "expert" ("worker" in the colocated layout)


class Executor(Protocol):
    """What the engine and the epoch owner need from the actors. ``table`` is the placement the
    actors run now (set by ``start``, ``commit`` and ``replace``)."""

    table: PlacementTable | None

    @property
    def started(self) -> bool: ...

    def start(self, table: PlacementTable) -> None: ...

    def shutdown(self) -> None: ...

    # the step
    def launch(self, reqs: list[StepRequest], expert_req: ExpertStep) -> Sent: ...

    def collect(self, step_no: int, sent: Sent) -> tuple[list, list]:
        """The attention and expert results of a launched step; raises StepFailed."""

    # shape changes (carried out; :mod:`cluster.epochs` decides)
    def prepare(self, kind: str, table: PlacementTable) -> Any:
        """Start the actors and staging ``table`` needs while steps go on; returns the change's handle."""

    def ready(self, prepared: Any) -> bool:
        """True once everything ``prepared`` needs is up; raises EngineError (after aborting) when it failed."""

    def commit(self, prepared: Any) -> tuple[float, int]:
        """Switch every actor to the prepared table at a step boundary: (regroup seconds, experts loaded)."""

    def abort(self, prepared: Any) -> None: ...

    def progress(self, prepared: Any) -> dict:
        """Where a change being prepared stands, for /status (plain data)."""

    def lost(self, suspects: list[MemberId]) -> list[MemberId]:
        """Members that share a node with a suspect and whose node stopped answering."""

    def failed_members(self) -> list[MemberId]:
        """Members whose actor is dead or does not answer a heartbeat (after a failed regroup)."""

    def replace(self, dead: list[MemberId], table: PlacementTable) -> tuple[float, float, int]:
        """A recovery epoch: each dead member replaced at its index, every actor in a new process
        group. (replace seconds, regroup seconds, experts loaded); raises NoCapacity."""

    # operations
    def kill(self, kind: str, index: int) -> str: ...

    # cached blocks (prefill/decode disaggregation: cluster/pd.py)
    def read_blocks(self, replica: int, blocks: list[int], snapshot: int | None = None, via: str = "channel") -> dict:
        """Copies of attention replica ``replica``'s cache ``blocks`` (and KDA ``snapshot``), moved ``via`` one of
        :data:`cluster.kv_transfer.TRANSPORTS` (where the executor has a choice)."""

    def write_blocks(self, replica: int, blocks: list[int], snapshot: int | None, parts: dict,
                     via: str = "channel") -> None:
        """Write ``parts`` (:meth:`read_blocks`' form) into replica ``replica``'s ``blocks`` and ``snapshot``."""

    def tier(self, replica: int, op: str, *args):
        """A KV tier operation of attention replica ``replica``'s actor (cluster/tiering.py)."""

    def node_of(self, replica: int) -> str:
        """The node attention replica ``replica`` runs on (its KV tier is that node's)."""

    def peer(self, replica: int):
        """What another attention replica's actor calls to read replica ``replica``'s node's tier itself
        (actors/tier.py ``fetch_from``): its Ray actor handle, or in one process the worker."""

    def describe(self) -> dict: ...


class RayExecutor:
    """Steps over step channels to the actors of a :class:`~cluster.fleet.Fleet`, with the hang
    watchdog (:mod:`cluster.watchdog`) on every wait."""

    def __init__(self, fleet, config):
        self.fleet, self.config = fleet, config
        self.watch = HangWatch(floor_s=min(config.faults.hang_floor_s, config.faults.step_timeout_s), factor=config.faults.hang_factor,
                               cap_s=config.faults.step_timeout_s)

    @property
    def table(self) -> PlacementTable | None:
        return self.fleet.table

    @property
    def started(self) -> bool:
        return self.fleet.started

    def start(self, table: PlacementTable) -> None:
        self.fleet.start(table)

    def shutdown(self) -> None:
        self.fleet.shutdown()

    # ---- the step --------------------------------------------------------------------------
    def launch(self, reqs: list[StepRequest], expert_req: ExpertStep) -> Sent:
        """Send one step over every actor's step channel (no Ray call); :meth:`collect` waits for it."""
        fleet = self.fleet
        assert len(reqs) == len(fleet.attention), f"{len(reqs)} step requests for {len(fleet.attention)} attention actors"
        members = fleet.attention + fleet.experts  # colocated: the workers (their requests carry peer_tokens)
        for m, req in zip(members, list(reqs) + [expert_req] * len(fleet.experts)):
            if m.channel is not None:  # None: an actor retired by a recovery that found no room (collect says so)
                m.channel.send(expert_req.step, req)
        return list(zip(fleet.names(), members))

    def collect(self, step_no: int, sent: Sent) -> tuple[list, list]:
        """The results of a launched step. Raises :class:`StepFailed` once every actor has answered
        or been given up on, naming the dead (closed channel, node gone, hung, no answer by the step
        timeout) to replace and those that answered with an error (they only need a new process
        group). A silent actor past its kind's budget is asked for a heartbeat, with every other
        actor still silent: those that do not answer are hung and killed at once, which ends their
        peers' exchanges too. After the first failure the others get until the collective timeout
        (and 5 s) from then: a peer of a dead actor answers when its exchange fails."""
        begin = time.monotonic()
        hard = begin + self.config.faults.step_timeout_s
        results, dead, errored, hung, causes, grace = [], [], [], [], [], None
        for k, (name, member) in enumerate(sent):
            kind = name.split("[")[0]
            soft = min(hard, begin + self.watch.budget(kind))
            while True:
                try:
                    if member.channel is None:
                        raise ChannelClosed(f"{name} has no step channel")
                    if name in hung:
                        raise ChannelClosed(f"{name} was hung")
                    results.append(member.channel.recv(step_no, soft, alive=lambda m=member: self.fleet.reachable(m)))
                    self.watch.observe(kind, time.monotonic() - begin)
                    break
                except TimeoutError:
                    if time.monotonic() < hard:
                        silent = [(n, m) for n, m in sent[k:] if n not in hung and m.channel is not None]
                        found = self.fleet.unresponsive(silent, self.config.faults.heartbeat_timeout_s)
                        for n, m in found:
                            hung.append(n)
                            causes.append(f"{n} hung (no heartbeat within {self.config.faults.heartbeat_timeout_s:g}s)")
                            self.fleet.kill_member(m)
                        if found:  # its live peers wait on its sockets, which close only when it is gone
                            self.fleet.break_exchanges([m for n, m in silent if n not in hung])
                        soft = min(hard, time.monotonic() + self.watch.budget(kind))
                        continue
                    dead.append(name)
                    causes.append(f"{name} did not answer")
                except StepError as e:
                    errored.append(name)
                    causes.append(f"{name}: {str(e).splitlines()[0]}")
                except ChannelClosed:
                    dead.append(name)
                    if name not in hung:
                        causes.append(f"{name} died")
                if grace is None:  # the first failure: the others' exchanges fail within the collective timeout
                    grace = time.monotonic() + self.config.faults.collective_timeout_s + 5
                    hard = max(hard, grace)
                break
        if causes:
            raise StepFailed(f"step {step_no} failed: {'; '.join(causes[:4])}", [parse_name(n) for n in dead],
                             [parse_name(n) for n in errored], [parse_name(n) for n in hung])
        if results and isinstance(results[0], WorkerStepResult):  # colocated: each worker answers for both halves
            return [r.attention for r in results], [r.experts for r in results]
        num_attention = sum(name.startswith("attention") for name, _ in sent)
        return results[:num_attention], results[num_attention:]

    # ---- shape changes ---------------------------------------------------------------------
    def prepare(self, kind: str, table: PlacementTable):
        return self.fleet.prepare(kind, table)

    def ready(self, prepared) -> bool:
        return self.fleet.ready(prepared)

    def commit(self, prepared) -> tuple[float, int]:
        return self.fleet.commit(prepared)

    def abort(self, prepared) -> None:
        self.fleet.abort(prepared)

    def progress(self, prepared) -> dict:
        return self.fleet.progress(prepared)

    def lost(self, suspects: list[MemberId]) -> list[MemberId]:
        return self.fleet.lost(suspects)

    def failed_members(self) -> list[MemberId]:
        return self.fleet.failed_members(self.config.faults.heartbeat_timeout_s)

    def replace(self, dead: list[MemberId], table: PlacementTable) -> tuple[float, float, int]:
        return self.fleet.replace(dead, table)

    # ---- cached blocks ----------------------------------------------------------------------
    def read_blocks(self, replica: int, blocks: list[int], snapshot: int | None = None, via: str = "channel") -> dict:
        """Copies of the blocks, over ``via``: the replica's blocks channel (a direct connection of its own,
        opened at the first call) or a Ray call (the blocks come back through the object store); under the
        step timeout."""
        return self._blocks_call(replica, via, "read", blocks, snapshot)

    def write_blocks(self, replica: int, blocks: list[int], snapshot: int | None, parts: dict,
                     via: str = "channel") -> None:
        self._blocks_call(replica, via, "write", blocks, snapshot, parts)

    def node_of(self, replica: int) -> str:
        return self.fleet.node_ip(self.fleet.attention[replica])

    def peer(self, replica: int):
        return self.fleet.attention[replica].actor

    def tier(self, replica: int, op: str, *args):
        """A KV tier operation of attention replica ``replica`` (actors/attention.py ``_serve_blocks``: tier_probe(s),
        tier_load, tier_fetch, tier_names, tier_flush, tier_status) over its blocks channel, under the step timeout
        — a probe under the hang watchdog's (hang_floor_s + heartbeat_timeout_s): it only checks that files exist,
        and the engine waits for it between steps, so a stopped actor costs the streams seconds, not the step
        timeout (its next step finds it hung)."""
        faults = self.config.faults
        timeout = min(faults.step_timeout_s, faults.hang_floor_s + faults.heartbeat_timeout_s) \
            if op in ("tier_probe", "tier_probes") else None
        return self._blocks_call(replica, "channel", op, *args, timeout_s=timeout)

    def _blocks_call(self, replica: int, via: str, op: str, *args, timeout_s: float | None = None):
        """``op`` ("read" or "write") of attention replica ``replica``'s blocks over ``via``, under ``timeout_s``
        (the step timeout by default); a dead, silent or failing actor raises TransportError naming it."""
        import ray

        if via not in TRANSPORTS:
            raise ValueError(f"no blocks transport {via!r}: one of {', '.join(TRANSPORTS)}")
        member = self.fleet.attention[replica]
        timeout = self.config.faults.step_timeout_s if timeout_s is None else timeout_s
        try:
            if via == "object_store":
                return ray.get(getattr(member.actor, f"{op}_blocks").remote(*args), timeout=timeout)
            return self._over_channel(member, replica, timeout, (op, *args))
        except (ray.exceptions.RayError, TimeoutError, OSError, StepError) as e:
            if member.blocks is not None and not isinstance(e, StepError):  # its answers may be out of step now
                member.blocks.close()
                member.blocks = None
            if op in ("write", "tier_load") and isinstance(e, (ray.exceptions.GetTimeoutError, TimeoutError)):
                # the write (or a KV tier load) may still run later, into blocks the caller is about to give back:
                # the replica goes (its engine replaces it at the next step, with an empty cache) rather than risk that
                self.fleet.kill_member(member)
            what = op if op.startswith("tier") else f"{op}_blocks"
            raise TransportError(f"{what} on attention replica {replica} failed: {type(e).__name__}: {e}") from None

    def _over_channel(self, member, replica: int, timeout: float, request: tuple):
        import ray

        if member.blocks is None:  # (opened under the step timeout, whatever the call's own)
            token, opening = secrets.token_bytes(TOKEN_BYTES), self.config.faults.step_timeout_s
            address = ray.get(member.actor.open_blocks_channel.remote(token), timeout=opening)
            member.blocks = StepChannel(f"attention[{replica}] blocks", tuple(address), token, opening,
                                        connect_timeout_s=min(30.0, opening))
        member.blocks_calls += 1
        member.blocks.send(member.blocks_calls, request)
        return member.blocks.recv(member.blocks_calls, time.monotonic() + timeout,
                                  alive=lambda: self.fleet.reachable(member))

    def kill(self, kind: str, index: int) -> str:
        return self.fleet.kill(kind, index)

    def describe(self) -> dict:
        return self.fleet.describe()


def member_names(num_attention: int, num_expert_actors: int) -> list[str]:
    return [f"attention[{i}]" for i in range(num_attention)] + [f"expert[{j}]" for j in range(num_expert_actors)]


def parse_name(name: str) -> MemberId:
    """``"expert[3]"`` → ``("expert", 3)``."""
    kind, index = name.rstrip("]").split("[")
    return kind, int(index)
