"""Async scheduling (issue 10): a decode step is sent to the actors before the last step's results
are back, its last token standing as AHEAD for what the attention worker sampled itself. The
streams must be exactly those of the plain loop and of the single process — with stop tokens that
end a sequence while its next step is already out (that token is dropped), different length limits,
seeded sampling — and an actor that dies while two steps are out is recovered with both undone."""

import time

import pytest
import ray
import torch

from cluster.engine import Engine, EngineConfig
from cluster.spec import ClusterSpec
from model.loader import load_model
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from tests.presets import preset


@pytest.fixture(scope="module")
def k2():
    return preset("kimi-k2-tiny", seed=4, dtype="float32")


@pytest.fixture(scope="module")
def k3():
    return preset("kimi-k3-tiny", seed=4, dtype="float32")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 760, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)]


def _alone(path, prompts, params):
    net = load_model(path, progress=False)
    return [generate(ModelRunner(net, num_blocks=64, block_size=16, num_slots=2), [p], [sp])[0].output_ids
            for p, sp in zip(prompts, params)]


def _params(path, prompts):
    """Greedy runs of different lengths, two of them ending on a stop token their greedy stream
    reaches early (found by the oracle), and seeded sampling."""
    free = _alone(path, prompts[:2], [SamplingParams(max_tokens=24, ignore_eos=True)] * 2)
    return [SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(free[0][3],)),
            SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(free[1][6],)),
            SamplingParams(max_tokens=5, ignore_eos=True),
            SamplingParams(max_tokens=17, ignore_eos=True, temperature=0.9, top_p=0.9, seed=11),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, top_k=20, seed=3)]


def test_async_scheduling_gives_the_plain_loops_tokens(ray_cluster, k2):
    prompts = _prompts(5)
    params = _params(k2, prompts)
    expected = _alone(k2, prompts, params)
    assert len(expected[0]) < 24 and len(expected[1]) < 24  # the stop tokens really end those two early
    got = {}
    for on in (True, False):
        with Engine(EngineConfig.of(model=str(k2), async_scheduling=on), ClusterSpec(attention=2, experts=2)) as eng:
            got[on] = [s.output_ids for s in eng.generate(prompts, params)]
            assert (eng.stats.ahead_steps > 0) == on, eng.stats.ahead_steps
            assert all(a.num_held == 0 for a in eng.scheduler.cache.blocks)  # stopped sequences freed all
    assert got[True] == got[False] == expected


def _pipelined_with_a_kill(eng, kill, at_step: int):
    """Engine.generate's loop, killing an actor once a step is out ahead of the one being finished."""
    steps, killed = 0, False
    deadline = time.monotonic() + 120
    while eng.busy:
        assert time.monotonic() < deadline, "no progress after the kill"
        if not eng.inflight:
            eng.launch()
        eng.launch_ahead()
        steps += 1
        if steps >= at_step and not killed and len(eng.inflight) == 2:
            kill()
            killed = True
        eng.finish()
    assert killed, "no step was ever sent ahead"


@pytest.mark.parametrize("model,kind", [("k2", "expert"), ("k2", "attention"), ("k3", "expert")])
def test_actor_killed_with_a_step_sent_ahead_recovers_exactly(ray_cluster, request, model, kind):
    """K2: both steps' cache positions are undone; K3: a half-run step advanced the KDA state, so the
    sequences of both steps are re-prefilled."""
    path = request.getfixturevalue(model)
    prompts = _prompts(4, seed=9)
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 4
    expected = _alone(path, prompts, params)
    eng = Engine(EngineConfig.of(model=str(path), collective_timeout_s=5, step_timeout_s=30),
                 ClusterSpec(attention=2, experts=2)).start()
    try:
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        members = eng.executor.fleet.experts if kind == "expert" else eng.executor.fleet.attention
        _pipelined_with_a_kill(eng, lambda: ray.kill(members[1].actor, no_restart=True), at_step=4)
        got = [eng.release(i).seq.output_ids for i in ids]
        assert [c.kind for c in eng.epochs.changes] == ["recovery"]
        assert eng.stats.actor_failures == {kind: 1} and eng.stats.ahead_steps > 0
    finally:
        eng.shutdown()
    assert got == expected
