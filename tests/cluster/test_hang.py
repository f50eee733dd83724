"""A hung actor is found in seconds (cluster/watchdog.py): `kill -STOP` on an expert actor, and on an
attention actor, while greedy streams run — the watchdog asks the silent actors for a heartbeat,
the stopped one does not answer, it is killed and replaced through recovery, and the streams go on
identical to the single process's, with no gap between two steps' tokens above the documented
bound (HANG_BOUND_S). A long prefill under a budget far below its duration is not taken for a
hang: the actors answer their heartbeats. The watchdog's clock alone is tested without Ray."""

import os
import signal
import time

import pytest
import ray

from cluster.engine import Engine, EngineConfig
from cluster.spec import ClusterSpec
from cluster.watchdog import HangWatch
from model.sampling import SamplingParams

import single
from tests.presets import preset

# docs/operations.md "Hung actors": detection (the budget's floor + the heartbeat timeout) plus the
# recovery epoch (a replacement actor loading a tiny checkpoint here)
HANG_FLOOR_S, HEARTBEAT_S = 2.0, 1.5
HANG_BOUND_S = 15.0


@pytest.fixture(scope="module")
def k2():
    return preset("kimi-k2-tiny", seed=5, dtype="float32")


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def _run_with(eng: Engine, prompts, params, at_turn: int, act) -> tuple[float, list[list[int]]]:
    """Engine.generate's loop with ``act()`` at turn ``at_turn``; returns the largest gap between two
    turns that delivered tokens (the streams' stall) and the outputs."""
    ids = [eng.add_request(p, params) for p in prompts]
    last, gap, turn = time.monotonic(), 0.0, 0
    deadline = last + 300
    while eng.busy:
        assert time.monotonic() < deadline, "no end after the stop"
        turn += 1
        if turn == at_turn:
            act()
        events = eng.pipelined()
        if events:
            now = time.monotonic()
            gap, last = max(gap, now - last), now
    return gap, [eng.release(i).seq.output_ids for i in ids]


@pytest.fixture(scope="module")
def hang_engine(ray_cluster, k2):
    """One 2 × 2 engine for both kinds: each stop is found, killed and replaced by a recovery that
    leaves the engine as it was (a new actor at the stopped one's index). Its actors share one node, so
    every exchange link is in shared memory (actors/shm.py) and a decode step's exchanges go through the
    mailboxes (actors/board.py): a stopped peer there is still found by the heartbeats and fails its
    peers' waits at the group's timeout."""
    node = (ray_cluster.node_ips[1],)
    eng = Engine(EngineConfig.of(model=str(k2), hang_floor_s=HANG_FLOOR_S, heartbeat_timeout_s=HEARTBEAT_S,
                                 transport="shm"),
                 ClusterSpec(attention=2, experts=2, attention_nodes=node, expert_nodes=node)).start()
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kind", ["expert", "attention"])
def test_a_stopped_actor_is_found_killed_and_replaced_in_seconds(hang_engine, k2, kind):
    eng = hang_engine
    prompts = single.prompts(4, seed=7)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = single.alone(k2, prompts, params)
    changes, hangs = len(eng.epochs.changes), dict(eng.stats.actor_hangs)
    stopped = []
    try:
        members = eng.executor.fleet.experts if kind == "expert" else eng.executor.fleet.attention
        pid = _pid(members[1].actor)
        links = ray.get(members[1].actor.exchange_links.remote(), timeout=30)
        assert links.pop("mailbox_messages") >= 0 and links == {"shm": 2, "mailbox": 2}  # to the other kind's two
        sent = []  # the steps before the stop went through the mailboxes (actors/board.py)

        def stop():
            sent.append(ray.get(members[1].actor.exchange_links.remote(), timeout=30)["mailbox_messages"])
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

        gap, got = _run_with(eng, prompts, params, at_turn=8, act=stop)
        assert [c.kind for c in eng.epochs.changes[changes:]] == ["recovery"]
        assert eng.stats.actor_hangs == hangs | {kind: 1} and eng.stats.last_hang.kind == kind
        assert eng.stats.last_hang.index == 1
        change = eng.epochs.changes[-1]
        said = (f"the streams stalled {gap:.1f}s, of it the recovery {eng.stats.recoveries[-1]:.1f}s (the "
                f"replacement's start {change.replace_s:.1f}s, the new group {change.regroup_s:.1f}s)")
        print(f"{kind}: {said}")
        assert gap < HANG_BOUND_S, said
        assert not _alive(pid), "the hung actor's process was not killed"
        fleet = eng.executor.fleet
        replacement = (fleet.experts if kind == "expert" else fleet.attention)[1]
        links = ray.get(replacement.actor.exchange_links.remote(), timeout=30)  # its replacement's too, used
        assert links.pop("mailbox_messages") > 0 and links == {"shm": 2, "mailbox": 2}
        assert sent and sent[0] > 0, sent
    finally:
        for p in stopped:
            _end(p)
    assert got == expected


def test_a_long_prefill_is_not_taken_for_a_hang(ray_cluster, k2):
    """The longest prompt the config allows, with a budget far below its prefill: the watchdog asks,
    the actors answer, nothing is killed."""
    cfg = EngineConfig.of(model=str(k2), num_blocks=64, block_size=16, max_tokens_per_step=1024,
                       hang_floor_s=0.01, hang_factor=0.01, heartbeat_timeout_s=HEARTBEAT_S)
    longest = cfg.cache.num_blocks * cfg.cache.block_size - 8  # one replica's cache, less the answer
    prompt = single.prompts(1, seed=8, lo=longest, hi=longest + 1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = single.alone(k2, prompt, params)
    with Engine(cfg, ClusterSpec(attention=1, experts=2)) as eng:
        probes = _count_probes(eng)
        got = [s.output_ids for s in eng.generate(prompt, params)]
        assert probes[0] > 0, "the budget never ran out: the test did not test the watchdog"
        assert eng.stats.actor_hangs == {} and not eng.epochs.changes
    assert got == expected


def _count_probes(eng: Engine) -> list[int]:
    """Count the fleet's heartbeat rounds (a wrapper around Fleet.unresponsive)."""
    fleet, count = eng.executor.fleet, [0]
    real = fleet.unresponsive

    def counted(members, timeout_s):
        count[0] += 1
        return real(members, timeout_s)

    fleet.unresponsive = counted
    return count


def _alive(pid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True


def _end(pid: int) -> None:
    """The process this test stopped: continued and killed if it is still there."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


# ---- the clock, without Ray ----------------------------------------------------------------------
def test_the_budget_follows_the_recent_p99_within_floor_and_cap():
    w = HangWatch(floor_s=2.0, factor=4.0, cap_s=30.0)
    assert w.budget("expert") == 2.0  # nothing seen yet: the floor
    for _ in range(99):
        w.observe("expert", 0.1)
    w.observe("expert", 1.0)  # one slow step in a hundred: the p99 is still 0.1
    assert w.budget("expert") == 2.0
    for _ in range(50):
        w.observe("expert", 1.0)
    assert w.budget("expert") == pytest.approx(4.0)  # 4 × 1.0
    for _ in range(300):
        w.observe("expert", 20.0)
    assert w.budget("expert") == 30.0 and w.budget("attention") == 2.0  # capped; kinds apart
    with pytest.raises(ValueError, match="floor_s"):
        HangWatch(floor_s=0, factor=1, cap_s=1)
