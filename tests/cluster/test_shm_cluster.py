"""The exchange's shared-memory links (actors/shm.py) on a real 3-node Ray cluster: in one mesh, the pairs
on one node go through shared memory and the pairs across nodes keep their sockets, in both layouts, and
the tokens equal the single process's (so the two link kinds agree with each other); with the default
transport, an epoch across nodes makes no mailboxes. A killed worker on
a shared-memory link: tests/cluster/test_colocated.py (the standby test); stopped actors on them:
tests/cluster/test_hang.py."""

import ray

import single
from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.spec import ClusterSpec
from model.sampling import SamplingParams
from tests.presets import preset

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def _links(members) -> list[dict]:
    return ray.get([m.actor.exchange_links.remote() for m in members], timeout=60)


def test_one_mesh_with_shared_memory_and_socket_links_equals_the_single_process(ray_cluster):
    path = preset("kimi-k2-tiny", seed=31, dtype="float32")
    prompts = single.prompts(6, seed=31)
    expected = single.alone(path, prompts, PARAMS)
    a, b = ray_cluster.node_ips[1], ray_cluster.node_ips[2]
    shapes = {
        "colocated": (ClusterSpec.of_workers(3, nodes=(a, a, b)),  # workers 0 and 1 share a node
                      [{"shm": 1, "socket": 1}, {"shm": 1, "socket": 1}, {"socket": 2}]),
        "disaggregated": (ClusterSpec(attention=1, experts=2, attention_nodes=(a,), expert_nodes=(a, b)),
                          [{"shm": 1, "socket": 1}]),  # the attention actor: expert 0 beside it, expert 1 not
    }
    for layout, (spec, kinds) in shapes.items():
        with Engine(EngineConfig.of(str(path), collective_timeout_s=20, transport="shm"), spec) as eng:
            assert _links(eng.executor.fleet.attention) == kinds, layout
            assert [s.output_ids for s in eng.generate(prompts, PARAMS)] == expected, layout
    # the default transport across nodes: sockets, and no mailboxes for the pair that shares a node (the exchange
    # takes them only when every worker is on one node: a segment there would go unused)
    with Engine(EngineConfig.of(str(path), collective_timeout_s=20), shapes["colocated"][0]) as eng:
        assert _links(eng.executor.fleet.attention) == [{"socket": 2}] * 3
        assert [s.output_ids for s in eng.generate(prompts, PARAMS)] == expected
