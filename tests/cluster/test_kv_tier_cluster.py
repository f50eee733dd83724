"""Recovery from the KV tier on a real Ray cluster: a colocated worker and a disaggregated attention actor,
each killed mid-stream at a long context — its sequences, re-admitted on the replacement, load their blocks
from the node tier (written through as they filled) and re-prefill only what was not written yet; every stream
equals its fault-free run. And a load across Ray nodes: one replica's node's tier read for another's."""

from __future__ import annotations

import pytest

import single
from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.spec import ClusterSpec
from conftest import wait_until_idle
from model.sampling import SamplingParams
from tests.presets import preset

BS = 16
STREAMS, PROMPT, ANSWER = 3, 400, 40


def computed(eng: Engine) -> int:
    return sum(st["queries_tokens"] - st["hit_tokens"] for st in eng.scheduler.cache_status())


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_a_killed_replica_s_streams_come_back_from_the_node_tier(ray_cluster, tmp_path, layout):
    wait_until_idle()
    path = str(preset("kimi-k2-tiny", seed=4, dtype="float32"))
    cfg = EngineConfig.of(model=path, num_blocks=128, block_size=BS, prefix_caching=True, max_tokens_per_step=512,
                          kv_offloading_size=0.25, kv_offloading_path=str(tmp_path))
    spec = ClusterSpec.of_workers(2) if layout == "colocated" else ClusterSpec(attention=1, experts=1)
    prompts = single.prompts(STREAMS, PROMPT, PROMPT + 1, seed=61)
    params = [SamplingParams(max_tokens=ANSWER, ignore_eos=True),
              SamplingParams(max_tokens=ANSWER, temperature=0.8, seed=3, ignore_eos=True)]
    params = [params[i % 2] for i in range(STREAMS)]
    want = [single.alone(path, [p], sp)[0] for p, sp in zip(prompts, params)]
    eng = Engine(cfg, spec).start()
    try:
        kind = "worker" if layout == "colocated" else "attention"
        collect, seen = eng.executor.collect, {}

        def killing_collect(step_no, sent):
            out = collect(step_no, sent)
            running = [q for q in eng.scheduler.running if len(q.output_ids) >= ANSWER // 2]
            if "victims" not in seen and len(running) == STREAMS:
                replica = running[0].replica
                victims = [q for q in running if q.replica == replica]
                # what the victims hold now, and what of it the tier has filed (its writes are asynchronous)
                assert eng.executor.tier(replica, "tier_flush") is True
                seen.update(victims=[(q.seq_id, len(q.token_ids)) for q in victims], before=computed(eng))
                eng.executor.kill(kind, replica)
            return out

        eng.executor.collect = killing_collect
        seqs = eng.generate(prompts, params)
        eng.executor.collect = collect
        assert [s.output_ids for s in seqs] == want
        assert "victims" in seen and len(eng.stats.recoveries) == 1, seen
        st = eng.tier.status()
        lengths = [n for _, n in seen["victims"]]
        # each victim's re-admission loaded its blocks back: it re-prefilled at most what the step in flight had
        # not yet carried to the actor (one block) and its tail past the last full block
        assert st["loaded_tokens"] >= sum(n // BS * BS - BS for n in lengths), (st, lengths)
        reprefilled = computed(eng) - seen["before"]
        assert reprefilled <= sum(2 * BS + 2 for _ in lengths), (reprefilled, lengths, st)
        # the operations a load from another node's tier takes, over a real blocks channel: an entry as stored (for
        # the other node's actor to check and load), and the names an index is rebuilt from
        chain = eng.scheduler.cache.chain_of(prompts[0], None, PROMPT // BS * BS)
        sent = eng.executor.tier(0, "tier_fetch", [("block", h) for h in chain[:2]])
        assert len(sent) == 2 and all(isinstance(e, bytes) and len(e) > 0 for e in sent)
        assert len(eng.executor.tier(0, "tier_names", 4)) == 4
    finally:
        eng.executor.collect = collect
        eng.shutdown()


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_a_replica_loads_what_another_ray_node_s_tier_holds(ray_cluster, tmp_path, monkeypatch, layout):
    """Two attention replicas (or two colocated workers) on two Ray nodes, each node's tier its own directory
    (``{node}`` in the path: the node's address; the nodes of this machine share its file system, as nodes on a
    shared mount would). A history written through on replica 1's node, then gone from both device pools, its next
    turn placed on replica 0: replica 0's node's tier holds none of it, the engine's index says replica 1's node
    does, and replica 0's actor reads the entries from replica 1's itself (a Ray call between the two nodes: the
    engine never carries their bytes), checks them on arrival, loads them and files them in its own node's tier.
    The tokens are the single process's."""
    from tests.cluster.test_kv_tier_engine import engine_ops, serve

    wait_until_idle()
    ips = ray_cluster.node_ips
    path = str(preset("kimi-k2-tiny", seed=4, dtype="float32"))
    cfg = EngineConfig.of(model=path, num_blocks=64, block_size=BS, prefix_caching=True, max_tokens_per_step=512,
                          kv_offloading_size=0.25, kv_offloading_path=str(tmp_path / "{node}"))
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    history = single.prompts(1, PROMPT + 60, PROMPT + 61, seed=62)[0]
    nodes = (ips[1], ips[2])
    spec = (ClusterSpec.of_workers(2, nodes=nodes) if layout == "colocated"
            else ClusterSpec(attention=2, experts=1, attention_nodes=nodes))
    eng = Engine(cfg, spec).start()
    asked = engine_ops(eng, monkeypatch)
    try:
        assert eng.executor.node_of(0) != eng.executor.node_of(1)
        serve(eng, history[:PROMPT], one, replica=1)
        assert eng.executor.tier(1, "tier_flush") is True
        files = lambda ip: list((tmp_path / ip).rglob("*.kv"))  # noqa: E731
        assert files(ips[2]) and not files(ips[1])  # written through on replica 1's node only
        eng.scheduler.cache.forget([0, 1])  # both device pools lose it (as after an eviction)
        prompt = history[:PROMPT + 60]
        assert serve(eng, prompt, one, replica=0) == single.alone(path, [prompt], one)[0]
        status = eng.tier.status()
        assert status["remote_blocks"] >= PROMPT // BS and status["loaded_tokens"] >= PROMPT // BS * BS, status
        assert eng.executor.tier(0, "tier_status")["received"] > 0
        # replica 0's actor called replica 1's through Ray: the entries went node to node, not through the engine
        assert "tier_fetch" not in asked and eng.executor.tier(1, "tier_status")["sent"] > 0, asked
        assert eng.executor.tier(0, "tier_flush") is True
        assert files(ips[1])  # filed in replica 0's own node's tier too
    finally:
        eng.shutdown()
