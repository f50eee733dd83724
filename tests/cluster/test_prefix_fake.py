"""Prefix caching in the engine's own logic, against the fake executor (its cache checks that every
position read continues the reader's own prefix, and its hybrid state folds tokens exactly once
or comes from a snapshot): multi-turn conversations hit exactly the block-rounded shared length,
outputs equal the oracle through hits, eviction, preemption, failures and scale-down, the pools'
accounting holds, salts separate, and a snapshot under the wrong boundary is caught."""

import json
import random

import pytest

from cluster.prefix_cache import PrefixCache
from model.presets import preset_config
from model.sampling import SamplingParams

from test_engine_fake import drain, make, model_dir, oracle  # noqa: F401 (model_dir: the fixture)

PARAMS = SamplingParams(max_tokens=19, ignore_eos=True)


def grid_of(eng) -> int:
    """The granularity of a hit: a block, or the KDA snapshot grid on hybrid models."""
    return eng.scheduler.cache.grid or eng.scheduler.block_size


def turn(eng, prompt, params=PARAMS, salt=None):
    sid = eng.add_request(prompt, params, cache_salt=salt)
    drain(eng)
    return eng.release(sid).seq


def check_pools(eng) -> None:
    """free + cached + held = total on every replica, and each block's holds are exactly the block
    tables (and refresh jobs) that list it: nothing leaked, nothing held twice."""
    sched = eng.scheduler
    assert [sched.load(r) for r in range(len(sched.cache.blocks))] == [
        sum(1 for s in sched.running if s.replica == r) for r in range(len(sched.cache.blocks))], "the load counts drifted"
    for r, pool in enumerate(sched.cache.blocks):
        assert pool.num_free + pool.num_cached + pool.num_held == pool.num_blocks
        holds: dict[int, int] = {}
        for s in sched.running:
            if s.replica == r:
                for b in s.block_table:
                    holds[b] = holds.get(b, 0) + 1
        assert {b: n for b, n in enumerate(pool._ref) if n} == holds
        assert all(n == 1 or pool._hash[b] is not None for b, n in holds.items()), "a shared block is unregistered"
        if sched.cache.snaps is not None:  # snapshots: held exactly by the sequences that restore or save them
            snaps = sched.cache.snaps[r]
            assert snaps.num_free + snaps.num_cached + snaps.num_held == snaps.num_snapshots
            held: dict[int, int] = {}
            for s in sched.running:
                for snap in (s.cache.snapshot, s.cache.pending_snapshot[0] if s.cache.pending_snapshot else None):
                    if s.replica == r and snap is not None:
                        held[snap] = held.get(snap, 0) + 1
            assert {i: n for i, n in enumerate(snaps._ref) if n} == held


def test_turns_hit_the_block_rounded_shared_length_and_equal_the_oracle(model_dir):
    eng, fake = make(model_dir, num_blocks=256, max_tokens_per_step=96)
    rng = random.Random(3)
    g = grid_of(eng)
    convs = [[rng.randrange(1, 700) for _ in range(rng.randrange(50, 90))] for _ in range(2)]
    # the first turns arrive together (so they spread over both replicas), later ones one by one
    firsts = [eng.add_request(p, PARAMS) for p in convs]
    drain(eng)
    seqs = [eng.release(i).seq for i in firsts]
    homes: list[list[int]] = [[], []]
    shared = [0, 0]
    for t in range(5):
        for c in range(2):
            if t:
                before = dict(eng.scheduler.admitted)
                seq = turn(eng, convs[c])
                (home,) = [r for r, n in eng.scheduler.admitted.items() if n != before.get(r, 0)]
                homes[c].append(home)
                # everything the last turn wrote (all but its last token), rounded down to the grid
                assert seq.num_hit == (shared[c] - 1) // g * g, (t, c, seq.num_hit, shared[c])
            else:
                seq = seqs[c]
                assert seq.num_hit == 0
            assert seq.output_ids == oracle(eng, [convs[c]], PARAMS)[0]
            full = seq.token_ids
            convs[c] = full + [rng.randrange(1, 700) for _ in range(rng.randrange(3, 30))]
            shared[c] = len(full)
            check_pools(eng)
    assert all(len(set(h)) == 1 for h in homes), f"a conversation moved between replicas: {homes}"
    assert homes[0][0] != homes[1][0], "the first turns arrived together: one on each replica"
    assert sum(eng.scheduler.cache.hits.values()) > 0
    assert not eng.scheduler.cache.jobs and all(p.num_held == 0 for p in eng.scheduler.cache.blocks)


def test_load_outweighs_a_short_hit(model_dir):
    """With a huge load weight placement is least-loaded whatever is cached."""
    eng, _ = make(model_dir, num_blocks=256, prefix_load_weight=1e9)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 700) for _ in range(140)]
    first = turn(eng, prompt)
    home = next(iter(eng.scheduler.admitted))
    busy = eng.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    eng.pipelined()  # `busy` runs on the idle replica... and the conversation's home?
    sched = eng.scheduler
    loaded = next(s for s in sched.running if s.seq_id == busy).replica
    before = dict(sched.admitted)
    sid = eng.add_request(first.token_ids + [9, 9, 9], PARAMS)
    for _ in range(3):
        eng.pipelined()
    (went,) = [r for r, n in sched.admitted.items() if n != before.get(r, 0)]
    assert went != loaded, (home, loaded, went)
    eng.abort(busy)
    drain(eng)
    assert eng.release(sid).seq.output_ids == oracle(eng, [first.token_ids + [9, 9, 9]], PARAMS)[0]


def test_salts_separate_equal_prompts(model_dir):
    eng, _ = make(model_dir, num_blocks=256, attention=1)
    prompt = [random.Random(7).randrange(1, 700) for _ in range(150)]
    turn(eng, prompt, salt="tenant-a")
    assert turn(eng, prompt, salt="tenant-b").num_hit == 0
    assert turn(eng, prompt).num_hit == 0  # no salt is a salt of its own
    if eng.scheduler.cache.grid is None:  # a repeated prompt hits its own blocks; a hybrid, its prompt snapshot
        assert turn(eng, prompt, salt="tenant-a").num_hit == 148
    else:
        assert turn(eng, prompt, salt="tenant-a").num_hit == 128


def test_random_traffic_under_pressure_equals_the_oracle_and_keeps_the_pools_whole(model_dir):
    """200 requests with shared prefixes, small caches (eviction, preemption), a failed step and a
    dead attention replica: every output is the oracle's, and at every step each pool's free +
    cached + held is its total and its holds are exactly the block tables (and snapshots) that
    name them — nothing leaked, nothing held twice."""
    eng, fake = make(model_dir, num_blocks=48, block_size=4, max_tokens_per_step=64, max_num_seqs=8,
                     snapshot_bytes=1 << 20)
    rng = random.Random(11)
    bases = [[rng.randrange(1, 700) for _ in range(rng.randrange(40, 120))] for _ in range(4)]
    reqs = []
    for i in range(200):
        base = rng.choice(bases)
        p = base[: rng.randrange(1, len(base))] + [rng.randrange(1, 700) for _ in range(rng.randrange(1, 20))]
        reqs.append((p, SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True)))
    fake.fail_step(9, ("attention", 1))
    fake.fail_step(23)
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    for _ in range(20000):
        if not eng.busy:
            break
        eng.pipelined()
        if not eng.inflight:
            check_pools(eng)
    assert not eng.busy
    got = [eng.release(i).seq.output_ids for i in ids]
    assert got == oracle(eng, [p for p, _ in reqs], [sp for _, sp in reqs])
    assert sum(eng.scheduler.cache.hits.values()) > 0
    assert sum(p.num_evicted for p in eng.scheduler.cache.blocks) > 0, "no eviction: the test exerts no pressure"
    assert eng.stats.preemptions > 0
    check_pools(eng)


def test_scale_down_moves_conversations_and_they_still_answer_exactly(model_dir):
    eng, _ = make(model_dir, num_blocks=256)
    rng = random.Random(13)
    convs = [[rng.randrange(1, 700) for _ in range(100)] for _ in range(2)]
    for c in range(2):
        convs[c] = turn(eng, convs[c]).token_ids + [5, 6, 7]
    eng.scale_attention(1)
    for c in range(2):
        seq = turn(eng, convs[c])
        assert seq.output_ids == oracle(eng, [convs[c]], PARAMS)[0]


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3")
    (d / "config.json").write_text(json.dumps(preset_config("kimi-k3-tiny")))
    return d


def test_a_snapshot_under_the_wrong_boundary_is_caught(k3_dir, monkeypatch):
    """The fake's state is a fold of exactly the tokens computed, so a snapshot registered one grid
    step before the boundary whose state it holds makes the next turn's tokens differ from the
    oracle: the oracle comparisons above would catch such a bug, which a model whose tokens
    happen not to change would let through."""
    eng, _ = make(k3_dir, num_blocks=256, attention=1)
    g = eng.scheduler.cache.grid
    rng = random.Random(17)
    prompt = [rng.randrange(1, 700) for _ in range(3 * g + 10)]
    nxt = turn(eng, prompt).token_ids + [3, 4]
    good = oracle(eng, [nxt], PARAMS)[0]
    right = turn(eng, nxt)
    assert right.num_hit == 3 * g and right.output_ids == good  # as built: a deep hit, exact

    real = PrefixCache._snapshot_key
    monkeypatch.setattr(PrefixCache, "_snapshot_key", lambda self, seq, b: real(self, seq, b - g if b > g else b))
    eng2, _ = make(k3_dir, num_blocks=256, attention=1)
    turn(eng2, prompt)
    wrong = turn(eng2, nxt)
    assert wrong.num_hit > 0 and wrong.output_ids != good


def test_a_shared_system_prompt_gets_a_snapshot_at_its_branch_point(k3_dir):
    """Hybrid: the first conversation's prompt snapshot lies past the shared system prompt, so the
    second finds the system prompt's blocks but no snapshot there; it saves one at that branch
    point (the deepest grid boundary of the blocks it found), and the third hits it. Exact."""
    eng, _ = make(k3_dir, num_blocks=256, attention=1)
    g = eng.scheduler.cache.grid
    rng = random.Random(23)
    system = [rng.randrange(1, 700) for _ in range(2 * g + 20)]
    convs = [system + [rng.randrange(1, 700) for _ in range(70)] for _ in range(3)]  # prompt snapshots at 3g
    hits = []
    for prompt in convs:
        seq = turn(eng, prompt)
        hits.append(seq.num_hit)
        assert seq.output_ids == oracle(eng, [prompt], PARAMS)[0]
    assert hits == [0, 0, 2 * g]
