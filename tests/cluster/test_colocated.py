"""The colocated layout's engine on a real 3-node Ray cluster, for what the served tests
(tests/deploy/test_live.py's colocated apps: 2 and 3 workers, scaling, a killed and a stopped worker,
rebalancing, prefix caching, all equal to the single process) cannot see from outside:

- two micro-batches per step (``ping_pong``: a worker posts one micro-batch's exchange and computes the
  other's attention before collecting) equal the single process, on K3 (hybrid) with prefills chunked
  and sequences preempted;
- a warm standby worker takes a dead worker's index without a process start and loads only the dead
  worker's expert shard.
"""

import time

import pytest
import ray

import single
from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.spec import ClusterSpec
from model.sampling import SamplingParams
from tests.presets import preset

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
# small on purpose: prompts of up to 90 tokens prefill in chunks of 32, and 12 blocks of 16 hold
# fewer sequences than are sent at once, so some are preempted and recomputed
SMALL = dict(max_tokens_per_step=32, num_blocks=12, max_num_seqs=8, collective_timeout_s=5, step_timeout_s=30,
             hang_floor_s=2.0, heartbeat_timeout_s=1.5)


@pytest.fixture(scope="module")
def presets():
    return {name: preset(name, seed=21, dtype="float32")
            for name in ("kimi-k2-tiny", "kimi-k3-tiny")}


def _prompts(n, seed):
    return single.prompts(n, lo=10, hi=90, seed=seed)


def _run(eng: Engine, prompts, params, at=None) -> list[list[int]]:
    """Engine.generate's loop, with ``at(turn)`` called before each turn (a fault or a change)."""
    ids = [eng.add_request(p, params) for p in prompts]
    turn, deadline = 0, time.monotonic() + 300
    while eng.busy:
        assert time.monotonic() < deadline, "no end"
        turn += 1
        if at is not None:
            at(turn)
        eng.pipelined()
    return [eng.release(i).seq.output_ids for i in ids]


def test_two_micro_batches_equal_the_single_process(ray_cluster, presets):
    path = presets["kimi-k3-tiny"]
    prompts = _prompts(10, seed=3)
    expected = single.alone(path, prompts, GREEDY)
    eng = Engine(EngineConfig.of(str(path), ping_pong=True, **SMALL), ClusterSpec.of_workers(2)).start()
    try:
        assert eng.table.colocated and eng.table.shape() == "2 workers (attention + experts each)"
        assert _run(eng, prompts, GREEDY) == expected
        assert eng.stats.preemptions > 0, "the cache was not small enough to preempt"
        assert eng.stats.breakdown.get("steps", 0) > 0
    finally:
        eng.shutdown()


def _id(actor) -> str:
    return actor._actor_id.hex()


def test_a_standby_worker_takes_a_dead_ones_index_loading_only_its_shard(ray_cluster, presets):
    path = presets["kimi-k2-tiny"]
    prompts = _prompts(4, seed=11)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = single.alone(path, prompts, params)
    # on one node: the two workers' link is in shared memory (actors/shm.py), and the kill lands on it
    node = (ray_cluster.node_ips[2],)
    eng = Engine(EngineConfig.of(str(path), standby_attention=1, transport="shm", **SMALL),
                 ClusterSpec.of_workers(2, nodes=node)).start()
    try:
        fleet = eng.executor.fleet
        links = ray.get(fleet.attention[1].actor.exchange_links.remote(), timeout=30)
        assert links.pop("mailbox_messages") == 0 and links == {"shm": 1, "mailbox": 1}  # and mailboxes beside it
        (standby,) = fleet.standby
        ray.get(standby.actor.node_id.remote(), timeout=120)  # warm: its process and attention weights are up
        assert ray.get(standby.actor.held.remote(), timeout=30) == {}
        sent = []  # the decode steps before the kill went through the mailboxes (actors/board.py)

        def kill(turn: int) -> bool:
            if turn == 4:
                sent.append(ray.get(fleet.attention[1].actor.exchange_links.remote(), timeout=30)["mailbox_messages"])
                return eng.executor.kill("worker", 0)
            return False

        got = _run(eng, prompts, params, at=kill)
        assert got == expected
        assert sent and sent[0] > 0, sent
        assert _id(fleet.attention[0].actor) == _id(standby.actor)  # the standby took index 0: no process start
        change = eng.epochs.changes[-1]
        shard = eng.table.experts_of(0)
        assert change.kind == "recovery" and change.experts_loaded == sum(len(ids) for ids in shard.values())
        assert ray.get(standby.actor.held.remote(), timeout=30) == shard  # it loaded the dead worker's shard only
        assert len(fleet.standby) == 1 and _id(fleet.standby[0].actor) != _id(standby.actor)  # refilled
        links = ray.get(fleet.attention[0].actor.exchange_links.remote(), timeout=30)
        assert links.pop("mailbox_messages") > 0 and links == {"shm": 1, "mailbox": 1}  # the new epoch's, used
    finally:
        eng.shutdown()
