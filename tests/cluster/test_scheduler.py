"""The scheduler alone (no actors): budget, chunked prefill, decode-first, balance, preemption."""

from cluster.config import CacheConfig, SchedulerConfig
from cluster.scheduler import Scheduler
from cluster.seq import Seq
from model.sampling import SamplingParams


def _seq(i, n):
    return Seq(i, list(range(1, n + 1)), n, SamplingParams(max_tokens=50))


def _sched(*, num_replicas=2, num_blocks=8, max_tokens_per_step=10, hybrid=False):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_tokens_per_step=max_tokens_per_step),
                     CacheConfig(num_blocks=num_blocks, block_size=4, num_slots=4, prefix_caching=False),
                     num_replicas=num_replicas, hybrid=hybrid)


def test_chunked_prefill_under_budget_and_balance():
    s = _sched()
    a, b = _seq(0, 15), _seq(1, 3)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.num_tokens == 10  # a's first chunk fills the budget
    (chunk,) = [c for r in plan.chunks for c in r]
    assert chunk.seq_id == 0 and len(chunk.token_ids) == 10 and not chunk.sample and chunk.reset_state
    plan = s.schedule()  # a's remaining 5 + b's 3, b on the other replica
    by_seq = {c.seq_id: (r, c) for r, cs in enumerate(plan.chunks) for c in cs}
    assert len(by_seq[0][1].token_ids) == 5 and by_seq[0][1].sample and by_seq[0][1].num_cached == 10
    assert by_seq[1][0] != by_seq[0][0]


def test_decodes_go_first_and_blocks_follow_tokens():
    s = _sched(num_replicas=1, max_tokens_per_step=4)
    a = _seq(0, 4)
    s.add(a)
    s.schedule()
    a.token_ids.append(99)  # sampled
    s.add(_seq(1, 8))
    plan = s.schedule()
    chunks = plan.chunks[0]
    assert chunks[0].seq_id == 0 and chunks[0].token_ids == (99,) and chunks[0].num_cached == 4
    assert len(a.block_table) == 2 and plan.num_tokens == 4


def test_full_cache_preempts_newest_and_recomputes():
    s = _sched(num_replicas=1, num_blocks=4, max_tokens_per_step=64)
    a, b = _seq(0, 8), _seq(1, 8)  # 2 blocks each: the cache is full
    s.add(a)
    s.add(b)
    s.schedule()
    a.token_ids.append(7)
    b.token_ids.append(8)
    plan = s.schedule()  # a needs a third block: b (newest) is preempted
    assert plan.preempted == [b] and b.num_cached == 0 and b.block_table == [] and s.waiting[0] is b
    assert [c.seq_id for c in plan.chunks[0]] == [0]
    s.finish(a, "stop")
    plan = s.schedule()  # b comes back: all 9 known tokens recomputed, then it samples
    (c,) = plan.chunks[0]
    assert c.seq_id == 1 and c.token_ids == tuple(b.token_ids) and c.sample and c.reset_state


def test_finish_frees_everything():
    s = _sched(hybrid=True)  # 4 KDA slots per replica
    seqs = [_seq(i, 5) for i in range(4)]
    for q in seqs:
        s.add(q)
    s.schedule()
    for q in seqs:
        s.finish(q, "stop")
    assert all(a.num_held == 0 for a in s.cache.blocks) and all(a.num_free == 4 for a in s.cache.slots)
    assert not s.has_work


def test_parked_sequences_wait_for_their_token_or_their_time():
    """A parked sequence (PD: its blocks are coming from the prefill engine) is not admitted; only an unpark
    with its own token brings it back, to the front of the queue with its home; past its time the scheduler
    takes it back itself; one that ends while parked is gone; parked ones count as waiting."""
    import time

    s = _sched()
    a, b = _seq(1, 6), _seq(2, 6)
    s.add(a)
    s.add(b)
    s.park(a, time.monotonic() + 60, token=7)
    assert s.snapshot().waiting == 2 and not s.overdue
    plan = s.schedule()
    assert [c.seq_id for per in plan.chunks for c in per] == [2]
    assert not s.unpark(1, home=1, token=8) and 1 in s.parked  # another parking's token: nothing
    assert s.unpark(1, home=1, token=7) and s.waiting[0] is a and a.home == 1
    assert not s.unpark(1, token=7)  # once
    c = _seq(3, 4)
    s.add(c)
    s.park(c, time.monotonic() - 1, token=1)  # past its time already
    assert s.overdue and s.has_work
    s.schedule()
    assert 3 not in s.parked and not s.overdue
    d = _seq(4, 4)
    s.add(d)
    s.park(d, time.monotonic() + 60, token=2)
    s.finish(d, "abort")
    assert 4 not in s.parked and not s.unpark(4, token=2)
