"""ClusterSpec validation, bundle planning (pure), and reservations on a real 3-node Ray cluster."""

import subprocess
import sys
import time

import pytest
import ray

from cluster.spec import ClusterSpec, NodeInfo, plan_bundles
from cluster.topology import ReservationTimeoutError, reserve
from conftest import wait_until_idle


@ray.remote(num_cpus=0)
class WhereAmI:
    def where(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _where(options: dict) -> tuple[str, str]:
    actor = WhereAmI.options(**options).remote()
    try:
        return ray.get(actor.where.remote(), timeout=30)
    finally:
        ray.kill(actor)


# --- the spec (no Ray) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"attention": -1}, "attention"),
        ({"attention": 0, "experts": 0}, "attention or experts"),  # one kind at 0: a reservation that adds actors
        ({"experts": -1}, "experts"),
        ({"experts": 2.0}, "experts"),
        ({"expert_placement": "scatter"}, "expert_placement"),
        ({"attention_placement": "STRICT_PACK"}, "attention_placement"),
        ({"expert_resources": {"CPU": -1}}, "expert_resources"),
        ({"attention_resources": {"CPU": 0}}, "attention_resources"),
        ({"attention_resources": {}}, "attention_resources"),
        ({"expert_nodes": ()}, "expert_nodes"),
        ({"attention_nodes": "127.0.0.2"}, "attention_nodes"),
    ],
)
def test_spec_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ClusterSpec(**kwargs)


def test_spec_defaults_bundles_and_gpus():
    spec = ClusterSpec(attention=2, experts=3, expert_resources={"CPU": 1, "GPU": 1})
    assert spec.gpus and not ClusterSpec().gpus
    assert spec.bundles == [{"CPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert [spec.bundle_index("attention", 1), spec.bundle_index("expert", 0)] == [1, 2]
    with pytest.raises(IndexError):
        spec.bundle_index("expert", 3)
    assert "2 attention" in spec.describe() and "spread" in spec.describe()


# --- planning (no Ray) ------------------------------------------------------------------------


def _nodes(*cpus: float) -> list[NodeInfo]:
    return [NodeInfo(f"id{i}", f"127.0.0.{i + 2}", {"CPU": c}) for i, c in enumerate(cpus)]


def test_plan_packs_attention_and_spreads_experts():
    plan = plan_bundles(ClusterSpec(attention=2, experts=4), _nodes(4, 4, 4))
    assert len(set(plan[:2])) == 1
    assert set(plan[2:]) == {"id0", "id1", "id2"}


def test_plan_respects_free_resources_and_pack():
    plan = plan_bundles(ClusterSpec(attention=2, experts=3, expert_placement="pack"), _nodes(1, 2, 8))
    assert plan[:2] == ["id2", "id2"] and plan[2:] == ["id2"] * 3
    assert plan_bundles(ClusterSpec(experts=2, expert_resources={"CPU": 5}), _nodes(4, 4)) == ["id0", None, None]


def test_plan_pins_by_ip_or_id_and_rejects_unknown_nodes():
    spec = ClusterSpec(attention=1, experts=3, expert_nodes=("127.0.0.4", "id0"), attention_nodes=("127.0.0.3",))
    assert plan_bundles(spec, _nodes(4, 4, 4)) == ["id1", "id2", "id0", "id2"]
    with pytest.raises(ValueError, match="expert_nodes.*10.9.9.9"):
        plan_bundles(ClusterSpec(expert_nodes=("10.9.9.9",)), _nodes(4))


# --- reservations on the 3-node cluster ------------------------------------------------------


def test_reserve_packs_attention_spreads_experts_and_actors_land_there(idle_cluster):
    spec = ClusterSpec(attention=2, experts=4, attention_resources={"CPU": 1}, expert_resources={"CPU": 0.5})
    with reserve(spec, timeout_s=30) as r:
        attn = [r.node_of("attention", i) for i in range(2)]
        experts = [r.node_of("expert", i) for i in range(4)]
        assert len(set(attn)) == 1, attn
        assert len(set(experts)) == 3, experts
        for kind, n in (("attention", 2), ("expert", 4)):
            for i in range(n):
                options = r.attention_options(i) if kind == "attention" else r.expert_options(i)
                assert _where(options) == (r.node_of(kind, i), r.node_ip_of(kind, i))
        assert r.expert_options(0)["num_cpus"] == 0.5


def test_explicit_nodes_pin_bundles(idle_cluster):
    ips = idle_cluster.node_ips
    spec = ClusterSpec(attention=1, experts=3, attention_nodes=(ips[2],), expert_nodes=(ips[1], ips[0]))
    with reserve(spec, timeout_s=30) as r:
        assert r.node_ip_of("attention", 0) == ips[2]
        assert [r.node_ip_of("expert", i) for i in range(3)] == [ips[1], ips[0], ips[1]]
        assert _where(r.expert_options(1))[1] == ips[0]


def _live_groups() -> list[str]:
    return [pg_id for pg_id, t in ray.util.placement_group_table().items() if t["state"] != "REMOVED"]


def test_infeasible_reservation_fails_clearly_and_leaves_nothing(ray_cluster):
    before = _live_groups()
    spec = ClusterSpec(attention=1, experts=2, expert_resources={"CPU": 100})
    start = time.monotonic()
    with pytest.raises(ReservationTimeoutError) as err:
        reserve(spec, timeout_s=2)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "CPU: 100" in message and "no node has room" in message
    assert all(ip in message for ip in ray_cluster.node_ips) and "fix:" in message
    assert _live_groups() == before


def test_unknown_node_is_a_value_error(ray_cluster):
    with pytest.raises(ValueError, match="127.0.0.99"):
        reserve(ClusterSpec(expert_nodes=("127.0.0.99",)), timeout_s=2)


def test_release_frees_resources(idle_cluster):
    total = ray.cluster_resources()["CPU"]
    r = reserve(ClusterSpec(attention=2, experts=3, expert_resources={"CPU": 2}), timeout_s=30)
    assert ray.available_resources().get("CPU", 0) <= total - 8
    r.release()
    r.release()  # idempotent
    wait_until_idle(timeout_s=10)  # fails unless every CPU is free again


# --- LocalCluster lifecycle (own process: this one holds the fixture's driver) ---------------

LIFECYCLE = """
import os, ray
from cluster.local import LocalCluster
with LocalCluster(nodes=2, num_cpus=1) as c:
    pids, address = c.process_ids(), c.address
    ray.init(address=c.address)
    ips = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    assert ips == c.node_ips, ips
    assert ray.cluster_resources()["moeray_node_1"] == 1
    # every raylet (and so every worker it starts) runs with the node environment
    from cluster.config import RAY_NODE_ENV
    raylets = [p for p in pids if open(f"/proc/{p}/cmdline", "rb").read().split(b"\\0")[0].endswith(b"/raylet")]
    assert len(raylets) == 2, pids
    for p in raylets:
        env = open(f"/proc/{p}/environ", "rb").read().split(b"\\0")
        assert all(f"{k}={v}".encode() in env for k, v in RAY_NODE_ENV.items()), p
    # and the actors run at normal priority, not Ray's niceness 15 (cluster/config.py)
    nice = ray.remote(num_cpus=0)(lambda: os.nice(0))
    assert ray.get([nice.options(resources={f"moeray_node_{i}": 0.01}).remote() for i in (0, 1)], timeout=60) == [0, 0]
assert not ray.is_initialized()
assert ray._private.utils.read_ray_address() != address
alive = []
for pid in pids:
    try:
        os.kill(pid, 0)
        alive.append(pid)
    except ProcessLookupError:
        pass
assert not alive, alive
print("ok", len(pids))
"""


@pytest.mark.operator
def test_local_cluster_starts_distinct_nodes_and_stops_them_all():
    out = subprocess.run([sys.executable, "-c", LIFECYCLE], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
