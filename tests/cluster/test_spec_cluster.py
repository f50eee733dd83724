"""Speculative decoding on a real Ray cluster (2 attention × 2 expert actors over the session's
nodes, the exchange over direct sockets): streams with drafts equal the single process's, token
for token, through an expert actor killed, an attention actor killed and an attention actor
stopped (SIGSTOP: found by the hang watchdog, killed and replaced), each during steps that carry
drafts — what `moeray chaos kill-expert` / `kill-attention` do to the actors, driven here on the
engine directly. The drafts come from an oracle drafter (the single process's tokens, one
corrupted at a third of the steps: tests/cluster/test_spec.py), so every step accepts and rejects."""

import os
import signal
import time

import pytest
import ray

from cluster.engine import Engine, EngineConfig
from cluster.spec import ClusterSpec
from model.config import load_config
from model.sampling import SamplingParams

import single
from test_hang import _alive, _end, _pid
from test_spec import OracleDrafter
from tests.presets import preset


@pytest.fixture(scope="module")
def k2():
    return preset("kimi-k2-tiny", seed=5, dtype="float32")


def test_streams_with_drafts_survive_kills_and_a_hang(ray_cluster, k2):
    prompts = single.prompts(4, seed=9)
    params = [SamplingParams(max_tokens=60, ignore_eos=True),
              SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.9, seed=4),
              SamplingParams(max_tokens=60, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=60, ignore_eos=True)]
    want = [p + single.alone(k2, [p], sp)[0] for p, sp in zip(prompts, params)]
    cfg = EngineConfig.of(model=str(k2), speculative={"method": "ngram", "num_speculative_tokens": 3},
                          collective_timeout_s=5, step_timeout_s=30, hang_floor_s=2.0, heartbeat_timeout_s=1.5)
    eng = Engine(cfg, ClusterSpec(attention=2, experts=2)).start()
    stopped = []
    try:
        eng.scheduler.drafts.drafter = OracleDrafter(want, load_config(k2).vocab_size)
        fleet = eng.executor.fleet
        nodes = {ray.get(m.actor.node_id.remote(), timeout=30) for m in fleet.attention + fleet.experts}
        assert len(nodes) >= 2, nodes  # over several nodes

        def stop_attention():
            pid = _pid(fleet.attention[0].actor)
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

        faults = {3: lambda: ray.kill(fleet.experts[1].actor, no_restart=True),
                  9: lambda: ray.kill(fleet.attention[1].actor, no_restart=True),
                  15: stop_attention}
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        deadline, turn = time.monotonic() + 300, 0
        while eng.busy:
            assert time.monotonic() < deadline, "no end after the faults"
            turn += 1
            if turn in faults:
                drafts = eng.stats.spec_draft_tokens
                # every stream outlives every fault: none has finished when it is made
                assert all(eng.requests[i].seq.finish_reason is None for i in ids), turn
                faults[turn]()
            eng.pipelined()
        got = [eng.release(i).seq.token_ids for i in ids]
        assert [c.kind for c in eng.epochs.changes] == ["recovery"] * 3
        assert eng.stats.actor_failures.get("expert") == 1 and eng.stats.actor_failures.get("attention", 0) >= 1
        assert eng.stats.actor_hangs == {"attention": 1}
        assert drafts > 0 and eng.stats.spec_accepted_tokens > 0
        assert eng.stats.spec_draft_tokens > eng.stats.spec_accepted_tokens
        assert not _alive(stopped[0])
    finally:
        for p in stopped:
            _end(p)
        eng.shutdown()
    assert got == want


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_mtp_drafts_on_the_cluster(ray_cluster, colocated):
    """The trained preset's MTP layer on 2 attention × 2 expert actors, and on 2 colocated workers: its
    routed experts live on the expert actors (the workers' shards) (one more MoE layer in the placement table, exchanged after the main layers'); its
    drafts are mostly accepted and the streams equal the single process's."""
    from model.tokenizer import Tokenizer

    mini = preset("kimi-k2-mini", dtype="float32")
    tok = Tokenizer.from_dir(mini)
    prompts = [tok.encode(t) for t in ("The weather in Paris is", "def add(a, b):\n    return", "Once upon a time")]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [single.alone(mini, [p], params)[0] for p in prompts]
    cfg = EngineConfig.of(model=str(mini), speculative={"method": "mtp", "full_draft_batch": 8})
    spec = ClusterSpec.of_workers(2) if colocated else ClusterSpec(attention=2, experts=2)
    with Engine(cfg, spec) as eng:
        cfg_layers = load_config(mini)
        assert eng.table.moe_layers[-1] == cfg_layers.num_hidden_layers  # the MTP layer's experts are placed
        got = [s.output_ids for s in eng.generate(prompts, params)]
        assert eng.stats.spec_accepted_tokens > eng.stats.spec_draft_tokens / 2
    assert got == want
