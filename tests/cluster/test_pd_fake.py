"""Prefill/decode disaggregation's faults, injected by the thousand (cluster/pd.py over two engines on the
fake executor: tests/cluster/fake_executor.py, whose cache remembers every position's token and prefix
hash, so a block written from the wrong place or a state restored from the wrong boundary changes the
tokens or fails the read). Every request lifecycle point the issue names — the prefill worker killed
mid-prefill, the replica holding the blocks killed mid-transfer, the transport failing on decode, the
lease running out, the decode worker killed after the first token, the client going away before, during
and after its transfer, a request refused before admission — at random, ≥ 10,000 faults in all: after
each, every allocator is back to idle (no block, snapshot or KDA slot held, no lease, no arrival), no
request outlives its deadline, and every stream that completed equals its fault-free run (the fake
model's oracle). This file passes with Ray not importable and without the shared conftest."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.pd import Disaggregated
from cluster.spec import ClusterSpec
from model.config import load_config
from model.presets import preset_config
from model.sampling import SamplingParams

from fake_executor import FakeExecutor, expected

FAULTS = ("prefill killed mid-prefill", "killed mid-transfer", "transport error", "lease expiry",
          "decode killed after the first token", "client abort before transfer", "client abort during transfer",
          "client abort while decoding", "rejected before admission")
TOTAL_FAULTS = 10_000
LEASE_S = 30.0


@pytest.fixture(scope="module", params=["kimi-k2-tiny", "kimi-k3-tiny"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(preset_config(request.param)))
    return d


class World:
    """A prefill engine (1 replica) and a decode engine (2 replicas) on fake executors, with a clock."""

    def __init__(self, model_dir):
        self.now = [0.0]
        self.mc = load_config(model_dir)
        self.engines, self.fakes = [], []
        for replicas in (1, 2):
            cfg = EngineConfig.of(model=str(model_dir), num_blocks=48, block_size=4, prefix_caching=True,
                                  max_tokens_per_step=256, num_slots=8)
            fake = FakeExecutor(num_blocks=48, block_size=4, hybrid=bool(self.mc.kda_layers), vocab=self.mc.vocab_size,
                                num_experts=self.mc.n_routed_experts)
            self.engines.append(Engine(cfg, ClusterSpec(attention=replicas, experts=1), executor=fake).start())
            self.fakes.append(fake)
        self.pd = Disaggregated(*self.engines, min_uncached_tokens=8, lease_s=LEASE_S, clock=lambda: self.now[0])
        for fake in self.fakes:
            fake.layout = self.pd.fp["decode"]

    def close(self):
        for eng in self.engines:
            eng.shutdown()

    def oracle(self, prompt, params):
        return expected(prompt, params, vocab=self.mc.vocab_size, stop_ids=self.engines[1].scheduler.stop_ids,
                        max_context=self.mc.max_position_embeddings)

    def idle(self) -> str | None:
        """What is still held anywhere (None: nothing)."""
        s = self.pd.status()
        if s["leases"] or s["prefill_blocks_leased"] or s["decode_blocks_arriving"]:
            return f"transfers hold {s}"
        for name, eng in zip(("prefill", "decode"), self.engines):
            cache = eng.scheduler.cache
            if eng.busy or eng.requests:
                return f"{name} still has work: {len(eng.requests)} requests"
            for r in range(len(cache.blocks)):
                st = cache.status(r)
                if st["blocks_held"] or st["snapshots_held"]:
                    return f"{name} replica {r} holds {st}"
                if cache.slots is not None and cache.slots[r].num_free != cache.num_slots:
                    return f"{name} replica {r} holds {cache.num_slots - cache.slots[r].num_free} KDA slots"
        return None


def episode(w: World, rng: random.Random, fault: str) -> Counter:
    """One batch of requests with ``fault`` injected; asserts the outcome; returns what happened."""
    grid = w.engines[1].scheduler.cache.grid or 4
    n = rng.randrange(2, 5)
    shared = [rng.randrange(1, 700) for _ in range(rng.randrange(grid, grid + 20))]
    ps = [(shared if rng.random() < 0.5 else []) + [rng.randrange(1, 700) for _ in range(rng.randrange(2, grid + 30))]
          for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 4), ignore_eos=True) for _ in ps]
    victim = rng.randrange(n)
    prefill, decode = w.engines
    pfake, dfake = w.fakes
    gone_at = {}  # request → how many of its aborted() checks pass before its client goes away
    if fault == "prefill killed mid-prefill":  # the victim's prompt long enough to cross: the prefill engine runs
        ps[victim] = shared + [rng.randrange(1, 700) for _ in range(grid + 10)]
        pfake.fail_next(1, ("attention", 0))
    elif fault == "killed mid-transfer":
        pfake.fail_reads = 1
    elif fault == "transport error":
        dfake.fail_writes = 1
    elif fault == "lease expiry":
        pfake.on_read = lambda: w.now.__setitem__(0, w.now[0] + LEASE_S)
    elif fault == "decode killed after the first token":  # streams long enough to be running at that step
        params = [SamplingParams(max_tokens=8, ignore_eos=True) for _ in ps]
        dfake.fail_step(decode.step_no + 2 + rng.randrange(3), ("attention", rng.randrange(2)))
    elif fault == "client abort before transfer":
        gone_at[victim] = 0
    elif fault == "client abort during transfer":
        gone_at[victim] = 1
    elif fault == "client abort while decoding":
        gone_at[victim] = 2 + rng.randrange(4)
    elif fault == "rejected before admission":
        params[victim] = SamplingParams(max_tokens=10_000)  # past a replica's cache: refused by validate
    checks = Counter()

    def aborted(i):
        checks[i] += 1
        return i in gone_at and checks[i] > gone_at[i]

    before, recovered = dict(w.pd.failures), Counter(w.pd.recovered)
    try:
        if fault == "rejected before admission":
            with pytest.raises(ValueError, match="exceeds"):
                w.pd.generate(ps, params, deadline_s=20.0, aborted=aborted)
            return Counter({"rejected": 1})
        seqs, routes = w.pd.generate(ps, params, deadline_s=20.0, aborted=aborted)
    finally:
        # a kill scheduled for a step that never came (the batch ended first) did not land: counted below
        landed = (pfake.failing[0] == 0 if fault.startswith("prefill killed") else
                  not dfake.faults if fault.startswith("decode killed") else False)
        pfake.failing = (0, [])
        pfake.fail_reads = dfake.fail_writes = 0
        pfake.on_read = None
        pfake.faults.clear()
        dfake.faults.clear()
    problem = w.idle()
    assert problem is None, f"{fault}: {problem}"
    out = Counter({f"landed: {fault}": 1} if landed else {})
    for i, (p, sp, seq, route) in enumerate(zip(ps, params, seqs, routes)):
        out[route.kind] += 1
        if seq is None:
            assert route.kind == "aborted" and i in gone_at, (fault, i, route)
            continue
        assert seq.output_ids == w.oracle(p, sp), (fault, i, route)
    failed = Counter(w.pd.failures) - Counter(before)
    out.update({f"recovered {k}": v for k, v in (Counter(w.pd.recovered) - recovered).items()})
    tried = out["pd"] + failed["TransportError"] + failed["LeaseExpired"]  # transfers that got their blocks read
    # (a LookupError is no fault of the harness: a long batch's prefills evicted an earlier one's blocks)
    if fault in ("killed mid-transfer", "transport error"):
        assert failed["TransportError"] == (1 if tried else 0), (fault, failed)
    if fault == "lease expiry":
        assert failed["LeaseExpired"] == tried and out["pd"] == 0, (fault, failed, out)
    else:
        assert failed["LeaseExpired"] == 0, (fault, failed)
    return out + failed


def test_ten_thousand_faults_leave_nothing_held_and_every_stream_exact(model_dir):
    rng = random.Random(55)
    seen: Counter = Counter()
    w = World(model_dir)
    try:
        for k in range(TOTAL_FAULTS // 2):  # half of the faults on each model (the module runs twice)
            fault = FAULTS[k % len(FAULTS)]
            seen[fault] += 1
            seen.update(episode(w, rng, fault))
            if k % 500 == 499:  # a fresh pair now and then: cold caches as well as warm ones
                w.close()
                w = World(model_dir)
    finally:
        w.close()
    # every fault point was injected, every route was taken, and the transfer failures were met
    assert all(seen[f] >= TOTAL_FAULTS // 2 // len(FAULTS) for f in FAULTS), seen
    assert seen["pd"] > 1000 and seen["local"] > 1000 and seen["aborted"] > 500, seen
    assert seen["TransportError"] > 500 and seen["LeaseExpired"] > 200, seen
    # a decode worker's lost sequences were re-prefilled through the prefill engine (their blocks brought back)
    assert seen["recovered pd"] > 0.5 * seen["decode killed after the first token"], seen
    # the kills landed mid-run (a step of the batch failed), not after the streams had ended
    for f in ("prefill killed mid-prefill", "decode killed after the first token"):
        assert seen[f"landed: {f}"] > 0.8 * seen[f], (f, seen[f"landed: {f}"], seen[f])


def test_async_front_recovers_a_decode_worker_through_the_prefill_engine(model_dir):
    """The async front (each engine on its own thread): a decode worker killed while long streams run; its
    sequences are re-prefilled on the prefill engine (reached from the decode engine's recovery through the
    requests' event loop) and their blocks brought back; every stream equals its fault-free run and nothing
    stays held."""
    import asyncio

    from cluster.aengine import AsyncEngine
    from cluster.apd import AsyncDisaggregated
    from cluster.stream import EngineRequest

    w = World(model_dir)
    prefill, decode = (AsyncEngine(e).start() for e in w.engines)
    front = AsyncDisaggregated(prefill, decode, min_uncached_tokens=8, lease_s=LEASE_S)
    front.max_recovering = 1  # brought back one at a time: the other waits, parked
    rng = random.Random(5)
    ps = [[rng.randrange(1, 700) for _ in range(rng.randrange(60, 80))] for _ in range(2)]  # (the fake pools: 48 blocks)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)

    async def one(p):
        return [t async for chunk in front.generate(EngineRequest(tuple(p), sp)) for t in chunk.token_ids]

    dfake, decode_engine = w.fakes[1], w.engines[1]
    collect = dfake.collect

    def killing_collect(step_no, sent):  # on the engine thread: once a stream has its first tokens, kill both
        out = collect(step_no, sent)
        if not getattr(killing_collect, "armed", False) and any(
                len(q.token_ids) > q.num_prompt_tokens for q in decode_engine.scheduler.running):
            killing_collect.armed = True
            dfake.fail_next(1, ("attention", 0), ("attention", 1))
        return out

    dfake.collect = killing_collect

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in ps)), 120)

    try:
        got = asyncio.run(main())
        assert killing_collect.armed and dfake.failing[0] == 0, "the kill did not land"
        assert got == [w.oracle(p, sp) for p in ps]
        assert front.core.recovered["pd"] >= 1 and not front.core.recovered["local"], front.core.status()
        assert front.routes == {"pd": 2}, front.core.status()
    finally:
        prefill.stop()
        decode.stop()
    try:
        assert w.idle() is None, w.idle()
    finally:
        w.close()
