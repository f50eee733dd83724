"""Cluster shape → one placement group: which bundle sits on which Ray node.

Owns the reservation of a `ClusterSpec` (cluster/spec.py: how many attention replicas and expert
actors, what each needs, how they should be laid out) as a single placement group that reserves the
whole shape atomically, and the per-actor `.options(...)` that put each actor into its bundle. It
never creates actors, and never reads the environment.

Bundle order inside the group: attention replicas first (`attn_rank` 0..A-1), then expert actors
(`ep_rank` 0..E-1), i.e. bundle index = `attn_rank` or `A + ep_rank`.

One placement group has one Ray strategy, but the shape wants two (attention packed, experts
spread). So the layout is decided here, from the alive nodes and their free resources
(`cluster.spec.plan_bundles`, pure and Ray-free), and each bundle is pinned to its node with a per-bundle
label selector on the built-in `ray.io/node-id` label. Ray then only has to commit the plan,
all bundles or none.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .spec import ClusterSpec, Kind, NodeInfo, fmt_amount, fmt_resources, plan_bundles

NODE_ID_LABEL = "ray.io/node-id"  # set by Ray on every node (2.49+)


def free_nodes(exclude: frozenset[str] = frozenset()) -> list[NodeInfo]:
    """Alive nodes with their *free* resources now."""
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
    nodes = free_nodes(exclude)
    plan = plan_bundles(spec, nodes)
    while None in plan and time.monotonic() < deadline:
        time.sleep(0.25)
        nodes = free_nodes(exclude)
        plan = plan_bundles(spec, nodes)
    if None not in plan:
        selectors = [{NODE_ID_LABEL: node_id} for node_id in plan]
        pg = placement_group(spec.bundles, strategy="PACK", bundle_label_selector=selectors, name=name)
        if _wait_created(pg, deadline):
            return Reservation(spec, pg)
        remove_placement_group(pg)
    waited = time.monotonic() - start
    raise ReservationTimeoutError(_timeout_message(spec, plan, waited, {n.node_id: n for n in nodes}))


def reserve_pending(spec: ClusterSpec, *, name: str = "") -> "Reservation":
    """Ask for `spec`'s bundles in one placement group now, without waiting and without a plan of
    nodes (the free resources cannot place them yet): Ray creates the group once room appears — a node
    an autoscaler adds, other work that ends. :meth:`Reservation.created` says when."""
    if not ray.is_initialized():
        raise RuntimeError("reserve_pending() needs a Ray driver: call ray.init(address=...) first")
    return Reservation(spec, placement_group(spec.bundles, strategy="SPREAD", name=name))


def _timeout_message(spec: ClusterSpec, plan: list[str | None], waited: float, planned_on: dict[str, NodeInfo]) -> str:
    keys = sorted(set(spec.attention_resources) | set(spec.expert_resources))
    total = {k: sum(b.get(k, 0.0) for b in spec.bundles) for k in keys}
    lines = [
        f"could not reserve the cluster shape within {waited:.1f} s: {spec.describe()}",
        f"  asked: {len(plan)} bundles in one placement group, {fmt_resources(total)} in total",
    ]
    for kind in ("attention", "expert"):
        where = []
        for i in range(spec.count(kind)):
            node_id = plan[spec.bundle_index(kind, i)]
            where.append(f"{i}→{planned_on[node_id].ip}/{node_id[:8]}" if node_id else f"{i}→(no node has room)")
        lines.append(f"  planned {kind}: " + ", ".join(where))
    totals = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    nodes = free_nodes()
    lines.append(f"  the cluster has {len(nodes)} alive node(s), free / total:")
    for n in nodes:
        shown = sorted(set(keys) | {"CPU", "GPU"})
        total_of = totals.get(n.node_id, {})
        have = ", ".join(
            f"{k} {fmt_amount(k, n.available.get(k, 0.0))} / {fmt_amount(k, total_of.get(k, 0.0))}" for k in shown
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

    def created(self) -> bool:
        """Every bundle is reserved (at once for :func:`reserve`; once room appeared for :func:`reserve_pending`)."""
        return placement_group_table(self.placement_group).get("state") == "CREATED"

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
