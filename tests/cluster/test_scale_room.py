"""A scale the cluster cannot hold is refused at once, with the planner's numbers, and the engine
serves on: one the cluster could never hold (its total resources), and one whose new actors its free
resources cannot place now (the rest held by other work). Before, both waited for the reservation's
timeout (300 s) on the engine thread. With capacity_wait_s (a cluster that grows by itself) the
second kind is asked for and waited for instead, while the engine serves."""

import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from cluster.engine import Engine, EngineConfig
from cluster.preflight import PreflightError
from cluster.spec import ClusterSpec
from model.sampling import SamplingParams
from tests.presets import preset

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def k2():
    return preset("kimi-k2-tiny", seed=6, dtype="float32")


def _refused_fast(begin) -> str:
    t0 = time.monotonic()
    with pytest.raises(PreflightError) as err:
        begin()
    assert time.monotonic() - t0 < 10, "refused, but not at once"
    return str(err.value)


def test_a_scale_that_cannot_fit_is_refused_at_once_and_serving_goes_on(idle_cluster, k2):
    with Engine(EngineConfig.of(model=str(k2)), ClusterSpec(attention=1, experts=2)) as eng:
        before = [s.output_ids for s in eng.generate([[1, 2, 3]], GREEDY)]
        # 3 nodes x 4 CPUs: 1 attention + 16 expert actors of 1 CPU each can never fit
        why = _refused_fast(lambda: eng.begin_scale_experts(16))
        assert "cannot hold" in why and "Planner:" in why and "a shape that fits" in why, why
        # the rest of the cluster held by other work: 4 more expert actors fit in total, not now
        free = int(ray.available_resources().get("CPU", 0))
        hog = _hog_the_rest()
        try:
            why = _refused_fast(lambda: eng.begin_scale_experts(6))
            assert "no room now for 4 of the 4 new actors" in why, why
        finally:
            remove_placement_group(hog)
        assert eng.epochs.transition is None and eng.router.pending is None and eng.table.epoch == 0
        assert [s.output_ids for s in eng.generate([[1, 2, 3]], GREEDY)] == before
        deadline = time.monotonic() + 30  # Ray frees a removed placement group's CPUs asynchronously
        while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
            time.sleep(0.1)
        change = eng.scale_experts(4)  # room again: the same kind of change goes through
        assert change.new_shape.startswith("1 attention × 4 expert")
        assert [s.output_ids for s in eng.generate([[1, 2, 3]], GREEDY)] == before


def test_with_capacity_wait_a_scale_asks_for_room_and_completes_when_it_appears(idle_cluster, k2):
    """capacity_wait_s: the new actors are asked for at once and the engine serves on while they wait;
    room appearing (here: other work ending; on a cloud: an autoscaler's new node) completes the
    change; room that never appears ends it with a clear error after capacity_wait_s."""
    with Engine(EngineConfig.of(model=str(k2), capacity_wait_s=60), ClusterSpec(attention=1, experts=2)) as eng:
        before = [s.output_ids for s in eng.generate([[1, 2, 3]], GREEDY)]
        hog = _hog_the_rest()
        try:
            t0 = time.monotonic()
            t = eng.begin_scale_experts(4)
            assert time.monotonic() - t0 < 10
            assert [s.output_ids for s in eng.generate([[1, 2, 3]], GREEDY)] == before  # serving goes on
            assert eng.status()["change"]["state"] == "waiting for capacity" and not t.done.done()
        finally:
            remove_placement_group(hog)  # room appears
        change = eng.wait(t)
        assert change.new_shape.startswith("1 attention × 4 expert") and change.prepare_s > 0
        assert [s.output_ids for s in eng.generate([[1, 2, 3]], GREEDY)] == before


def test_with_capacity_wait_room_that_never_appears_ends_the_change(idle_cluster, k2):
    with Engine(EngineConfig.of(model=str(k2), capacity_wait_s=2), ClusterSpec(attention=1, experts=2)) as eng:
        hog = _hog_the_rest()
        try:
            t = eng.begin_scale_experts(4)
            while not t.done.done():
                eng.generate([[1, 2, 3]], GREEDY)
            assert "no room for the new actors appeared within capacity_wait_s" in str(t.done.exception())
            assert eng.table.epoch == 0 and eng.epochs.transition is None and eng.router.pending is None
            assert len(eng.executor.fleet.reservations) == 1  # the asked-for group was removed
        finally:
            remove_placement_group(hog)


def _hog_the_rest():
    """Every free CPU held by a placement group of the test's own: the cluster has room in total, none now."""
    free = int(ray.available_resources().get("CPU", 0))
    hog = placement_group([{"CPU": 1}] * free, strategy="SPREAD")
    ray.get(hog.ready(), timeout=60)
    return hog
