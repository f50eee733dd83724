"""Warm standby actors (issue 9: recovery under 5 s): a dead actor's index is taken by a standby that
was started ahead and joined to no process group, a new standby starts in its place, and every
request still ends with exactly the tokens of a fault-free run. Without standbys, recovery starts a
new actor (tests/cluster/test_engine.py, tests/deploy/test_recovery.py)."""

import time

import pytest
import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.spec import ClusterSpec
from deploy.config import ServeConfig
from model.loader import load_model
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from tests.presets import preset

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def test_standby_settings_are_validated_and_reach_the_engine():
    for name in ("standby_attention", "standby_experts"):
        with pytest.raises(ValueError, match=name):
            EngineConfig.of(model="m", **{name: -1})
        with pytest.raises(ValueError, match=name):
            ServeConfig.parse({name: -1})
    cfg = ServeConfig.parse({"standby_attention": 1, "standby_experts": 2}).engine_config("m")
    assert (cfg.faults.standby_attention, cfg.faults.standby_experts) == (1, 2)
    assert (EngineConfig.of(model="m").faults.standby_attention, EngineConfig.of(model="m").faults.standby_experts) == (0, 0)


def _id(actor) -> str:
    return actor._actor_id.hex()


def _standby(eng, kind):
    (member,) = [m for m in eng.executor.fleet.standby if m.home.kind == kind]
    return member


def test_standbys_take_the_dead_actors_index_and_are_replaced(ray_cluster):
    path = preset("kimi-k2-tiny", seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 700, (4 + 5 * i,), generator=g).tolist() for i in range(4)]
    net = load_model(path, progress=False)
    expected = [generate(ModelRunner(net, num_blocks=64, block_size=16, num_slots=2), [p], [GREEDY])[0].output_ids
                for p in prompts]
    cfg = EngineConfig.of(model=str(path), collective_timeout_s=5, step_timeout_s=30, max_tokens_per_step=64,
                       standby_attention=1, standby_experts=1)
    eng = Engine(cfg, ClusterSpec(attention=2, experts=2)).start()
    try:
        for kind, index in (("expert", 1), ("attention", 0)):
            ray.get([m.actor.node_id.remote() for m in eng.executor.fleet.standby], timeout=120)  # warm
            standby = _standby(eng, kind)
            if kind == "expert":
                assert ray.get(standby.actor.held.remote(), timeout=30) == {}  # holds nothing until it takes over
            ids = [eng.add_request(p, GREEDY) for p in prompts]
            for _ in range(3):
                eng.step()
            members = eng.executor.fleet.experts if kind == "expert" else eng.executor.fleet.attention
            ray.kill(members[index].actor, no_restart=True)
            deadline = time.monotonic() + 120
            while eng.has_work:
                assert time.monotonic() < deadline, f"no progress after killing {kind}[{index}]"
                eng.step()
            assert [eng.release(i).seq.output_ids for i in ids] == expected, f"after killing {kind}[{index}]"
            now = eng.executor.fleet.experts if kind == "expert" else eng.executor.fleet.attention
            assert _id(now[index].actor) == _id(standby.actor)  # the standby took the dead one's index
            if kind == "expert":
                assert ray.get(now[index].actor.held.remote(), timeout=30) == eng.table.experts_of(index)
            fresh = _standby(eng, kind)  # the pool is full again, with a new actor
            assert _id(fresh.actor) not in {_id(m.actor) for m in eng.executor.fleet.attention + eng.executor.fleet.experts}
            assert ray.get(fresh.actor.node_id.remote(), timeout=120)
        assert [c.kind for c in eng.epochs.changes] == ["recovery", "recovery"] and eng.table.epoch == 2
        assert eng.stats.actor_failures == {"expert": 1, "attention": 1}
    finally:
        eng.shutdown()
