"""Router: the routing authority, off the hot path (ARCHITECTURE.md "Roles").

Owns: the placement table — logical expert → physical slots on expert actors, per MoE layer,
replicas included — versioned by an epoch, and the only code that builds one; the proposal of the
next epoch's table (a new shape, or a rebalanced placement with redundant copies of hot experts);
a sliding window of per-layer, per-expert token counts the engine reports every few steps.
Never: sees a token (dispatch and combine run inside the epoch's process group), or creates and
kills actors — the engine's worker group carries out the epoch change the router proposes, then
asks it to commit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .messages import PlacementTable

DEFAULT_WINDOW_STEPS = 256


# ---- building tables (nobody else does) ---------------------------------------------------
def even_table(num_experts: int, moe_layers: list[int] | tuple[int, ...], num_attention: int, num_actors: int,
               epoch: int = 0) -> PlacementTable:
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
    return PlacementTable(epoch, num_experts, num_attention, tuple(moe_layers), tuple(tuple(shards) for _ in moe_layers))


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


def actor_imbalance(table: PlacementTable, logical: torch.Tensor) -> list[float]:
    """Per MoE layer: max over mean tokens per expert actor, when each expert's tokens ``logical``
    [layers, E] split evenly over its copies (1.0 = balanced; 0.0 = no tokens)."""
    out = []
    for i, per_actor in enumerate(table.slots):
        n_copies = torch.zeros(table.num_experts)
        for ids in per_actor:
            n_copies[list(ids)] += 1
        share = logical[i].double() / n_copies
        load = torch.stack([share[list(ids)].sum() for ids in per_actor])
        out.append(float(load.max() / load.mean()) if load.sum() > 0 else 0.0)
    return out


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
        self.window: deque[tuple[int, torch.Tensor]] = deque()  # (steps, [layers, E] summed over them)
        self.steps = 0

    # ---- the table -------------------------------------------------------------------------
    def initial(self, num_attention: int, num_actors: int) -> PlacementTable:
        """Epoch 0: contiguous shards."""
        if self.table is not None:
            raise RuntimeError(f"the router already has a table (epoch {self.table.epoch})")
        self.table = even_table(self.num_experts, self.moe_layers, num_attention, num_actors)
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
        attention = cur.num_attention if num_attention is None else num_attention
        if isinstance(attention, bool) or not isinstance(attention, int) or attention < 1:
            raise ValueError(f"attention replicas must be an integer >= 1, got {attention!r}")
        nxt = cur.epoch + 1
        if redundant_slots is not None:
            if num_actors is not None:
                raise ValueError("rebalance keeps the expert actors: give redundant_slots or num_actors, not both")
            if isinstance(redundant_slots, bool) or not isinstance(redundant_slots, int) or redundant_slots < 0:
                raise ValueError(f"redundant_slots must be an integer >= 0, got {redundant_slots!r}")
            load = self.window_counts()
            slots = tuple(balanced_layer(load[i].tolist(), cur.num_actors, redundant_slots)
                          for i in range(len(self.moe_layers)))
            table = PlacementTable(nxt, self.num_experts, attention, self.moe_layers, slots)
            proposal = Proposal(table, tuple(actor_imbalance(cur, load)), tuple(actor_imbalance(table, load)))
        elif num_actors is not None and num_actors != cur.num_actors:
            proposal = Proposal(even_table(self.num_experts, self.moe_layers, attention, num_actors, nxt))
        else:
            proposal = Proposal(PlacementTable(nxt, self.num_experts, attention, self.moe_layers, cur.slots))
        self.pending = proposal.table
        return proposal

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

    # ---- load statistics -------------------------------------------------------------------
    def report(self, expert_tokens, steps: int = 1) -> None:
        """Tokens per (MoE layer, logical expert) of the last ``steps`` steps, summed over attention
        workers (the engine reports every few steps). The window keeps the newest reports that
        cover at most ``window_steps`` steps (at least the newest one)."""
        self.window.append((steps, torch.as_tensor(expert_tokens, dtype=torch.long)))
        self.steps += steps
        covered = sum(n for n, _ in self.window)
        while len(self.window) > 1 and covered > self.window_steps:
            covered -= self.window.popleft()[0]

    def window_counts(self) -> torch.Tensor:
        """Tokens per (MoE layer, logical expert) over the sliding window: [layers, E]."""
        if not self.window:
            return torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long)
        return torch.stack([t for _, t in self.window]).sum(0)

    def reset_window(self) -> None:
        self.window.clear()

    def stats(self) -> dict:
        load = self.window_counts()
        table = self.current()
        return {"epoch": table.epoch, "steps": self.steps, "window_steps": sum(n for n, _ in self.window),
                "moe_layers": list(self.moe_layers), "tokens_per_expert": load.tolist(),
                "imbalance": actor_imbalance(table, load)}
