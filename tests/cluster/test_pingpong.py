"""Ping-pong micro-batches (issue 10): a step split into micro-batches, interleaved at every MoE
exchange, gives exactly the tokens of the unsplit step — greedy and seeded, MLA-only (K2) and
hybrid (K3, KDA state), with the sparse and the dense exchange — on 2 attention × 3 expert actors
over the 3 Ray nodes of the session cluster."""

import pytest
import torch

from cluster.engine import Engine, EngineConfig
from cluster.spec import ClusterSpec
from model.loader import load_model
from model.runner import ModelRunner, generate
from model.sampling import SamplingParams
from tests.presets import preset

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(8)]


@pytest.fixture(scope="module")
def presets():
    return {name: preset(name, seed=3, dtype="float32")
            for name in ("kimi-k2-tiny", "kimi-k3-tiny")}


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 760, (int(k),), generator=g).tolist() for k in torch.randint(3, 30, (n,), generator=g)]


# the dense format is what every other cluster test runs (auto picks it for ≤ k expert actors)
@pytest.mark.parametrize("preset,exchange", [("kimi-k2-tiny", "sparse"), ("kimi-k3-tiny", "dense")])
def test_ping_pong_on_and_off_give_identical_tokens(ray_cluster, presets, preset, exchange):
    path, prompts = presets[preset], _prompts()
    config = EngineConfig.of(model=str(path), max_tokens_per_step=512, exchange=exchange)
    with Engine(config, ClusterSpec(attention=2, experts=3)).start() as eng:
        nodes = {eng.executor.fleet.node_ip(m) for m in eng.executor.fleet.attention + eng.executor.fleet.experts}
        assert len(nodes) == 3, nodes
        out = {}
        for on in (False, True):
            eng.ping_pong = on
            before = eng.stats.micro_batched_steps
            out[on] = ([s.output_ids for s in eng.generate(prompts, GREEDY)],
                       [s.output_ids for s in eng.generate(prompts, SEEDED)])
            assert (eng.stats.micro_batched_steps > before) == on  # it really split the steps
    assert out[True] == out[False]
    net = load_model(path, progress=False)  # and both equal the single process
    alone = [generate(ModelRunner(net, num_blocks=64, block_size=16, num_slots=2), [p], [GREEDY])[0].output_ids
             for p in prompts]
    assert out[True][0] == alone
    assert len({tuple(o) for o in out[True][1]}) > 1  # the seeded draws are not all alike


def test_expert_threads_give_identical_tokens(ray_cluster, presets):
    """Expert actors running their GEMMs over 2 threads (``expert_threads``) give the single
    process's tokens, greedy and seeded; the threads are really there."""
    path, prompts = presets["kimi-k2-tiny"], _prompts(seed=1)
    config = EngineConfig.of(model=str(path), max_tokens_per_step=512, expert_threads=2)
    with Engine(config, ClusterSpec(attention=1, experts=2)).start() as eng:
        import ray

        counts = ray.get([m.actor.__ray_call__.remote(lambda w: w.gemm_threads and w.gemm_threads.count)
                          for m in eng.executor.fleet.experts], timeout=60)
        assert counts == [2, 2]
        greedy = [s.output_ids for s in eng.generate(prompts, GREEDY)]
        seeded = [s.output_ids for s in eng.generate(prompts, SEEDED)]
    net = load_model(path, progress=False)
    runner = lambda: ModelRunner(net, num_blocks=64, block_size=16, num_slots=2)  # noqa: E731
    assert greedy == [generate(runner(), [p], [GREEDY])[0].output_ids for p in prompts]
    assert seeded == [s.output_ids for s in generate(ModelRunner(net, num_blocks=256, block_size=16, num_slots=8),
                                                     prompts, SEEDED)]
