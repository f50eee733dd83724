"""Prefill/decode disaggregation (cluster/pd.py) on a real Ray cluster: a disaggregated engine (1 attention
× 1 expert actor) and a colocated one (2 workers), each the other's prefill engine in turn, on K2 and K3 —
the MLA latents and K3's KDA state read from one engine's actors and written into the other's over their
blocks channels or through Ray's object store (each transport both ways) —
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


def kill_and_wait(executor, kind: str, index: int, timeout_s: float = 30.0) -> None:
    """Kill ``kind[index]`` and wait until its process has ended: ray.kill returns before then, and a call over
    a direct channel could still be answered meanwhile (the fault would not land where the test puts it)."""
    import os
    import time

    import ray

    actor = executor.fleet.attention[index].actor
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    executor.kill(kind, index)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError(f"{kind}[{index}] (pid {pid}) still runs {timeout_s:g}s after its kill")


def both_layouts(name: str):
    """A disaggregated and a colocated engine of preset ``name`` (fp32), shut down after the module."""
    path = str(preset(name, seed=2, dtype="float32"))
    apart = engine(path, ClusterSpec(attention=1, experts=1))
    try:
        colocated = engine(path, ClusterSpec.of_workers(2))
    except BaseException:
        apart.shutdown()
        raise
    yield path, apart, colocated
    colocated.shutdown()
    apart.shutdown()


@pytest.fixture(scope="module")
def engines(ray_cluster):
    """K3's (its KDA state crosses too): every test here."""
    wait_until_idle()
    yield from both_layouts("kimi-k3-tiny")


@pytest.fixture(scope="module")
def k2_engines(engines):
    """K2's, beside K3's (8 actors: the session's cluster has 12 CPUs)."""
    yield from both_layouts("kimi-k2-tiny")


@pytest.mark.parametrize("model", ["k3", "k2"])
@pytest.mark.parametrize("direction", ["apart to colocated", "colocated to apart"])
def test_pd_across_layouts_gives_the_single_process_tokens(request, model, direction):
    path, apart, colocated = request.getfixturevalue("engines" if model == "k3" else "k2_engines")
    prefill, decode = (apart, colocated) if direction.startswith("apart") else (colocated, apart)
    seed = 1 if direction.startswith("apart") else 7
    ps = single.prompts(3, 70, 140, seed=seed) + single.prompts(1, 3, 10, seed=seed + 1)
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)] * 2
    want = [single.alone(path, [p], sp)[0] for p, sp in zip(ps, params)]
    transport = "channel" if direction.startswith("apart") else "object_store"  # each transport, both ways
    pd = Disaggregated(prefill, decode, min_uncached_tokens=32, transport=transport)
    seqs, routes = pd.generate(ps, params)
    assert [s.output_ids for s in seqs] == want and pd.status()["transport"] == transport
    assert [r.kind for r in routes] == ["pd"] * 3 + ["local"], [r.reason for r in routes]
    for r, p in zip(routes[:3], ps):
        assert r.hit == r.tokens == decode.scheduler.cache.deepest(len(p)) >= 64 and r.nbytes > 0
    s = pd.status()
    assert (s["leases"], s["prefill_blocks_leased"], s["decode_blocks_arriving"], s["failures"]) == (0, 0, 0, {})
    for eng in (prefill, decode):
        for r in range(len(eng.scheduler.cache.blocks)):
            st = eng.scheduler.cache.status(r)
            assert (st["blocks_held"], st["snapshots_held"]) == (0, 0), st


FAULTS = ("prefill killed mid-prefill", "prefill killed mid-transfer", "decode killed mid-transfer", "lease expiry",
          "decode killed after the first token", "client abort during transfer", "rejected before admission")


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_point_on_ray_costs_time_never_a_token_or_a_block(engines, fault, monkeypatch):
    """Each lifecycle point of the fault harness (test_pd_fake.py) once on the real cluster, with real kills:
    the streams that complete are the single process's, the others aborted, and nothing stays held."""
    path, apart, colocated = engines
    prefill, decode = apart, colocated
    seed = 20 + FAULTS.index(fault)
    ps = single.prompts(2, 70, 140, seed=seed) + single.prompts(1, 3, 10, seed=seed + 1)
    params = [SamplingParams(max_tokens=5, ignore_eos=True)] * 3
    now = [0.0]
    pd = Disaggregated(prefill, decode, min_uncached_tokens=32, lease_s=30.0, clock=lambda: now[0])
    gone = set()
    if fault == "prefill killed mid-prefill":
        launch = prefill.executor.launch

        def killing_launch(reqs, expert_req):
            sent = launch(reqs, expert_req)
            if not getattr(killing_launch, "done", False):
                killing_launch.done = True
                prefill.executor.kill("attention", 0)
            return sent

        monkeypatch.setattr(prefill.executor, "launch", killing_launch)
    elif fault in ("prefill killed mid-transfer", "decode killed mid-transfer", "lease expiry"):
        side = prefill if fault.startswith("prefill") or fault == "lease expiry" else decode
        method = "read_blocks" if side is prefill else "write_blocks"
        original = getattr(side.executor, method)

        def failing(*args, **kw):
            if fault == "lease expiry":
                now[0] += 60.0  # the lease ran out while the blocks were on their way
            elif not getattr(failing, "done", False):  # the replica the blocks are read from or written to dies
                failing.done = True
                kill_and_wait(side.executor, "attention" if side is prefill else "worker", args[0])
            return original(*args, **kw)

        monkeypatch.setattr(side.executor, method, failing)
    elif fault == "decode killed after the first token":
        collect = decode.executor.collect

        def killing_collect(step_no, sent):
            out = collect(step_no, sent)
            running = [q for q in decode.scheduler.running if len(q.token_ids) > q.num_prompt_tokens > 32]
            if not getattr(killing_collect, "done", False) and running:
                killing_collect.done = True  # (a long stream with its first tokens: it outlives the kill)
                # until the process is gone: a kill still on its way can miss the stream's last steps (a CI
                # run's streams ended first once the exchange went through mailboxes, and nothing recovered)
                kill_and_wait(decode.executor, "worker", running[0].replica)
            return out

        monkeypatch.setattr(decode.executor, "collect", killing_collect)
    elif fault == "client abort during transfer":
        gone.add(0)
    elif fault == "rejected before admission":
        params = params[:2] + [SamplingParams(max_tokens=100_000)]
    checks = {}

    def aborted(i):
        checks[i] = checks.get(i, 0) + 1
        return i in gone and checks[i] > 1  # after its prefill, during its transfer

    recovered = (len(prefill.stats.recoveries), len(decode.stats.recoveries))
    if fault == "rejected before admission":
        with pytest.raises(ValueError, match="exceeds"):
            pd.generate(ps, params, aborted=aborted)
        seqs, routes = [None] * 3, []
    else:
        seqs, routes = pd.generate(ps, params, deadline_s=120.0, aborted=aborted)
    for i, (p, sp, seq) in enumerate(zip(ps, params, seqs)):
        if seq is not None:
            assert seq.output_ids == single.alone(path, [p], sp)[0], (fault, i)
        else:
            assert i in gone or fault == "rejected before admission", (fault, i)
    s = pd.status()
    assert (s["leases"], s["prefill_blocks_leased"], s["decode_blocks_arriving"]) == (0, 0, 0), s
    kinds = [r.kind for r in routes]
    # the kills landed where they were aimed: that engine recovered (a killed prefill replica mid-transfer is
    # found at its engine's next step, in the next test's run)
    if fault in ("prefill killed mid-prefill", "decode killed mid-transfer", "decode killed after the first token"):
        side = 0 if fault.startswith("prefill") else 1
        assert len((prefill, decode)[side].stats.recoveries) == recovered[side] + 1, fault
    if fault == "decode killed after the first token":  # the kill came while streams were still running
        assert getattr(decode.executor.collect, "done", False) and all(s is not None for s in seqs)
        # and the killed worker's long streams were re-prefilled through the prefill engine
        assert s["recovered"].get("pd", 0) >= 1 and not s["recovered"].get("local"), s
    if fault in ("prefill killed mid-transfer", "decode killed mid-transfer"):
        # the dead replica's reads (or writes) fail until its engine's next step replaces it: each such transfer
        # is a local prefill; the short prompt was local anyway
        failed = s["failures"].get("TransportError", 0)
        assert set(s["failures"]) == {"TransportError"} and kinds.count("local") == 1 + failed, (s, kinds)
    if fault == "lease expiry":
        assert s["failures"].get("LeaseExpired") == 2 and kinds == ["local"] * 3, (s, kinds)
    if fault == "client abort during transfer":
        assert kinds[0] == "aborted" and seqs[0] is None
    for eng in (prefill, decode):
        for r in range(len(eng.scheduler.cache.blocks)):
            st = eng.scheduler.cache.status(r)
            assert (st["blocks_held"], st["snapshots_held"]) == (0, 0), (fault, st)
