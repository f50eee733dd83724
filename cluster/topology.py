"""Cluster shape → one placement group: which bundle sits on which Ray node.

Owns the mapping from a `ClusterSpec` (how many attention replicas and expert actors, what each
needs, how they should be laid out) to a single placement group that reserves the whole shape
atomically, and the per-actor `.options(...)` that put each actor into its bundle. It never
creates actors, and never reads the environment.

Bundle order inside the group: attention replicas first (`attn_rank` 0..A-1), then expert actors
(`ep_rank` 0..E-1), i.e. bundle index = `attn_rank` or `A + ep_rank`.

One placement group has one Ray strategy, but the shape wants two (attention packed, experts
spread). So the layout is decided here, from the alive nodes and their free resources
(`plan_bundles`, pure and Ray-free), and each bundle is pinned to its node with a per-bundle
label selector on the built-in `ray.io/node-id` label. Ray then only has to commit the plan,
all bundles or none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

Kind = Literal["attention", "expert"]
PLACEMENTS = ("spread", "pack")
NODE_ID_LABEL = "ray.io/node-id"  # set by Ray on every node (2.49+)


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

    def describe(self) -> str:
        def part(n: int, what: str, res: dict[str, float], placement: str, nodes: tuple[str, ...] | None) -> str:
            where = f"on nodes {list(nodes)}" if nodes else placement
            return f"{n} {what} × {_fmt_resources(res)} ({where})"

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


def _alive_nodes(exclude: frozenset[str] = frozenset()) -> list[NodeInfo]:
    # available_resources_per_node is a DeveloperAPI; ray.nodes() only has totals.
    available = ray._private.state.available_resources_per_node()
    return [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(available.get(n["NodeID"], {})))
        for n in ray.nodes()
        if n["Alive"] and n["NodeID"] not in exclude
    ]


class ReservationTimeoutError(TimeoutError):
    """The cluster could not hold the requested shape within the timeout."""


def _wait_created(pg, deadline: float) -> bool:
    """Poll the group's state in the GCS. (``pg.wait`` runs a probe task inside the group, which
    can sit behind worker start-up on a busy node long after the bundles are reserved.)"""
    while True:
        if placement_group_table(pg).get("state") == "CREATED":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def remove_orphans(owner: str) -> int:
    """Remove the placement groups named ``owner/...`` left by an earlier incarnation of the same
    owner (a Serve replica that died: its actors die with it, its placement groups do not). Returns
    how many were removed. Only for an owner that holds no reservation of its own yet."""
    removed = 0
    for pg_id, info in placement_group_table().items():
        if info.get("name", "").startswith(f"{owner}/") and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            removed += 1
    return removed


def reserve(spec: ClusterSpec, *, timeout_s: float = 60, name: str = "",
            exclude: frozenset[str] = frozenset()) -> Reservation:
    """Reserve every attention and expert bundle of `spec` in one placement group (all or none),
    on no node in `exclude` (node ids: e.g. nodes known dead that the GCS still lists alive).

    Needs a connected driver (`ray.init(address=...)`). Raises ValueError for `*_nodes` that
    name unknown nodes, and ReservationTimeoutError (after removing the group) when the group is
    not ready within `timeout_s`.
    """
    if not ray.is_initialized():
        raise RuntimeError("reserve() needs a Ray driver: call ray.init(address=...) first")
    # Wait until the free-resource view has room for every bundle, pin each bundle to its planned
    # node (attention packed and experts spread inside one group), then wait for that one group.
    # A pending group is never removed and re-made early: Ray may still hold its bundles for a
    # while after a removal, which would starve the next attempt.
    start = time.monotonic()
    deadline = start + timeout_s
    nodes = _alive_nodes(exclude)
    plan = plan_bundles(spec, nodes)
    while None in plan and time.monotonic() < deadline:
        time.sleep(0.25)
        nodes = _alive_nodes(exclude)
        plan = plan_bundles(spec, nodes)
    if None not in plan:
        selectors = [{NODE_ID_LABEL: node_id} for node_id in plan]
        pg = placement_group(spec.bundles, strategy="PACK", bundle_label_selector=selectors, name=name)
        if _wait_created(pg, deadline):
            return Reservation(spec, pg)
        remove_placement_group(pg)
    waited = time.monotonic() - start
    raise ReservationTimeoutError(_timeout_message(spec, plan, waited, {n.node_id: n for n in nodes}))


def _fmt_amount(key: str, amount: float) -> str:
    return f"{amount / 2**30:.2f} GiB" if key in ("memory", "object_store_memory") else f"{amount:g}"


def _fmt_resources(res: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_fmt_amount(k, v)}" for k, v in sorted(res.items())) + "}"


def _timeout_message(spec: ClusterSpec, plan: list[str | None], waited: float, planned_on: dict[str, NodeInfo]) -> str:
    keys = sorted(set(spec.attention_resources) | set(spec.expert_resources))
    total = {k: sum(b.get(k, 0.0) for b in spec.bundles) for k in keys}
    lines = [
        f"could not reserve the cluster shape within {waited:.1f} s: {spec.describe()}",
        f"  asked: {len(plan)} bundles in one placement group, {_fmt_resources(total)} in total",
    ]
    for kind in ("attention", "expert"):
        where = []
        for i in range(spec.count(kind)):
            node_id = plan[spec.bundle_index(kind, i)]
            where.append(f"{i}→{planned_on[node_id].ip}/{node_id[:8]}" if node_id else f"{i}→(no node has room)")
        lines.append(f"  planned {kind}: " + ", ".join(where))
    totals = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    nodes = _alive_nodes()
    lines.append(f"  the cluster has {len(nodes)} alive node(s), free / total:")
    for n in nodes:
        shown = sorted(set(keys) | {"CPU", "GPU"})
        total_of = totals.get(n.node_id, {})
        have = ", ".join(
            f"{k} {_fmt_amount(k, n.available.get(k, 0.0))} / {_fmt_amount(k, total_of.get(k, 0.0))}" for k in shown
        )
        lines.append(f"    {n.ip} ({n.node_id[:8]}): {have}")
    lines.append(
        "  fix: add nodes with these resources, lower attention_resources / expert_resources, "
        "use fewer actors, check attention_nodes / expert_nodes, or raise timeout_s if nodes are still joining"
    )
    return "\n".join(lines)


class Reservation:
    """A ready placement group holding one bundle per actor of `spec`; hands out actor options."""

    def __init__(self, spec: ClusterSpec, pg: PlacementGroup) -> None:
        self.spec = spec
        self.placement_group = pg
        self._released = False

    def attention_options(self, i: int) -> dict[str, Any]:
        """kwargs for `AttentionActor.options(...)` placing `attn_rank` i into its bundle."""
        return self._options("attention", i)

    def expert_options(self, i: int) -> dict[str, Any]:
        """kwargs for `ExpertActor.options(...)` placing `ep_rank` i into its bundle."""
        return self._options("expert", i)

    def _options(self, kind: Kind, i: int) -> dict[str, Any]:
        index = self.spec.bundle_index(kind, i)
        res = self.spec.resources(kind)
        options: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0),
            "num_gpus": res.pop("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            ),
        }
        if "memory" in res:
            options["memory"] = res.pop("memory")
        if res:
            options["resources"] = res
        return options

    def node_of(self, kind: Kind, i: int) -> str:
        """The Ray node id (hex) that bundle (kind, i) is reserved on."""
        index = self.spec.bundle_index(kind, i)
        return placement_group_table(self.placement_group)["bundles_to_node_id"][index]

    def node_ip_of(self, kind: Kind, i: int) -> str:
        node_id = self.node_of(kind, i)
        for n in ray.nodes():
            if n["NodeID"] == node_id:
                return n["NodeManagerAddress"]
        raise LookupError(f"{kind} bundle {i} is on node {node_id}, which Ray no longer lists")

    def release(self) -> None:
        """Remove the placement group (idempotent). Actors in it are killed by Ray."""
        if not self._released:
            remove_placement_group(self.placement_group)
            self._released = True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
