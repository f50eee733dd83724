"""The KV tier under a real engine in this process (the in-process executor: real AttentionWorkers, caches and
prefix caches; the tier in a temporary directory): with a device pool far too small for the sessions, outputs
are the same with the tier on and off, greedy and seeded, on K2 and K3 (KDA snapshots written through and
loaded), and the tier serves prefix hits the device pool alone misses; a damaged entry costs a prefill, never a
token; a new engine on the same directory finds what an earlier one wrote."""

from __future__ import annotations

import sys

import pytest

import single
from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.inprocess import InProcessExecutor
from cluster.spec import ClusterSpec
from model.config import load_config
from model.sampling import SamplingParams
from tests.presets import preset

pytestmark = pytest.mark.ray_queue

SYSTEM, TURN, TURNS, SESSIONS = 400, 60, 5, 12  # a shared 400-token system prompt; each turn adds 60 tokens


def engine(path, tier_dir=None, replicas: int = 1, max_num_seqs: int = 4) -> Engine:
    knobs = dict(num_blocks=64, block_size=16, prefix_caching=True, max_tokens_per_step=256, max_num_seqs=max_num_seqs)
    if tier_dir is not None:
        knobs |= dict(kv_offloading_size=0.25, kv_offloading_path=str(tier_dir))
    cfg = EngineConfig.of(path, **knobs)
    spec = ClusterSpec(attention=replicas, experts=1)
    return Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))).start()


def sessions(seed: int) -> list[list[int]]:
    """Each session's whole history (its turns are prefixes of it after the system prompt)."""
    system = single.prompts(1, SYSTEM, SYSTEM + 1, seed=seed)[0]
    return [system + h for h in single.prompts(SESSIONS, TURN * TURNS, TURN * TURNS + 1, seed=seed + 1)]


def run(eng: Engine, histories, params) -> list[list[int]]:
    """Every session's turns, round by round (each turn resends its whole history), one request at a time;
    the tier's writes are filed after each round (they are asynchronous)."""
    out = []
    for t in range(1, TURNS + 1):
        for s, h in enumerate(histories):
            out.append(eng.generate([h[:SYSTEM + TURN * t]], params[s % len(params)])[0].output_ids)
        if eng.tier is not None:
            for r in range(len(eng.scheduler.cache.blocks)):
                assert eng.executor.tier(r, "tier_flush") is True
    return out


def serve(eng: Engine, prompt, params, replica: int | None = None) -> list[int]:
    """One request through ``eng`` to its end (started on ``replica``, if given): its output tokens."""
    rid = eng.add_request(prompt, params, replica=replica)
    while eng.busy:
        eng.pipelined()
    return eng.release(rid).seq.output_ids


def computed(eng: Engine) -> int:
    """Prompt tokens looked up and not found on the device pools (each one prefilled, or loaded from the tier)."""
    return sum(st["queries_tokens"] - st["hit_tokens"] for st in eng.scheduler.cache_status())


PARAMS = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=3, temperature=0.8, seed=11,
                                                                        ignore_eos=True)]


@pytest.fixture(scope="module", params=["kimi-k2-tiny", "kimi-k3-tiny"])
def served(request, tmp_path_factory):
    """A model's sessions served with the tier off and on: (path, histories, outputs off, outputs on, the engine
    with the tier, its directory)."""
    path = str(preset(request.param, seed=3, dtype="float32"))
    histories = sessions(56)
    off = engine(path)
    want = run(off, histories, PARAMS)
    computed_off = computed(off)
    off.shutdown()
    tier_dir = tmp_path_factory.mktemp("tier")
    on = engine(path, tier_dir)
    got = run(on, histories, PARAMS)
    yield request.param, path, histories, want, got, computed_off, on, tier_dir
    on.shutdown()


def test_sessions_eight_times_the_pool_are_served_from_the_tier_with_the_same_tokens(served):
    name, path, histories, want, got, computed_off, on, _ = served
    assert got == want
    st = on.tier.status()
    assert st["loaded_tokens"] > 0 and st["missed"] == 0, st
    if name == "kimi-k3-tiny":  # a hit there needs the KDA state at its end: snapshots came back too
        assert st["loaded_snapshots"] > 0, st
    # the device pool alone (64 blocks; each history ~44, twelve of them) missed what the tier brought back:
    # the engine with the tier prefilled less by about that much
    assert computed(on) <= computed_off - st["loaded_tokens"] // 2, (computed(on), computed_off, st)
    # and the single process agrees on the first round's turns
    first = [h[:SYSTEM + TURN] for h in histories[:2]]
    assert want[:2] == [single.alone(path, [p], sp)[0] for p, sp in zip(first, PARAMS)]


def last_turns(eng: Engine, histories) -> list[list[int]]:
    return [eng.generate([h], PARAMS[s % 2])[0].output_ids for s, h in enumerate(histories)]


def test_the_tier_outlives_its_engine(served):
    """A new engine on the same directory (a restart): a conversation's next request hits what the last one
    wrote, and its tokens are those of the first engine."""
    name, path, histories, want, _, _, _, tier_dir = served
    again = engine(path, tier_dir)
    try:
        got = last_turns(again, histories[:3])
        st = again.tier.status()
        assert got == want[-SESSIONS:][:3]
        # each request computed only what no hit can cover (its tokens past the last full block — on K3 past the
        # last snapshot boundary): the rest came from the tier (or, after the first, the shared system prompt)
        tail = len(histories[0]) - again.scheduler.cache.deepest(len(histories[0]))
        assert st["loaded_tokens"] > 0 and computed(again) == 3 * tail, (st, computed(again))
    finally:
        again.shutdown()


def test_damaged_entries_cost_a_prefill_never_a_token(served):
    """Every entry of the tier with one byte flipped: each load is a counted miss and the tokens are the same."""
    name, path, histories, want, _, _, _, tier_dir = served
    flipped = 0
    for f in tier_dir.rglob("*.kv"):
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x10
        f.write_bytes(bytes(data))
        flipped += 1
    assert flipped > 0
    again = engine(path, tier_dir)
    try:
        got = last_turns(again, histories[:3])
        st, actor = again.tier.status(), again.executor.tier(0, "tier_status")
        assert got == want[-SESSIONS:][:3]
        assert st["missed"] >= 1 and actor["tiers"][0]["misses"].get("corrupt", 0) >= 1, (st, actor)
        assert st["loaded_tokens"] == 0 and computed(again) > 3 * SYSTEM, st  # prefilled, not loaded
    finally:
        again.shutdown()


def test_blocks_held_for_the_tier_never_keep_a_request_waiting(tmp_path):
    """A request that ends at its prefill leaves 56 of the pool's 64 blocks held until a step carries their
    write-through; the next request needs 57 and nothing else runs: an empty step carries the writes, their
    holds end, and it runs (before, the engine planned empty steps for ever)."""
    path = str(preset("kimi-k2-tiny", seed=3, dtype="float32"))
    eng = engine(path, tmp_path, max_num_seqs=1)
    try:
        prompts = single.prompts(2, 900, 901, seed=9)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        ids = [eng.add_request(p, one) for p in prompts]
        for _ in range(100):
            if not eng.busy:
                break
            eng.pipelined()
        assert not eng.busy, "the engine never got through"
        assert [eng.release(i).seq.output_ids for i in ids] == [single.alone(path, [p], one)[0] for p in prompts]
        assert sum(st["blocks_held"] for st in eng.scheduler.cache_status()) == 0
    finally:
        eng.shutdown()


def test_pd_with_the_tier_on_both_engines_gives_the_single_process_tokens(tmp_path):
    """Prefill/decode disaggregation with the tier on both engines (one node's tier: the serving config gives
    both engines the same): both routes give the single process's tokens, both engines write through, and
    nothing stays held for a transfer or a write; a prompt its decode node's tier holds is loaded there, not
    sent (selective PD asks the tier too)."""
    from cluster.pd import Disaggregated

    path = str(preset("kimi-k2-tiny", seed=3, dtype="float32"))
    head = single.prompts(1, 100, 101, seed=7)[0]
    ps = [head + p for p in single.prompts(3, 4, 40, seed=8)] + single.prompts(2, 3, 20, seed=9)
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=6, temperature=0.9, seed=4,
                                                                            ignore_eos=True)]
    params = [params[i % 2] for i in range(len(ps))]
    want = [single.alone(path, [p], sp)[0] for p, sp in zip(ps, params)]
    pd = Disaggregated(engine(path, tmp_path), engine(path, tmp_path, replicas=2), min_uncached_tokens=32)
    try:
        seqs, routes = pd.generate(ps, params)
        assert [s.output_ids for s in seqs] == want
        assert [r.kind for r in routes] == ["pd"] * 3 + ["local"] * 2, [r.reason for r in routes]
        for eng in (pd.prefill, pd.decode):
            while eng.busy:  # (the last writes go out with a step of their own)
                eng.pipelined()
            copied = sum(a["copied"] for a in eng.tier.status()["actors"].values())
            assert copied > 0 and not eng.scheduler.cache.tier_pending()
            assert all(st["blocks_held"] == 0 for st in eng.scheduler.cache_status())
        s = pd.status()
        assert (s["leases"], s["prefill_blocks_leased"], s["decode_blocks_arriving"]) == (0, 0, 0), s
        assert pd.prefill.executor.tier(0, "tier_flush") is True
        # a new decode engine on the node (a restart): the long prompts' blocks are in its node's tier (the prefill
        # engine wrote them), so selective PD loads them there instead of sending them again
        pd.decode.shutdown()
        pd = Disaggregated(pd.prefill, engine(path, tmp_path, replicas=2), min_uncached_tokens=32)
        seqs, routes = pd.generate(ps[:3], params[:3])
        assert [s.output_ids for s in seqs] == want[:3]
        assert [r.kind for r in routes] == ["local"] * 3, [r.reason for r in routes]
        assert all("KV tier holds" in r.reason for r in routes), [r.reason for r in routes]
        # loaded, not computed: each prompt's decode prefill was its tail past the last full block alone
        cache = pd.decode.scheduler.cache
        assert pd.decode.tier.status()["loaded_tokens"] >= cache.deepest(len(ps[0]))
        assert computed(pd.decode) == sum(len(p) - cache.deepest(len(p)) for p in ps[:3])
    finally:
        pd.prefill.shutdown()
        pd.decode.shutdown()


@pytest.mark.parametrize("op, killed", [("tier_load", True), ("write", True), ("tier_probe", False), ("read", False)])
def test_a_blocks_call_that_times_out_kills_the_replica_only_if_it_writes_into_the_cache(op, killed):
    """A KV tier load (as a PD write) that did not answer in time may still write into blocks the engine gives
    back at once: the replica is killed (replaced at the next step, its cache empty) rather than risk a late write
    into blocks that hold another sequence's by then. A probe or a read that timed out changed nothing."""
    from types import SimpleNamespace

    from cluster.executor import RayExecutor
    from cluster.kv_transfer import TransportError

    class Silent:
        def send(self, n, request):
            pass

        def recv(self, n, deadline, alive=None):
            raise TimeoutError("attention[0] blocks did not answer")

        def close(self):
            pass

    member = SimpleNamespace(blocks=Silent(), blocks_calls=0, actor=None)
    kills = []
    fleet = SimpleNamespace(attention=[member], kill_member=kills.append, reachable=lambda m: True)
    ex = RayExecutor.__new__(RayExecutor)
    ex.fleet, ex.config = fleet, EngineConfig.of("m")
    what = op if op.startswith("tier") else f"{op}_blocks"
    with pytest.raises(TransportError, match=f"{what} on attention replica 0 failed: TimeoutError"):
        ex._blocks_call(0, "channel", op, [1, 2], None)
    assert kills == ([member] if killed else []) and member.blocks is None  # (its answers may be out of step)


def test_a_probe_waits_for_a_silent_actor_as_the_hang_watchdog_would_not_the_step_timeout():
    """A lookup's probe (between steps: the engine waits for it) gives up on a silent actor after the watchdog's
    hang_floor_s + heartbeat_timeout_s — a stopped actor costs the streams seconds, and its next step finds it hung
    — while a load, sized by its bytes, keeps the step timeout."""
    import time
    from types import SimpleNamespace

    from cluster.executor import RayExecutor
    from cluster.kv_transfer import TransportError

    waited = {}

    class Silent:
        def send(self, n, request):
            self.op = request[0]

        def recv(self, n, deadline, alive=None):
            waited[self.op] = deadline - time.monotonic()
            raise TimeoutError("attention[0] blocks did not answer")

        def close(self):
            pass

    ex = RayExecutor.__new__(RayExecutor)
    ex.config = EngineConfig.of("m", step_timeout_s=120, hang_floor_s=3, heartbeat_timeout_s=1.5)
    for op in ("tier_probe", "tier_fetch", "tier_load"):
        member = SimpleNamespace(blocks=Silent(), blocks_calls=0, actor=None)
        ex.fleet = SimpleNamespace(attention=[member], kill_member=lambda m: None, reachable=lambda m: True)
        with pytest.raises(TransportError, match=f"{op} on attention replica 0 failed"):
            ex.tier(0, op, [])
    assert 4.0 < waited["tier_probe"] <= 4.5 and waited["tier_fetch"] > 119 and waited["tier_load"] > 119, waited


def test_a_tier_slower_than_prefill_is_left_alone(tmp_path):
    """Loads happen while loading has measured cheaper per token than prefilling: with the load cost made dearer
    than the measured prefill cost, a request the tier holds is prefilled instead (counted as skipped), with the
    same tokens; made cheaper again, it loads."""
    path = str(preset("kimi-k2-tiny", seed=3, dtype="float32"))
    histories = sessions(5)[:2]
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    eng = engine(path, tmp_path)
    try:
        want = [eng.generate([h], one)[0].output_ids for h in histories]
        assert eng.executor.tier(0, "tier_flush") is True
        st = eng.tier.status()
        assert st["prefill_us_per_token"] is not None and st["skipped"] == 0  # measured from the prefills
        other = [eng.generate([h[:SYSTEM + 8]], one) for h in sessions(6)]  # evict the histories from the pool
        assert other
        eng.tier.load_cost = 10 * eng.tier.prefill_cost
        before = eng.tier.loaded_tokens
        assert eng.generate([histories[0]], one)[0].output_ids == want[0]
        assert eng.tier.skipped == 1 and eng.tier.loaded_tokens == before
        eng.tier.load_cost = eng.tier.prefill_cost / 10
        assert eng.generate([histories[1]], one)[0].output_ids == want[1]
        assert eng.tier.loaded_tokens > before
    finally:
        eng.shutdown()


def test_placement_prefers_the_replica_whose_node_s_tier_holds_the_prefix(tmp_path, monkeypatch):
    """Two replicas on two (logical) nodes: a history written through on replica 1's node, then gone from both
    device pools. Its next turn goes to replica 1 — the node whose tier holds it, as the engine's index says —
    though replica 0 ties on everything else (which it would take without the index), and is loaded there."""
    path = str(preset("kimi-k2-tiny", seed=3, dtype="float32"))
    eng = engine(path, tmp_path, replicas=2)
    monkeypatch.setattr(eng.executor, "node_of", lambda replica: f"node{replica}")
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    history = sessions(8)[0]
    try:
        serve(eng, history[:SYSTEM + TURN], one, replica=1)
        admitted = lambda: [st.get("admitted", 0) for st in eng.scheduler.cache_status()]  # noqa: E731
        assert admitted() == [0, 1]
        assert eng.executor.tier(1, "tier_flush") is True
        assert eng.tier._indexed(1, eng.scheduler.cache.chain_of(history, None, SYSTEM + TURN), 0) > 0
        eng.scheduler.cache.forget([0, 1])  # both device pools lose it (as after an eviction)
        got = serve(eng, history[:SYSTEM + 2 * TURN], one)
        assert admitted() == [0, 2] and eng.tier.loaded_tokens >= SYSTEM, (admitted(), eng.tier.status())
        assert got == single.alone(path, [history[:SYSTEM + 2 * TURN]], one)[0]
    finally:
        eng.shutdown()


def engine_ops(eng: Engine, monkeypatch) -> list[str]:
    """The KV tier operations ``eng`` asks of its actors from now on, in order (a list that grows)."""
    asked, tier = [], eng.executor.tier

    def recording(replica, op, *args):
        asked.append(op)
        return tier(replica, op, *args)

    monkeypatch.setattr(eng.executor, "tier", recording)
    return asked


def two_nodes(path, tmp_path, monkeypatch) -> Engine:
    """Two replicas on two (logical) nodes, each node's tier its own directory (``node0``, ``node1``)."""
    from actors.tier import ActorTier
    from cluster.kv_transfer import tier_spec

    eng = engine(path, tmp_path / "node0", replicas=2)
    monkeypatch.setattr(eng.executor, "node_of", lambda replica: f"node{replica}")
    worker = eng.executor.workers[1]
    worker.tier.close()
    spec = tier_spec(eng.config, load_config(path))
    worker.tier = ActorTier({**spec, "path": str(tmp_path / "node1")}, worker.cache)
    return eng


@pytest.mark.parametrize("name", ["kimi-k2-tiny", "kimi-k3-tiny"])
def test_a_replica_loads_what_another_node_s_tier_holds_through_that_node_s_replica(tmp_path, monkeypatch, name):
    """Two replicas on two (logical) nodes, each node's tier its own directory: a history written through on
    node 1, then gone from both device pools, its next turn placed on replica 0 (node 0's tier holds none of it).
    Replica 0 loads it from node 1's tier — the entries read there, sent, checked again on arrival — files them in
    its own node's tier, and the tokens are the single process's; K3's KDA snapshot comes across too. Then node
    1's replica fails while asked: the next lookup prefills, with the same tokens, and nothing is left held.
    Last, a new engine (a restart) indexes what each node's tier holds before its first lookup: the history's
    next turn goes to node 1, whose tier alone holds it, and loads there."""
    path = str(preset(name, seed=3, dtype="float32"))
    eng = two_nodes(path, tmp_path, monkeypatch)
    worker = eng.executor.workers[1]
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    history = sessions(9)[0]
    asked = engine_ops(eng, monkeypatch)
    try:
        serve(eng, history[:SYSTEM + TURN], one, replica=1)
        assert eng.executor.tier(1, "tier_flush") is True
        assert not any((tmp_path / "node0").rglob("*.kv"))  # node 0's tier holds none of it
        eng.scheduler.cache.forget([0, 1])
        prompt = history[:SYSTEM + 2 * TURN]
        assert serve(eng, prompt, one, replica=0) == single.alone(path, [prompt], one)[0]
        status = eng.tier.status()
        assert status["remote_blocks"] >= SYSTEM // 16 and status["loaded_tokens"] >= SYSTEM, status
        if name == "kimi-k3-tiny":
            assert status["loaded_snapshots"] == 1, status
        assert eng.executor.tier(0, "tier_status")["received"] > 0
        # replica 0's actor read them from replica 1's itself: the engine asked for no entry's bytes
        assert "tier_fetch" not in asked and eng.executor.tier(1, "tier_status")["sent"] > 0, asked
        assert eng.executor.tier(0, "tier_flush") is True
        assert any((tmp_path / "node0").rglob("*.kv"))  # filed on node 0 now too

        # node 1's replica cannot answer: the lookup on replica 0 finds only node 0's own tier
        eng.scheduler.cache.forget([0, 1])
        assert eng.executor.tier(0, "tier_flush") is True
        for f in (tmp_path / "node0").rglob("*.kv"):
            f.unlink()
        monkeypatch.setattr(worker.tier, "fetch", lambda keys: (_ for _ in ()).throw(OSError("node 1 is gone")))
        before = dict(status)
        assert serve(eng, prompt, one, replica=0) == single.alone(path, [prompt], one)[0]
        after = eng.tier.status()
        assert after["remote_blocks"] == before["remote_blocks"] and after["loaded_tokens"] == before["loaded_tokens"]
        assert all(st["blocks_held"] == st["snapshots_held"] == 0 for st in eng.scheduler.cache_status())
        assert eng.executor.tier(0, "tier_flush") is True
    finally:
        eng.shutdown()

    for f in (tmp_path / "node0").rglob("*.kv"):  # (what that prefill wrote there): node 1's tier alone holds it
        f.unlink()
    again = two_nodes(path, tmp_path, monkeypatch)
    try:
        prompt = history[:SYSTEM + 3 * TURN]
        assert serve(again, prompt, one) == single.alone(path, [prompt], one)[0]
        assert [st["admitted"] for st in again.scheduler.cache_status()] == [0, 1]
        assert again.tier.loaded_tokens >= SYSTEM and again.tier.remote_blocks == 0, again.tier.status()
    finally:
        again.shutdown()


def test_a_pass_probes_each_replica_s_tier_once_for_all_its_lookups(tmp_path, monkeypatch):
    """Four requests waiting at once on two replicas, each the next turn of a history the tier holds (its device
    pools emptied): the pass that looks them up asks each replica's actor once for what its tier holds of all of
    them (``tier_probes``), not once per request, and each request loads what it would alone — the single
    process's tokens."""
    path = str(preset("kimi-k2-tiny", seed=3, dtype="float32"))
    eng = engine(path, tmp_path, replicas=2, max_num_seqs=8)
    one = SamplingParams(max_tokens=2, ignore_eos=True)
    histories = [h[:SYSTEM + 2 * TURN] for h in sessions(12)[:4]]
    try:
        for h in histories:
            serve(eng, h[:SYSTEM + TURN], one)
        assert all(eng.executor.tier(r, "tier_flush") is True for r in (0, 1))
        eng.scheduler.cache.forget([0, 1])
        asked = engine_ops(eng, monkeypatch)
        before = eng.tier.status()
        chain_of, hashed = eng.scheduler.cache.chain_of, []

        def counted(tokens, *args):  # the tier's placements' hashing of a prompt's chain (the prefetch's, a lookup's)
            if sys._getframe(1).f_code.co_name == "_place":
                hashed.append(tuple(tokens))
            return chain_of(tokens, *args)

        monkeypatch.setattr(eng.scheduler.cache, "chain_of", counted)
        rids = [eng.add_request(h, one) for h in histories]
        while eng.busy:
            eng.pipelined()
        assert [eng.release(r).seq.output_ids for r in rids] == [single.alone(path, [h], one)[0] for h in histories]
        assert sorted(hashed) == sorted(tuple(h) for h in histories)  # each once: the prefetch's chain is the lookup's
        after = eng.tier.status()
        looked_up = after["lookups"] - before["lookups"]
        assert looked_up == 4 and after["loaded_tokens"] - before["loaded_tokens"] >= SYSTEM, after
        assert 1 <= asked.count("tier_probes") <= 2 and "tier_probe" not in asked, asked  # a round trip per replica
        assert after["probe_calls"] - before["probe_calls"] == asked.count("tier_probes")
    finally:
        eng.shutdown()

    # on two (logical) nodes, two histories (no prefix in common) node 1's tier alone holds, looked up for replica
    # 0 in one pass: node 0's tier asked once for both, then node 1's once for what its tier holds past that
    eng = two_nodes(path, tmp_path / "two", monkeypatch)
    apart = [sessions(13 + i)[0][:SYSTEM + TURN] for i in range(2)]
    try:
        for h in apart:
            serve(eng, h[:SYSTEM], one, replica=1)
        assert eng.executor.tier(1, "tier_flush") is True
        eng.scheduler.cache.forget([0, 1])
        asked = engine_ops(eng, monkeypatch)
        rids = [eng.add_request(h, one, replica=0) for h in apart]
        while eng.busy:
            eng.pipelined()
        assert [eng.release(r).seq.output_ids for r in rids] == [single.alone(path, [h], one)[0] for h in apart]
        assert asked[:2] == ["tier_probes", "tier_probes"] and "tier_probe" not in asked, asked
        assert eng.tier.status()["remote_blocks"] >= SYSTEM // 16
    finally:
        eng.shutdown()


def test_a_node_that_joins_later_has_its_tier_listed_into_the_index(tmp_path, monkeypatch):
    """The index lists each node's tier once, when it first sees the node: the nodes there at the first lookup,
    then one a scale change or a replacement brings (here replica 1 found on another node than before)."""
    path = str(preset("kimi-k2-tiny", seed=3, dtype="float32"))
    eng = two_nodes(path, tmp_path, monkeypatch)
    try:
        history = sessions(10)[0][:SYSTEM]
        serve(eng, history, SamplingParams(max_tokens=1, ignore_eos=True), replica=1)
        assert eng.executor.tier(1, "tier_flush") is True
        fresh = engine(path, tmp_path / "node0", replicas=2)  # a restart: both replicas on node 0 at first
        try:
            fresh.executor.workers[1].tier.close()
            fresh.executor.workers[1].tier = eng.executor.workers[1].tier  # (node 1's directory)
            monkeypatch.setattr(fresh.executor, "node_of", lambda replica: "node0")
            fresh.tier._list()
            assert fresh.tier.listed == {"node0"} and "node1" not in fresh.tier.index
            monkeypatch.setattr(fresh.executor, "node_of", lambda replica: f"node{replica}")  # replica 1 moved
            fresh.tier._list()
            chain = fresh.scheduler.cache.chain_of(history, None, SYSTEM // 16 * 16)
            assert fresh.tier.listed == {"node0", "node1"} and fresh.tier._indexed(1, chain, 0) == len(chain)
        finally:
            fresh.shutdown()
    finally:
        eng.shutdown()
