"""The engine's own logic against the fake executor (tests/cluster/fake_executor.py): scheduling,
async scheduling, stop handling, recovery decisions and epoch sequencing, with no Ray, no model and
no sockets. This file passes with Ray not importable and without the shared conftest
(test_fake_tests_need_no_ray runs it that way); what only a real cluster can show stays in the
Ray tests beside it."""

import json

import pytest

from cluster.config import EngineConfig
from cluster.engine import Engine
from cluster.errors import NoCapacity, RequestsFailed
from cluster.scheduler import Scheduler
from cluster.spec import ClusterSpec
from model.config import load_config
from model.presets import preset_config
from model.sampling import SamplingParams

from fake_executor import FakeCacheError, FakeExecutor, expected


@pytest.fixture(scope="module", params=["kimi-k2-tiny", "kimi-k3-tiny"])
def model_dir(request, tmp_path_factory):
    """A checkpoint directory holding only the preset's config.json (the engine reads nothing else)."""
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(preset_config(request.param)))
    return d


def make(model_dir, *, attention=2, experts=2, spec: ClusterSpec | None = None, **config) -> tuple[Engine, FakeExecutor]:
    """``spec``: another shape (e.g. the colocated layout's ``ClusterSpec.of_workers``)."""
    cfg = EngineConfig.of(model=str(model_dir), **{"num_blocks": 64, "block_size": 4, **config})
    mc = load_config(model_dir)
    fake = FakeExecutor(num_blocks=cfg.cache.num_blocks, block_size=cfg.cache.block_size, hybrid=bool(mc.kda_layers),
                        vocab=mc.vocab_size, num_experts=mc.n_routed_experts)
    spec = spec or ClusterSpec(attention=attention, experts=experts)
    return Engine(cfg, spec, executor=fake).start(), fake


def oracle(eng: Engine, prompts, params) -> list[list[int]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    mc = eng.model_cfg
    return [expected(p, sp, vocab=mc.vocab_size, stop_ids=eng.scheduler.stop_ids,
                     max_context=mc.max_position_embeddings) for p, sp in zip(prompts, plist)]


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 23) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 700) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


LONG = SamplingParams(max_tokens=24, ignore_eos=True)


def drain(eng: Engine, max_turns: int = 2000) -> None:
    """Engine.generate's loop, bounded: a broken engine that stops making progress fails here
    instead of hanging the suite."""
    for _ in range(max_turns):
        if not eng.busy:
            return
        eng.pipelined()
    raise AssertionError(f"no end after {max_turns} turns: {len(eng.scheduler.running)} running, "
                         f"{len(eng.scheduler.waiting)} waiting")


def run(eng: Engine, ps, params):
    """Requests to completion (as Engine.generate), bounded by :func:`drain`."""
    plist = params if isinstance(params, list) else [params] * len(ps)
    ids = [eng.add_request(p, sp) for p, sp in zip(ps, plist)]
    drain(eng)
    return [eng.release(i).seq for i in ids]


def started(eng: Engine, ps, params, turns: int) -> list[int]:
    """Requests added and ``turns`` turns of the loop run: their ids."""
    ids = [eng.add_request(p, params) for p in ps]
    for _ in range(turns):
        eng.pipelined()
    return ids


def _all_free(eng: Engine) -> bool:
    return all(a.num_held == 0 for a in eng.scheduler.cache.blocks)


# ---- scheduling and async scheduling ----------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_equal_the_oracle_with_chunked_prefill(model_dir, async_scheduling):
    eng, fake = make(model_dir, max_tokens_per_step=16, async_scheduling=async_scheduling)
    ps = prompts(6, seed=1)
    got = [s.output_ids for s in run(eng, ps, LONG)]
    assert got == oracle(eng, ps, LONG)
    assert (eng.stats.ahead_steps > 0) == async_scheduling
    assert any(ahead for *_, ahead in [e for e in fake.log if e[0] == "launch"]) == async_scheduling
    assert _all_free(eng) and not eng.inflight and not eng.scheduler.seqs


def test_preemption_recomputes_exactly(model_dir):
    eng, _ = make(model_dir, num_blocks=12, max_tokens_per_step=64)  # 48 tokens per replica: too few
    ps = prompts(8, seed=2, lo=8, hi=14)
    got = [s.output_ids for s in run(eng, ps, LONG)]
    assert eng.stats.preemptions > 0
    assert got == oracle(eng, ps, LONG) and _all_free(eng)


def test_stop_tokens_min_tokens_and_lengths(model_dir):
    eng, _ = make(model_dir)
    ps = prompts(4, seed=3)
    free_run = oracle(eng, ps, LONG)
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(free_run[0][5],)),  # stops at that token
        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(free_run[1][0],), min_tokens=3),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=7, ignore_eos=True),
    ]
    seqs = run(eng, ps, params)
    want = oracle(eng, ps, params)
    assert [s.output_ids for s in seqs] == want
    assert len(want[0]) == free_run[0].index(free_run[0][5]) + 1 and seqs[0].finish_reason == "stop"
    assert len(want[1]) >= 3 and [len(w) for w in want[2:]] == [1, 7]
    assert [s.finish_reason for s in seqs[2:]] == ["length", "length"]
    assert _all_free(eng)  # a sequence that stopped with a step sent ahead freed that step's block too


def test_abort_frees_at_once_and_others_go_on(model_dir):
    eng, _ = make(model_dir)
    ps = prompts(3, seed=4)
    ids = started(eng, ps, LONG, turns=3)
    eng.abort(ids[1])
    drain(eng)
    want = oracle(eng, ps, LONG)
    assert [eng.release(i).seq.output_ids for i in (ids[0], ids[2])] == [want[0], want[2]]
    assert _all_free(eng)


# ---- recovery decisions ------------------------------------------------------------------------
@pytest.mark.parametrize("dead", [("attention", 1), ("expert", 0)])
@pytest.mark.parametrize("at_step", [2, 6])
def test_a_failed_step_is_redone_exactly(model_dir, dead, at_step):
    """A step fails (with a step sent ahead of it when it is a decode step): both are undone, the dead
    member replaced in a recovery epoch, and every stream equals the fault-free one."""
    eng, fake = make(model_dir, max_tokens_per_step=32)
    fake.fail_step(at_step, dead)
    ps = prompts(5, seed=5)
    got = [s.output_ids for s in run(eng, ps, LONG)]
    assert got == oracle(eng, ps, LONG)
    assert [c.kind for c in eng.epochs.changes] == ["recovery"] and eng.table.epoch == 1
    assert eng.stats.actor_failures == {dead[0]: 1} and len(eng.stats.recoveries) == 1
    assert ("replace", 1, (dead,)) in fake.log and _all_free(eng)


def test_a_hung_member_is_counted_and_replaced_like_a_dead_one(model_dir):
    eng, fake = make(model_dir)
    fake.fail_step(5, ("attention", 1))
    fake.hangs.add(5)
    ps = prompts(4, seed=18)
    assert [s.output_ids for s in run(eng, ps, LONG)] == oracle(eng, ps, LONG)
    assert eng.stats.actor_hangs == {"attention": 1} and eng.stats.actor_failures == {"attention": 1}
    assert (eng.stats.last_hang.kind, eng.stats.last_hang.index, eng.stats.last_hang.step) == ("attention", 1, 5)
    assert eng.status()["hangs"] == {"attention": 1} and eng.status()["last_hang"]["step"] == 5


def test_members_on_a_lost_node_are_replaced_with_the_dead_one(model_dir):
    eng, fake = make(model_dir)
    fake.fail_step(4, ("expert", 0))
    fake.on_lost_node = [("attention", 0)]  # it answered the step with an error, then its node went
    ps = prompts(4, seed=6)
    assert [s.output_ids for s in run(eng, ps, LONG)] == oracle(eng, ps, LONG)
    probes = [e for e in fake.log if e[0] == "probe"]
    assert probes == [("probe", (("attention", 0), ("attention", 1), ("expert", 0)))]  # once, the failed ones
    assert ("replace", 1, (("attention", 0), ("expert", 0))) in fake.log


def test_no_capacity_then_heal(model_dir):
    eng, fake = make(model_dir)
    fake.fail_step(3, ("expert", 1))
    fake.no_capacity = 1
    ps = prompts(3, seed=7)
    ids = [eng.add_request(p, LONG) for p in ps]
    with pytest.raises(NoCapacity):
        drain(eng)
    assert not eng.epochs.settled and eng.launch_ahead() is None
    eng.heal()  # room again
    assert eng.epochs.settled
    drain(eng)
    assert [eng.release(i).seq.output_ids for i in ids] == oracle(eng, ps, LONG)


def test_work_that_fails_every_time_is_dropped_after_the_retries(model_dir):
    eng, fake = make(model_dir, max_step_retries=2)
    ps = prompts(2, seed=8)
    ids = [eng.add_request(p, LONG) for p in ps]
    fake.fail_next(3, ("attention", 0))  # the first step and both of its redos
    with pytest.raises(RequestsFailed) as err:
        drain(eng)
    assert sorted(err.value.seq_ids) == sorted(ids) and not eng.requests
    assert [c.kind for c in eng.epochs.changes] == ["recovery"] * 3
    after = prompts(1, seed=9)
    assert [s.output_ids for s in run(eng, after, LONG)] == oracle(eng, after, LONG)


# ---- epoch sequencing --------------------------------------------------------------------------
def test_scale_attention_down_and_up_while_streaming(model_dir):
    eng, fake = make(model_dir)
    ps = prompts(6, seed=10)
    ids = started(eng, ps, LONG, turns=4)
    down = eng.wait(eng.begin_scale_attention(1))
    assert down.moved_sequences > 0 and len(eng.scheduler.cache.blocks) == 1
    up = eng.wait(eng.begin_scale_attention(3))
    drain(eng)
    assert [eng.release(i).seq.output_ids for i in ids] == oracle(eng, ps, LONG)
    assert [(c.kind, c.epoch) for c in (down, up)] == [("attention", 1), ("attention", 2)]
    commits = [e for e in fake.log if e[0] == "commit"]
    assert [c[1] for c in commits] == [1, 2] and len(eng.scheduler.cache.blocks) == 3


def test_a_change_commits_only_at_a_step_boundary_once_ready(model_dir):
    eng, fake = make(model_dir)
    fake.ready_after = 3
    ps = prompts(3, seed=11)
    ids = [eng.add_request(p, LONG) for p in ps]
    t = eng.begin_scale_experts(1)
    with pytest.raises(ValueError, match="still being applied"):
        eng.begin_rebalance()
    while not t.done.done():
        eng.pipelined()
    launches_before = [e for e in fake.log if e[0] == "launch"]
    assert fake.log.index(("commit", 1, t.table.shape())) > fake.log.index(launches_before[0])
    assert all(e[2] == 0 for e in fake.log[: fake.log.index(("commit", 1, t.table.shape()))] if e[0] == "launch")
    drain(eng)
    assert [eng.release(i).seq.output_ids for i in ids] == oracle(eng, ps, LONG)
    assert eng.table.num_actors == 1 and eng.router.current() == fake.table


def test_a_change_whose_actors_never_start_is_off_and_serving_goes_on(model_dir):
    eng, fake = make(model_dir)
    fake.fail_prepare = True
    t = eng.begin_scale_experts(1)
    ps = prompts(2, seed=12)
    assert [s.output_ids for s in run(eng, ps, LONG)] == oracle(eng, ps, LONG)
    assert t.done.exception() is not None and eng.epochs.transition is None and eng.table.epoch == 0
    assert eng.router.pending is None  # the router dropped the proposal
    assert [c for c in fake.log if c[0] == "abort"] == [("abort", 1)]


@pytest.mark.parametrize("layout", ["disaggregated", "colocated"])
def test_a_failure_during_a_change_abandons_it_and_recovers(model_dir, layout):
    """Disaggregated: scale attention 2 → 1 while an expert actor dies; colocated: scale workers 2 → 3
    while a worker dies."""
    colocated = layout == "colocated"
    eng, fake = make(model_dir, spec=ClusterSpec.of_workers(2) if colocated else None)
    fake.ready_after = 10 ** 6  # still preparing when the step fails
    dead = ("worker", 0) if colocated else ("expert", 1)
    fake.fail_step(3, dead)
    ps = prompts(3, seed=13)
    ids = [eng.add_request(p, LONG) for p in ps]
    t = eng.begin_scale_workers(3) if colocated else eng.begin_scale_attention(1)
    drain(eng)
    assert "interrupted" in str(t.done.exception())
    assert [c.kind for c in eng.epochs.changes] == ["recovery"] and eng.table.num_attention == 2
    assert ("abort", 1) in fake.log and ("replace", 2, (dead,)) in fake.log  # epochs are never reused
    assert [eng.release(i).seq.output_ids for i in ids] == oracle(eng, ps, LONG)


@pytest.mark.parametrize("n,dead", [(1, ("expert", 1)), (1, ("attention", 0)), (3, ("attention", 1))])
def test_an_actor_lost_while_the_group_re_forms_abandons_the_change_and_recovers(model_dir, n, dead):
    """Scale attention to ``n`` (down: sequences already moved; up), an actor dies at the regroup:
    the change is off, the old shape recovers in a recovery epoch, every stream is exact."""
    eng, fake = make(model_dir)
    ps = prompts(5, seed=17)
    ids = started(eng, ps, LONG, turns=3)
    t = eng.begin_scale_attention(n)
    fake.fail_commit = [dead]
    drain(eng)
    assert "re-formed" in str(t.done.exception())
    assert [c.kind for c in eng.epochs.changes] == ["recovery"] and eng.table.num_attention == 2
    assert len(eng.scheduler.cache.blocks) == 2 and eng.router.pending is None
    assert ("replace", 2, (dead,)) in fake.log  # epoch 1 was the abandoned change's
    assert [eng.release(i).seq.output_ids for i in ids] == oracle(eng, ps, LONG)


# ---- the colocated layout: W workers, each an attention replica and an expert shard ----------------------
def workers(model_dir, n=2, **config) -> tuple[Engine, FakeExecutor]:
    return make(model_dir, spec=ClusterSpec.of_workers(n), **config)


@pytest.mark.parametrize("ping_pong", [False, True])
def test_colocated_steps_equal_the_oracle_with_chunked_prefill_and_preemption(model_dir, ping_pong):
    """Each worker is sent its own chunks and every worker's tokens per micro-batch (the fake checks
    them against the chunks); 12 blocks of 4 a worker hold fewer sequences than are sent."""
    eng, fake = workers(model_dir, max_tokens_per_step=16, num_blocks=12, ping_pong=ping_pong)
    assert eng.table.colocated and eng.table.num_actors == eng.table.num_attention == 2
    ps = prompts(8, seed=30)
    assert [s.output_ids for s in run(eng, ps, LONG)] == oracle(eng, ps, LONG)
    assert eng.stats.preemptions > 0 and _all_free(eng)
    assert (eng.stats.micro_batched_steps > 0) == ping_pong


@pytest.mark.parametrize("at_step", [2, 6])
def test_colocated_a_dead_worker_is_replaced_and_every_stream_is_exact(model_dir, at_step):
    """A worker is both halves: its death loses its sequences' caches (re-prefilled elsewhere or on the
    replacement) and its shard (reloaded); one failure of kind "worker", one recovery."""
    eng, fake = workers(model_dir, max_tokens_per_step=32)
    fake.fail_step(at_step, ("worker", 1))
    ps = prompts(5, seed=31)
    assert [s.output_ids for s in run(eng, ps, LONG)] == oracle(eng, ps, LONG)
    assert [c.kind for c in eng.epochs.changes] == ["recovery"] and eng.table.colocated
    assert eng.stats.actor_failures == {"worker": 1} and ("replace", 1, (("worker", 1),)) in fake.log
    assert _all_free(eng)


def test_colocated_scale_workers_down_and_up_while_streaming(model_dir):
    """Both halves in one change: 2 → 1 (the removed worker's sequences re-prefilled on the other,
    every expert on it) → 3; attention and experts alone cannot change in this layout."""
    eng, fake = workers(model_dir)
    ps = prompts(6, seed=32)
    ids = started(eng, ps, LONG, turns=4)
    down = eng.wait(eng.begin_scale_workers(1))
    assert down.kind == "workers" and down.moved_sequences > 0 and len(eng.scheduler.cache.blocks) == 1
    assert eng.table.num_actors == 1 and len(eng.table.experts_of(0)[eng.table.moe_layers[0]]) == eng.table.num_experts
    up = eng.wait(eng.begin_scale_workers(3))
    drain(eng)
    assert [eng.release(i).seq.output_ids for i in ids] == oracle(eng, ps, LONG)
    assert (up.kind, up.new_shape) == ("workers", "3 workers (attention + experts each)")
    assert eng.table.colocated and len(eng.scheduler.cache.blocks) == 3
    for refused in (lambda: eng.begin_scale_attention(2), lambda: eng.begin_scale_experts(2)):
        with pytest.raises(ValueError, match="colocated"):
            refused()


def test_the_automatic_policy_rebalances_a_skewed_load(model_dir):
    eng, fake = make(model_dir, auto_rebalance=True, rebalance_window_steps=8, rebalance_interval_s=0.0,
                     rebalance_threshold=1.2)
    fake.routing = lambda t: 0  # every token to expert 0: expert actor 0 takes all
    ps = prompts(4, seed=14)
    assert [s.output_ids for s in run(eng, ps, LONG)] == oracle(eng, ps, LONG)
    kinds = [c.kind for c in eng.epochs.changes]
    assert kinds and set(kinds) == {"rebalance"} and ("prepare", "rebalance", 1) in fake.log


def test_the_router_keeps_the_counts_once(model_dir):
    eng, _ = make(model_dir)
    ps = prompts(3, seed=15)
    run(eng, ps, LONG)
    totals = eng.router.totals()
    computed = eng.stats.tokens_computed
    assert totals.shape == (len(eng.model_cfg.moe_layers), eng.model_cfg.n_routed_experts)
    assert all(int(row.sum()) == computed for row in totals)  # top-1 in the fake: one pair per token per layer
    assert sum(eng.router.actor_totals()) == computed * len(eng.model_cfg.moe_layers)
    assert not hasattr(eng.stats, "expert_tokens_total")


# ---- the fake can fail: break the engine and it notices ---------------------------------------------
def test_a_broken_rewind_is_caught(model_dir, monkeypatch):
    """Sabotage the scheduler's rewind (forget to undo the failed step's positions, or to re-prefill
    hybrid sequences): the same recovery run must then go wrong, loudly or in the tokens."""
    def rewind_nothing(self, failed, dead_replicas, *, recompute_state):
        self.requeue([s for s in self.running if s.replica in dead_replicas])

    monkeypatch.setattr(Scheduler, "rewind", rewind_nothing)
    eng, fake = make(model_dir, max_tokens_per_step=32)
    fake.fail_step(6, ("expert", 0))
    ps = prompts(5, seed=5)
    ids = [eng.add_request(p, LONG) for p in ps]
    try:
        drain(eng, max_turns=500)
    except (FakeCacheError, AssertionError):
        return  # caught loudly: a cache read that went wrong, or sequences that never run again
    got = [eng.requests[i].seq.output_ids for i in ids]
    assert got != oracle(eng, ps, LONG)


def test_a_broken_ahead_token_is_caught(model_dir, monkeypatch):
    """Sabotage async scheduling: the step sent ahead decodes a made-up token instead of AHEAD."""
    real = Scheduler.decode_ahead
    monkeypatch.setattr(Scheduler, "decode_ahead", lambda self, seqs, token: real(self, seqs, 1))
    eng, _ = make(model_dir)
    ps = prompts(3, seed=16)
    got = [s.output_ids for s in run(eng, ps, LONG)]
    assert eng.stats.ahead_steps > 0 and got != oracle(eng, ps, LONG)


# ---- speculative decoding: the draft policy under async scheduling ----------------------------------------
class Missing:
    """Proposes k tokens the fake model never samples next (its drafts are all rejected), and records
    the sequence length at each proposal."""

    def __init__(self, vocab: int):
        self.vocab, self.at = vocab, []

    def propose(self, seq_id, token_ids, k, salt=None):
        self.at.append(len(token_ids))
        return [(token_ids[-1] + 1) % self.vocab] * k

    def finished(self, *a, **kw):
        pass


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_sequence_whose_drafts_missed_probes_again(model_dir, async_scheduling):
    """Its drafts all rejected, a sequence stops drafting for a few steps, then probes again now and
    then — with async scheduling too, whose steps sent ahead never pass through ``schedule()`` (they
    did not count towards the probe: drafting stopped for good after the third step). Its tokens
    stay the oracle's."""
    eng, fake = make(model_dir, attention=1, async_scheduling=async_scheduling,
                     speculative={"method": "ngram", "num_speculative_tokens": 4})
    eng.scheduler.drafts.drafter = drafter = Missing(eng.model_cfg.vocab_size)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    (seq,) = run(eng, [[5, 6, 7]], params)
    assert seq.output_ids == oracle(eng, [[5, 6, 7]], params)[0]
    assert eng.stats.spec_draft_tokens > 0 and eng.stats.spec_accepted_tokens == 0
    assert (eng.stats.ahead_steps > 0) == async_scheduling
    late = [n for n in drafter.at if n > 3 + 20]
    assert len(late) >= 2, drafter.at  # probes after the first twenty tokens, more than one


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    """deepseek-v3-tiny's config: a checkpoint with an MTP layer (speculative method mtp)."""
    d = tmp_path_factory.mktemp("dsv3")
    (d / "config.json").write_text(json.dumps(preset_config("deepseek-v3-tiny")))
    return d


def _mtp_engine(mtp_dir):
    eng, fake = make(mtp_dir, attention=1, speculative={"method": "mtp"})
    fake.mtp = True
    return eng, fake


def test_mtp_guesses_of_a_sequence_aborted_mid_step_are_not_kept(mtp_dir):
    """The step in flight when its client went away still brings the sequence's MTP guess back: it
    is not recorded (one entry a disconnect, kept for ever, before)."""
    eng, fake = _mtp_engine(mtp_dir)
    a, b = (eng.add_request(p, LONG) for p in prompts(2, seed=3))
    for _ in range(4):
        eng.step()
    assert eng.stats.spec_accepted_tokens > 0  # the fake's guesses are drafted and accepted
    eng.launch()
    eng.abort(a)
    eng.finish()
    assert a not in eng.scheduler.drafts.drafter.guesses and b in eng.scheduler.drafts.drafter.guesses
    drain(eng)
    assert eng.release(b).seq.output_ids == oracle(eng, prompts(2, seed=3), LONG)[1]
    assert not eng.scheduler.drafts.drafter.guesses and _all_free(eng)


def test_an_answer_that_contradicts_its_drafts_fails_the_step_into_recovery(mtp_dir, monkeypatch):
    """An attention replica that answers a drafted chunk with more tokens than drafts + 1 (an actor's
    bug, a version skew): the step fails and is recovered like one whose exchange failed — the engine
    thread lives, and every stream equals the oracle's."""
    from fake_executor import FakeReplica

    eng, fake = _mtp_engine(mtp_dir)
    real = FakeReplica.run
    bad = {"left": 1}

    def answer(self, req, vocab):
        out = real(self, req, vocab)
        if bad["left"] and any(c.draft for c in req.chunks):
            bad["left"] -= 1
            out = out + [out[-1]] * 3  # too many tokens for its drafts
        return out

    monkeypatch.setattr(FakeReplica, "run", answer)
    ps = prompts(2, seed=4)  # (two decoding: each drafts; three would share less than one draft)
    got = [s.output_ids for s in run(eng, ps, LONG)]
    assert bad["left"] == 0 and eng.stats.recoveries, "no inconsistent answer was made"
    assert got == oracle(eng, ps, LONG)
