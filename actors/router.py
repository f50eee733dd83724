"""Router: the routing authority, off the hot path (docs/architecture.md "Roles"). It lives in the
engine's process (plain Python, no Ray), so it dies only with the engine.

Owns: the placement table — logical expert → physical slots on expert actors, per MoE layer,
replicas included — versioned by an epoch, and the only code that builds one; the proposal of the
next epoch's table (a new shape, or a rebalanced placement with redundant copies of hot experts);
and the load statistics, kept here once: per-(MoE layer, logical expert) token counts over the
engine's life and over a sliding window of steps, and the tokens each expert actor computed.
Every imbalance figure comes from one function, :func:`max_over_mean`.
Never: sees a token (dispatch and combine run inside the epoch's process group), or creates and
kills actors — the epoch owner (cluster/epochs.py) carries out the change the router proposes,
then asks it to commit.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from .messages import PlacementTable

DEFAULT_WINDOW_STEPS = 256


# ---- building tables (nobody else does) ---------------------------------------------------
def even_table(num_experts: int, moe_layers: list[int] | tuple[int, ...], num_attention: int, num_actors: int,
               epoch: int = 0, colocated: bool = False) -> PlacementTable:
    """Contiguous shards as equal as possible (the first ``num_experts % num_actors`` get one
    more), the same in every MoE layer, no replicas."""
    if isinstance(num_actors, bool) or not 1 <= num_actors <= num_experts:
        raise ValueError(f"expert actors must be in 1..{num_experts} (the routed experts), got {num_actors}")
    if num_attention < 1:
        raise ValueError(f"attention replicas must be >= 1, got {num_attention}")
    base, extra = divmod(num_experts, num_actors)
    shards, lo = [], 0
    for j in range(num_actors):
        hi = lo + base + (1 if j < extra else 0)
        shards.append(tuple(range(lo, hi)))
        lo = hi
    return PlacementTable(epoch, num_experts, num_attention, tuple(moe_layers), tuple(tuple(shards) for _ in moe_layers),
                          colocated)


def balanced_layer(load: list[float], num_actors: int, redundant: int) -> tuple[tuple[int, ...], ...]:
    """One MoE layer's slots (EPLB-style): ``redundant`` extra copies go one at a time to the
    expert with the most load per copy; then the copies, hottest first (replicated experts before
    single ones), go to the least-loaded actor that has a free slot and no copy of that expert.
    Capacity per actor: (experts + redundant) spread as evenly as possible. Deterministic."""
    E = len(load)
    copies = [1] * E
    for _ in range(redundant):
        e = max((e for e in range(E) if copies[e] < num_actors), key=lambda e: (load[e] / copies[e], -copies[e], -e),
                default=None)
        if e is None:
            break
        copies[e] += 1
    total = sum(copies)
    base, extra = divmod(total, num_actors)
    capacity = [base + (1 if j < extra else 0) for j in range(num_actors)]
    items = sorted(((copies[e] > 1, load[e] / copies[e], -e) for e in range(E) for _ in range(copies[e])), reverse=True)
    held: list[list[int]] = [[] for _ in range(num_actors)]
    weight = [0.0] * num_actors
    for _, w, neg_e in items:
        e = -neg_e
        free = [j for j in range(num_actors) if len(held[j]) < capacity[j] and e not in held[j]]
        if not free:
            raise ValueError(f"cannot place {copies[e]} copies of expert {e} on {num_actors} actors; use fewer "
                             f"redundant slots")
        j = min(free, key=lambda j: (weight[j], j))
        held[j].append(e)
        weight[j] += w
    return tuple(tuple(sorted(ids)) for ids in held)


def max_over_mean(load: torch.Tensor) -> list[float]:
    """Per row of ``load`` [rows, n] (a MoE layer's tokens per expert or per expert actor): max over
    mean (1.0 = balanced; 0.0 = no tokens). The one imbalance figure everything reports."""
    load = torch.as_tensor(load).double()
    if load.numel() == 0:
        return [0.0] * load.shape[0]
    total = load.sum(1)
    peak = load.max(1).values * load.shape[1]
    return [float(p / t) if t > 0 else 0.0 for p, t in zip(peak, total)]


def actor_load(table: PlacementTable, logical: torch.Tensor) -> torch.Tensor:
    """Tokens per (MoE layer, expert actor) when each expert's tokens ``logical`` [layers, E] split
    evenly over its copies: [layers, actors]."""
    rows = []
    for i, per_actor in enumerate(table.slots):
        n_copies = torch.zeros(table.num_experts, dtype=torch.double)
        for ids in per_actor:
            n_copies[list(ids)] += 1
        share = logical[i].double() / n_copies
        rows.append(torch.stack([share[list(ids)].sum() for ids in per_actor]))
    return torch.stack(rows)


def actor_imbalance(table: PlacementTable, logical: torch.Tensor) -> list[float]:
    """Per MoE layer, predicted under ``table``: max over mean tokens per expert actor."""
    return max_over_mean(actor_load(table, logical))


@dataclass(frozen=True)
class Proposal:
    """The router's answer to an epoch-change request: the next table and, for a rebalance, the
    predicted imbalance per MoE layer under the current and the proposed table."""

    table: PlacementTable
    imbalance_before: tuple[float, ...] = ()
    imbalance_after: tuple[float, ...] = ()


class Router:
    def __init__(self, num_experts: int, moe_layers: list[int], *, window_steps: int = DEFAULT_WINDOW_STEPS):
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.num_experts, self.moe_layers = num_experts, tuple(moe_layers)
        self.table: PlacementTable | None = None
        self.pending: PlacementTable | None = None
        self.window_steps = window_steps
        self._lock = threading.Lock()
        # buckets of up to `bucket_steps` consecutive steps of one epoch, oldest first: [epoch, steps,
        # [layers, E] tokens per logical expert, [layers, actors] rows per expert actor or None]
        self.window: deque[list] = deque()
        self.bucket_steps = max(1, window_steps // 16)  # the window is kept in about 16 buckets
        shape = (len(self.moe_layers), num_experts)
        self._window_sum = torch.zeros(shape, dtype=torch.long)  # the window's counts, summed
        self._totals = torch.zeros(shape, dtype=torch.long)  # over the engine's life
        self._actor_totals: list[int] = []  # per expert actor index, over all epochs
        self.steps = 0

    # ---- the table -------------------------------------------------------------------------
    def initial(self, num_attention: int, num_actors: int, *, colocated: bool = False) -> PlacementTable:
        """Epoch 0: contiguous shards (``colocated``: one worker per shard, each an attention replica too)."""
        if self.table is not None:
            raise RuntimeError(f"the router already has a table (epoch {self.table.epoch})")
        if colocated and num_attention != num_actors:
            raise ValueError(f"a colocated layout has one attention replica per worker: {num_attention} "
                             f"attention for {num_actors} workers")
        self.table = even_table(self.num_experts, self.moe_layers, num_attention, num_actors, colocated=colocated)
        self._last_epoch = 0
        return self.table

    def current(self) -> PlacementTable:
        assert self.table is not None, "router: no table yet (initial() first)"
        return self.table

    def propose(self, *, num_attention: int | None = None, num_actors: int | None = None,
                redundant_slots: int | None = None) -> Proposal:
        """The next epoch's table: a new shape (``num_attention`` / ``num_actors``: contiguous shards
        when the expert actors change, the placement kept otherwise), or a rebalanced placement over
        the same actors with ``redundant_slots`` extra copies per layer from the window's counts."""
        cur = self.current()
        if self.pending is not None:
            raise RuntimeError(f"epoch {self.pending.epoch} is still being applied; retry when it is done")
        if cur.colocated and num_attention is not None and num_actors is not None and num_attention != num_actors:
            raise ValueError("a colocated layout changes its workers: attention replicas and expert shards together")
        if cur.colocated:  # a worker is both: one number sets the other
            num_attention = num_actors if num_attention is None else num_attention
            num_actors = num_attention if num_actors is None else num_actors
        attention = cur.num_attention if num_attention is None else num_attention
        if isinstance(attention, bool) or not isinstance(attention, int) or attention < 1:
            raise ValueError(f"attention replicas must be an integer >= 1, got {attention!r}")
        nxt = self._last_epoch + 1  # never reused, not even after an abandoned proposal
        if redundant_slots is not None:
            if num_actors is not None:
                raise ValueError("rebalance keeps the expert actors: give redundant_slots or num_actors, not both")
            if isinstance(redundant_slots, bool) or not isinstance(redundant_slots, int) or redundant_slots < 0:
                raise ValueError(f"redundant_slots must be an integer >= 0, got {redundant_slots!r}")
            proposal = self.rebalanced(redundant_slots, epoch=nxt, num_attention=attention)
        elif num_actors is not None and num_actors != cur.num_actors:
            proposal = Proposal(even_table(self.num_experts, self.moe_layers, attention, num_actors, nxt, cur.colocated))
        else:
            proposal = Proposal(PlacementTable(nxt, self.num_experts, attention, self.moe_layers, cur.slots,
                                               cur.colocated))
        self.pending, self._last_epoch = proposal.table, nxt
        return proposal

    def rebalanced(self, redundant_slots: int, *, epoch: int | None = None,
                   num_attention: int | None = None) -> Proposal:
        """The placement a rebalance would give from the window's counts, over the current actors,
        with its predicted imbalance before and after; changes nothing (:meth:`propose` makes it
        the pending epoch; the simulator only reads it)."""
        cur = self.current()
        load = self.window_counts()
        slots = tuple(balanced_layer(load[i].tolist(), cur.num_actors, redundant_slots)
                      for i in range(len(self.moe_layers)))
        table = PlacementTable(cur.epoch + 1 if epoch is None else epoch, self.num_experts,
                               cur.num_attention if num_attention is None else num_attention, self.moe_layers, slots,
                               cur.colocated)
        return Proposal(table, tuple(actor_imbalance(cur, load)), tuple(actor_imbalance(table, load)))

    def commit(self, epoch: int) -> PlacementTable:
        """The engine applied the pending table: publish it."""
        if self.pending is None or self.pending.epoch != epoch:
            raise RuntimeError(f"router: no pending epoch {epoch} to commit")
        self.table, self.pending = self.pending, None
        return self.table

    def abort(self, epoch: int) -> None:
        """The engine could not apply the pending table: keep the current one."""
        if self.pending is not None and self.pending.epoch == epoch:
            self.pending = None

    # ---- load statistics (engine thread writes; scrapes and status read, under the lock) ----------
    def report(self, expert_tokens, actor_tokens=None, *, epoch: int | None = None) -> None:
        """One step's tokens per (MoE layer, logical expert) [layers, E], summed over attention
        replicas, and optionally the rows each expert actor was sent [layers, actors] in ``epoch``
        (measured: a replicated expert's rows land where dispatch sent them). The window keeps the
        newest buckets that cover at most ``window_steps`` steps (and at least the newest bucket).
        Tensors are never changed in place: a reader's copy stays valid."""
        counts = torch.as_tensor(expert_tokens, dtype=torch.long)
        actors = None if actor_tokens is None else torch.as_tensor(actor_tokens, dtype=torch.long)
        epoch = self.current().epoch if epoch is None else epoch
        with self._lock:
            last = self.window[-1] if self.window else None
            if last is not None and last[0] == epoch and last[1] < self.bucket_steps and \
                    (last[3] is None) == (actors is None) and (actors is None or last[3].shape == actors.shape):
                last[1], last[2] = last[1] + 1, last[2] + counts
                last[3] = None if actors is None else last[3] + actors
            else:
                self.window.append([epoch, 1, counts, actors])
            self._window_sum = self._window_sum + counts
            covered = sum(b[1] for b in self.window)
            while len(self.window) > 1 and covered - self.window[0][1] >= self.window_steps:
                _, steps, old, _ = self.window.popleft()
                covered -= steps
                self._window_sum = self._window_sum - old
            self._totals = self._totals + counts
            if actors is not None:
                per_actor = actors.sum(0).tolist()
                self._actor_totals += [0] * (len(per_actor) - len(self._actor_totals))
                for j, n in enumerate(per_actor):
                    self._actor_totals[j] += n
            self.steps += 1

    def window_counts(self) -> torch.Tensor:
        """Tokens per (MoE layer, logical expert) over the sliding window: [layers, E]."""
        with self._lock:
            return self._window_sum

    def totals(self) -> torch.Tensor:
        """Tokens per (MoE layer, logical expert) over the engine's life: [layers, E]."""
        with self._lock:
            return self._totals

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
        """(totals [layers, E], window [layers, E], tokens per expert actor, steps in the window), taken
        together under the lock: consistent with each other."""
        with self._lock:
            return self._totals, self._window_sum, list(self._actor_totals), sum(b[1] for b in self.window)

    def actor_totals(self) -> list[int]:
        """Tokens each expert actor index computed, over all epochs."""
        with self._lock:
            return list(self._actor_totals)

    def steps_in_window(self) -> int:
        with self._lock:
            return sum(b[1] for b in self.window)

    def measured_imbalance(self, steps: int | None = None) -> list[float]:
        """Per MoE layer, measured: max over mean rows per expert actor over the window's last
        ``steps`` steps (default: all of it; whole buckets) of the newest epoch in it. Empty without traffic."""
        with self._lock:
            buckets, covered = [], 0
            for epoch, n, _, actors in reversed(self.window):
                if steps is not None and covered >= steps:
                    break
                covered += n
                if actors is not None:
                    buckets.append((epoch, actors))
        if not buckets:
            return []
        epoch = buckets[0][0]
        return max_over_mean(torch.stack([a for e, a in buckets if e == epoch]).sum(0))

    def expert_imbalance(self) -> list[float]:
        """Per MoE layer: max over mean tokens per logical expert over the window."""
        return max_over_mean(self.window_counts())

    def hot(self, k: int) -> list[list[tuple[int, int]]]:
        """[MoE layer][rank] (logical expert, tokens over the window) of the ``k`` hottest experts with
        tokens; ties go to the lower expert id."""
        return [sorted(((e, n) for e, n in enumerate(row) if n), key=lambda x: (-x[1], x[0]))[:k]
                for row in self.window_counts().tolist()]

    def stats(self) -> dict:
        load = self.window_counts()
        table = self.current()
        return {"epoch": table.epoch, "steps": self.steps, "window_steps": self.steps_in_window(),
                "moe_layers": list(self.moe_layers), "tokens_per_expert": load.tolist(),
                "imbalance": actor_imbalance(table, load)}
