"""Prefill/decode disaggregation (cluster/pd.py) on a real Ray cluster: a disaggregated engine (1 attention
× 1 expert actor) and a colocated one (2 workers), each the other's prefill engine in turn, on K3 — the
MLA latents and the KDA state read from one engine's actors and written into the other's through Ray —
give the single process's greedy and seeded tokens, every transferred prompt admitted on decode as a
hit of exactly what crossed, and nothing held afterwards."""

from __future__ import annotations

import pytest

import single
from conftest import wait_until_idle
from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.pd import Disaggregated
from cluster.spec import ClusterSpec
from model.sampling import SamplingParams
from tests.presets import preset


def engine(path, spec) -> Engine:
    cfg = EngineConfig.of(model=path, num_blocks=64, block_size=16, prefix_caching=True, max_tokens_per_step=128)
    return Engine(cfg, spec).start()


@pytest.fixture(scope="module")
def engines(ray_cluster):
    wait_until_idle()
    path = str(preset("kimi-k3-tiny", seed=2, dtype="float32"))
    apart = engine(path, ClusterSpec(attention=1, experts=1))
    try:
        colocated = engine(path, ClusterSpec.of_workers(2))
    except BaseException:
        apart.shutdown()
        raise
    yield path, apart, colocated
    colocated.shutdown()
    apart.shutdown()


@pytest.mark.parametrize("direction", ["apart to colocated", "colocated to apart"])
def test_pd_across_layouts_gives_the_single_process_tokens(engines, direction):
    path, apart, colocated = engines
    prefill, decode = (apart, colocated) if direction.startswith("apart") else (colocated, apart)
    seed = 1 if direction.startswith("apart") else 7
    ps = single.prompts(3, 70, 140, seed=seed) + single.prompts(1, 3, 10, seed=seed + 1)
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)] * 2
    want = [single.alone(path, [p], sp)[0] for p, sp in zip(ps, params)]
    pd = Disaggregated(prefill, decode, min_uncached_tokens=32)
    seqs, routes = pd.generate(ps, params)
    assert [s.output_ids for s in seqs] == want
    assert [r.kind for r in routes] == ["pd"] * 3 + ["local"], [r.reason for r in routes]
    for r, p in zip(routes[:3], ps):
        assert r.hit == r.tokens == decode.scheduler.cache.deepest(len(p)) >= 64 and r.nbytes > 0
    s = pd.status()
    assert (s["leases"], s["prefill_blocks_leased"], s["decode_blocks_arriving"], s["failures"]) == (0, 0, 0, {})
    for eng in (prefill, decode):
        for r in range(len(eng.scheduler.cache.blocks)):
            st = eng.scheduler.cache.status(r)
            assert (st["blocks_held"], st["snapshots_held"]) == (0, 0), st
