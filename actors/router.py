"""Router: the routing authority, off the hot path (ARCHITECTURE.md).

Owns: the placement table (logical expert → expert actor and local slot), versioned by an epoch,
and the running per-layer per-expert token counts the engine reports after each step.
Never: sees a token — dispatch and combine happen inside the attention workers' process group.
"""

from __future__ import annotations

from .messages import PlacementTable


class Router:
    def __init__(self, num_experts: int, num_expert_actors: int, moe_layers: list[int]):
        self.table = PlacementTable.even(num_experts, num_expert_actors)
        self.moe_layers = list(moe_layers)
        self.counts = [[0] * num_experts for _ in self.moe_layers]
        self.steps = 0

    def placement(self) -> PlacementTable:
        return self.table

    def report(self, expert_tokens: list[list[int]]) -> None:
        """Add one step's tokens per (MoE layer, logical expert), summed over attention workers."""
        for row, new in zip(self.counts, expert_tokens):
            for e, n in enumerate(new):
                row[e] += n
        self.steps += 1

    def stats(self) -> dict:
        per_actor = [[sum(row[lo:hi]) for lo, hi in self.table.ranges] for row in self.counts]
        imbalance = []
        for row in self.counts:
            mean = sum(row) / len(row) if row else 0.0
            imbalance.append(max(row) / mean if mean else 0.0)
        return {"epoch": self.table.epoch, "steps": self.steps, "moe_layers": self.moe_layers,
                "tokens_per_expert": self.counts, "tokens_per_actor": per_actor, "imbalance": imbalance}
