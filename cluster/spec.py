"""A cluster shape and its plan: how many attention replicas and expert actors, what each needs,
how they are laid out (:class:`ClusterSpec`), and which node each bundle goes to (:func:`plan_bundles`,
from the alive nodes' free resources). Pure: no Ray here (:mod:`cluster.topology` reserves the plan),
so the engine and its tests import a shape without Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["attention", "expert"]
PLACEMENTS = ("spread", "pack")


def _check_resources(name: str, resources: Mapping[str, float]) -> None:
    if not isinstance(resources, Mapping) or not resources:
        raise ValueError(f"{name} must be a non-empty dict of resource → amount, got {resources!r}")
    for key, amount in resources.items():
        if not isinstance(key, str) or not isinstance(amount, (int, float)) or amount < 0 or math.isnan(amount):
            raise ValueError(f"{name}[{key!r}] must be a non-negative number, got {amount!r}")
    if not any(amount > 0 for amount in resources.values()):
        raise ValueError(f"{name} must ask for some resource (Ray rejects empty bundles), got {dict(resources)}")


@dataclass(frozen=True)
class ClusterSpec:
    """How many actors of each kind, what each needs, and how they are laid out across nodes.

    `*_resources` are per actor, in Ray's units ("CPU", "GPU", "memory" in bytes, custom names).
    `*_placement`: "pack" = on as few nodes as possible, "spread" = on as many distinct nodes
    as possible. `*_nodes` overrides the placement: actor i goes to node `nodes[i % len(nodes)]`,
    each entry a node IP or a Ray node id (hex).
    """

    attention: int = 1
    experts: int = 1
    attention_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    expert_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    expert_placement: str = "spread"
    attention_placement: str = "pack"
    expert_nodes: tuple[str, ...] | None = None
    attention_nodes: tuple[str, ...] | None = None
    # the colocated layout: `attention` workers, each one process holding an attention replica and an
    # expert shard, in the attention bundles (`experts` is 0; workers spread like expert actors)
    colocated: bool = False

    def __post_init__(self) -> None:
        for name in ("attention", "experts"):  # 0 of one kind: a reservation that adds actors to a running shape
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
        if self.attention + self.experts == 0:
            raise ValueError("a cluster spec needs at least one actor (attention or experts ≥ 1)")
        _check_resources("attention_resources", self.attention_resources)
        _check_resources("expert_resources", self.expert_resources)
        for name in ("attention_placement", "expert_placement"):
            if getattr(self, name) not in PLACEMENTS:
                raise ValueError(f"{name} must be one of {PLACEMENTS}, got {getattr(self, name)!r}")
        for name in ("attention_nodes", "expert_nodes"):
            nodes = getattr(self, name)
            if nodes is None:
                continue
            if isinstance(nodes, str) or not nodes or not all(isinstance(n, str) and n for n in nodes):
                raise ValueError(f"{name} must be a non-empty tuple of node IPs or node ids, got {nodes!r}")
            object.__setattr__(self, name, tuple(nodes))
        if self.colocated and self.experts:
            raise ValueError(f"a colocated spec has workers only (attention={self.attention}, experts=0), "
                             f"got experts={self.experts}")
        # Copies: a frozen spec must not change when the caller's dict does.
        object.__setattr__(self, "attention_resources", {k: float(v) for k, v in self.attention_resources.items()})
        object.__setattr__(self, "expert_resources", {k: float(v) for k, v in self.expert_resources.items()})

    @property
    def gpus(self) -> bool:
        """True when any actor asks for a GPU (then the data plane is NCCL, else gloo)."""
        return self.attention_resources.get("GPU", 0) > 0 or self.expert_resources.get("GPU", 0) > 0

    @property
    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles, in bundle-index order (attention, then experts)."""
        return [dict(self.attention_resources)] * self.attention + [dict(self.expert_resources)] * self.experts

    def resources(self, kind: Kind) -> dict[str, float]:
        return dict(self.attention_resources if kind == "attention" else self.expert_resources)

    def count(self, kind: Kind) -> int:
        return self.attention if kind == "attention" else self.experts

    def bundle_index(self, kind: Kind, i: int) -> int:
        if kind not in ("attention", "expert"):
            raise ValueError(f"kind must be 'attention' or 'expert', got {kind!r}")
        if not 0 <= i < self.count(kind):
            raise IndexError(f"{kind} index {i} out of range: the spec has {self.count(kind)}")
        return i if kind == "attention" else self.attention + i

    @property
    def workers(self) -> int:
        """The colocated layout's workers (0 in the disaggregated one)."""
        return self.attention if self.colocated else 0

    @classmethod
    def of_workers(cls, workers: int, resources: dict[str, float] | None = None,
                   nodes: tuple[str, ...] | None = None) -> "ClusterSpec":
        """The colocated layout: ``workers`` processes, each attention replica and expert shard, spread."""
        return cls(attention=workers, experts=0, attention_resources=resources or {"CPU": 1.0},
                   attention_placement="spread", attention_nodes=nodes, colocated=True)

    def describe(self) -> str:
        def part(n: int, what: str, res: dict[str, float], placement: str, nodes: tuple[str, ...] | None) -> str:
            where = f"on nodes {list(nodes)}" if nodes else placement
            return f"{n} {what} × {fmt_resources(res)} ({where})"

        if self.colocated:
            return part(self.attention, "worker", self.attention_resources, self.attention_placement,
                        self.attention_nodes) + " (attention + experts each)"
        return (
            part(self.attention, "attention", self.attention_resources, self.attention_placement, self.attention_nodes)
            + " + "
            + part(self.experts, "expert", self.expert_resources, self.expert_placement, self.expert_nodes)
        )


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node as the planner sees it: its id (hex), IP and free resources."""

    node_id: str
    ip: str
    available: dict[str, float]


def plan_bundles(spec: ClusterSpec, nodes: Sequence[NodeInfo]) -> list[str | None]:
    """Node id for every bundle (bundle-index order); None where no node has room right now.

    Attention is placed first, then experts, each consuming the free resources it takes.
    Raises ValueError when `*_nodes` names a node that is not in `nodes`.
    """
    free = {n.node_id: dict(n.available) for n in nodes}
    plan: list[str | None] = []
    for kind in ("attention", "expert"):
        pinned = spec.attention_nodes if kind == "attention" else spec.expert_nodes
        placement = spec.attention_placement if kind == "attention" else spec.expert_placement
        field_name = f"{kind}_nodes"
        plan += _place(spec.count(kind), spec.resources(kind), placement, pinned, field_name, nodes, free)
    return plan


def _fits(free: dict[str, float], need: dict[str, float]) -> int:
    """How many bundles of `need` fit into `free`."""
    return min((int(free.get(r, 0.0) // q) for r, q in need.items() if q > 0), default=0)


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for r, q in need.items():
        free[r] = free.get(r, 0.0) - q


def _place(
    count: int,
    need: dict[str, float],
    placement: str,
    pinned: tuple[str, ...] | None,
    field_name: str,
    nodes: Sequence[NodeInfo],
    free: dict[str, dict[str, float]],
) -> list[str | None]:
    used: dict[str, int] = {n.node_id: 0 for n in nodes}  # bundles of this kind per node so far
    out: list[str | None] = []
    for i in range(count):
        if pinned is not None:
            want = pinned[i % len(pinned)]
            candidates = [n.node_id for n in nodes if want in (n.ip, n.node_id)]
            if not candidates:
                known = sorted({n.ip for n in nodes})
                raise ValueError(f"{field_name} names {want!r}, which is no alive Ray node; node IPs: {known}")
            # Several nodes can share one IP (several raylets on one host): spread among them.
            roomy = [c for c in candidates if _fits(free[c], need) > 0] or candidates
            chosen: str | None = min(roomy, key=lambda c: used[c])
        else:
            roomy = [n.node_id for n in nodes if _fits(free[n.node_id], need) > 0]
            if not roomy:
                chosen = None
            elif placement == "spread":  # fewest of this kind first, then most room
                chosen = min(roomy, key=lambda c: (used[c], -_fits(free[c], need)))
            else:  # pack: stay on a node already used, else the one with the most room
                chosen = min(roomy, key=lambda c: (used[c] == 0, -_fits(free[c], need)))
        if chosen is not None:
            _take(free[chosen], need)
            used[chosen] += 1
        out.append(chosen)
    return out


def fmt_amount(key: str, amount: float) -> str:
    return f"{amount / 2**30:.2f} GiB" if key in ("memory", "object_store_memory") else f"{amount:g}"


def fmt_resources(res: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {fmt_amount(k, v)}" for k, v in sorted(res.items())) + "}"
