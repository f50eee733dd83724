"""EngineMetrics against a stub engine: the real EngineStats, Scheduler and actor messages, driven by
hand (no Ray, no model). The rendered text is parsed back with prometheus-client's own parser."""

import threading
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.messages import ExpertStepResult, StepResult
from actors.router import even_table
from cluster.scheduler import Scheduler, Seq
from cluster.stats import EngineStats
from deploy.metrics import CONTENT_TYPE, EngineMetrics
from model.sampling import SamplingParams

MOE_LAYERS = [1, 3]  # model layer ids (layer 0 is dense)
NUM_EXPERTS = 4
ALLOWED_LABELS = {"model_name", "layer", "expert", "actor", "kind", "finished_reason", "le"}


def make_engine(*, replicas: int = 2, expert_actors: int = 2):
    stats = EngineStats(list(MOE_LAYERS), NUM_EXPERTS)
    scheduler = Scheduler(num_replicas=replicas, num_blocks=8, block_size=4, num_slots=None, max_num_seqs=8,
                          max_tokens_per_step=64)
    table = even_table(NUM_EXPERTS, MOE_LAYERS, replicas, expert_actors)
    return SimpleNamespace(stats=stats, scheduler=scheduler, table=table, cfg=SimpleNamespace(moe_layers=MOE_LAYERS))


def step(engine, counts_per_attention, *, step_s=0.02, dispatch=(0.001, 0.002), combine=(0.003, 0.004),
         compute=(0.01, 0.02)):
    attn = [StepResult(1, f"attention[{i}]", expert_tokens=tuple(map(tuple, c)), slot_tokens=_slots(engine.table, c),
                       exchange_s=d + cb, dispatch_s=d, combine_s=cb)
            for i, (c, d, cb) in enumerate(zip(counts_per_attention, dispatch, combine))]
    expert = [ExpertStepResult(1, f"expert[{j}]", compute_s=s, exchange_s=0.005) for j, s in enumerate(compute)]
    tokens = sum(sum(row) for c in counts_per_attention for row in c[:1])
    engine.stats.record_step(tokens, attn, expert, step_s, engine.table)


def _slots(table, counts):
    """Rows per (MoE layer, expert actor, local slot) of per-expert counts, under a table without replicas."""
    return tuple(tuple(tuple(row[e] for e in ids) + (0,) * (table.max_local - len(ids)) for ids in per_actor)
                 for row, per_actor in zip(counts, table.slots))


def scrape(metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels)): value} from the rendered text."""
    text = metrics.render().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    key = (name, frozenset({"model_name": "tiny", **labels}.items()))
    assert key in samples, f"{name}{labels} missing; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


@pytest.fixture
def engine():
    return make_engine()


@pytest.fixture
def metrics(engine):
    m = EngineMetrics(engine, "tiny")
    yield m
    m.close()


def test_all_series_exist_at_start_with_bounded_labels(metrics):
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "moeray:num_requests_running": "gauge", "moeray:num_requests_waiting": "gauge",
        "moeray:kv_cache_usage_perc": "gauge", "moeray:cache_blocks_used": "gauge",
        "moeray:cache_blocks_free": "gauge", "moeray:epoch": "gauge", "moeray:moe_load_imbalance": "gauge",
        "moeray:prompt_tokens": "counter", "moeray:generation_tokens": "counter",
        "moeray:request_success": "counter", "moeray:num_preemptions": "counter",
        "moeray:expert_tokens": "counter", "moeray:expert_actor_tokens": "counter",
        "moeray:engine_steps": "counter",
        "moeray:time_to_first_token_seconds": "histogram", "moeray:inter_token_latency_seconds": "histogram",
        "moeray:e2e_request_latency_seconds": "histogram", "moeray:step_duration_seconds": "histogram",
        "moeray:moe_dispatch_latency_seconds": "histogram", "moeray:moe_combine_latency_seconds": "histogram",
        "moeray:expert_compute_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert name in families, f"{name} not rendered"
        assert families[name].type == kind, (name, families[name].type)
    assert all(n.startswith("moeray:") for n in families)
    s = scrape(metrics)
    assert value(s, "moeray:kv_cache_usage_perc") == 0.0
    assert value(s, "moeray:cache_blocks_free", actor="1") == 8
    assert value(s, "moeray:request_success_total", finished_reason="length") == 0
    assert value(s, "moeray:expert_tokens_total", layer="3", expert="3") == 0
    assert value(s, "moeray:moe_load_imbalance", layer="1") == 0.0  # no tokens yet: 0, not NaN
    assert CONTENT_TYPE.startswith("text/plain") and "version=" in CONTENT_TYPE


def test_registry_is_private(engine):
    from prometheus_client import REGISTRY
    a, b = EngineMetrics(engine, "tiny"), EngineMetrics(make_engine(), "tiny")  # no duplicate-name clash
    assert a.registry is not REGISTRY and a.registry is not b.registry
    assert b"moeray:" not in __import__("prometheus_client").generate_latest(REGISTRY)
    a.close(), b.close()


def test_scheduler_and_cache_gauges_read_at_scrape_time(engine, metrics):
    sched = engine.scheduler
    for i in range(3):
        sched.add(Seq(i, list(range(1, 10)), 9, SamplingParams(max_tokens=4)))
    s = scrape(metrics)
    assert value(s, "moeray:num_requests_waiting") == 3 and value(s, "moeray:num_requests_running") == 0
    sched.schedule()  # 9-token prompts, 4-token blocks: 3 blocks each, spread over 2 replicas
    s = scrape(metrics)
    assert value(s, "moeray:num_requests_running") == 3 and value(s, "moeray:num_requests_waiting") == 0
    used = [value(s, "moeray:cache_blocks_used", actor=str(r)) for r in range(2)]
    free = [value(s, "moeray:cache_blocks_free", actor=str(r)) for r in range(2)]
    assert sorted(used) == [3, 6] and [u + f for u, f in zip(used, free)] == [8, 8]
    assert value(s, "moeray:kv_cache_usage_perc") == pytest.approx(9 / 16)
    engine.stats.preemptions += 2  # the engine counts these on stats, without an event
    engine.table = even_table(NUM_EXPERTS, MOE_LAYERS, 2, 2, epoch=1)
    s = scrape(metrics)
    assert value(s, "moeray:num_preemptions_total") == 2 and value(s, "moeray:epoch") == 1


def test_step_events_move_expert_counters_and_histograms(engine, metrics):
    # two attention actors, [moe layer][logical expert]; expert actor 0 owns 0..1, actor 1 owns 2..3
    a0 = [[3, 1, 0, 0], [0, 0, 2, 2]]
    a1 = [[1, 1, 0, 2], [4, 0, 0, 0]]
    step(engine, [a0, a1])
    s = scrape(metrics)
    assert value(s, "moeray:engine_steps_total") == 1
    assert value(s, "moeray:expert_tokens_total", layer="1", expert="0") == 4
    assert value(s, "moeray:expert_tokens_total", layer="3", expert="2") == 2
    assert value(s, "moeray:expert_actor_tokens_total", actor="0") == 3 + 1 + 1 + 1 + 4
    assert value(s, "moeray:expert_actor_tokens_total", actor="1") == 2 + 2 + 2
    assert value(s, "moeray:step_duration_seconds_count") == 1
    assert value(s, "moeray:step_duration_seconds_sum") == pytest.approx(0.02)
    assert value(s, "moeray:moe_dispatch_latency_seconds_sum", actor="1") == pytest.approx(0.002)
    assert value(s, "moeray:moe_combine_latency_seconds_count", actor="0") == 1
    assert value(s, "moeray:expert_compute_seconds_sum", actor="1") == pytest.approx(0.02)
    assert value(s, "moeray:moe_exchange_seconds_count", kind="expert", actor="1") == 1
    assert value(s, "moeray:step_duration_seconds_bucket", le="0.025") == 1
    assert value(s, "moeray:step_duration_seconds_bucket", le="0.01") == 0
    # layer 1 totals [4, 2, 0, 2] → max/mean = 4/2; layer 3 totals [4, 0, 2, 2] → 4/2
    assert value(s, "moeray:moe_load_imbalance", layer="1") == pytest.approx(2.0)
    step(engine, [a0, a1])
    s = scrape(metrics)
    assert value(s, "moeray:engine_steps_total") == 2
    assert value(s, "moeray:expert_tokens_total", layer="1", expert="0") == 8  # counters move
    assert value(s, "moeray:moe_load_imbalance", layer="1") == pytest.approx(2.0)  # ratio does not


def test_load_imbalance_is_over_a_sliding_window(engine):
    m = EngineMetrics(engine, "tiny", imbalance_window_steps=2)
    hot = [[8, 0, 0, 0], [2, 2, 2, 2]]
    even = [[1, 1, 1, 1], [2, 2, 2, 2]]
    step(engine, [hot])
    assert value(scrape(m), "moeray:moe_load_imbalance", layer="1") == pytest.approx(4.0)
    assert value(scrape(m), "moeray:moe_load_imbalance", layer="3") == pytest.approx(1.0)
    for _ in range(2):  # the hot step leaves the 2-step window
        step(engine, [even])
    s = scrape(m)
    assert value(s, "moeray:moe_load_imbalance", layer="1") == pytest.approx(1.0)
    assert value(s, "moeray:expert_tokens_total", layer="1", expert="0") == 10  # totals keep everything
    m.close()


def test_request_latencies_and_token_counters(engine, metrics):
    engine.stats.observe_ttft(0.3)
    for _ in range(3):
        engine.stats.observe_itl(0.02)
    seq = Seq(7, [1, 2, 3, 4, 5, 6, 7, 8, 9], 5, SamplingParams(max_tokens=4))
    seq.finish_reason = "length"
    engine.stats.observe_finished(1.2, seq)
    s = scrape(metrics)
    assert value(s, "moeray:time_to_first_token_seconds_count") == 1
    assert value(s, "moeray:time_to_first_token_seconds_bucket", le="0.25") == 0
    assert value(s, "moeray:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(s, "moeray:inter_token_latency_seconds_count") == 3
    assert value(s, "moeray:inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(s, "moeray:e2e_request_latency_seconds_sum") == pytest.approx(1.2)
    assert value(s, "moeray:generation_tokens_total") == 4 == len(seq.output_ids)  # one per sampled token
    assert value(s, "moeray:prompt_tokens_total") == 5
    assert value(s, "moeray:request_success_total", finished_reason="length") == 1
    assert value(s, "moeray:request_success_total", finished_reason="stop") == 0


def test_no_request_ids_in_labels(engine, metrics):
    for i in range(5):
        seq = Seq(1000 + i, [1, 2, 3], 2, SamplingParams(max_tokens=1))
        seq.finish_reason = "stop"
        engine.stats.observe_ttft(0.1)
        engine.stats.observe_finished(0.2, seq)
    step(engine, [[[1, 0, 0, 0], [0, 1, 0, 0]]])
    text = metrics.render().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (sample.name, sample.labels)
            assert "seq" not in sample.name and "request_id" not in sample.name
    assert "1000" not in text and "1004" not in text


def test_listener_errors_never_reach_the_engine(engine, metrics, caplog):
    engine.stats.record_step(1, [], [], 0.01, engine.table)  # no expert counts: fine
    for fn in engine.stats.listeners:
        fn("step", times=None, expert_tokens=None, table=None)  # malformed: logged, not raised
        fn("some_future_event", x=1)  # unknown: ignored
    assert "dropping 'step' event" in caplog.text
    assert value(scrape(metrics), "moeray:engine_steps_total") >= 1


def test_close_stops_listening(engine):
    m = EngineMetrics(engine, "tiny")
    assert len(engine.stats.listeners) == 1
    m.close()
    m.close()
    assert engine.stats.listeners == []
    engine.stats.observe_ttft(0.1)
    assert value(scrape(m), "moeray:time_to_first_token_seconds_count") == 0


def test_constructor_rejects_bad_values(engine):
    with pytest.raises(ValueError, match="model_name"):
        EngineMetrics(engine, "")
    with pytest.raises(ValueError, match="imbalance_window_steps"):
        EngineMetrics(engine, "tiny", imbalance_window_steps=0)


def test_scrapes_concurrent_with_steps(engine, metrics):
    """Engine thread records steps while another thread scrapes: no errors, totals consistent."""
    counts = [[1, 2, 3, 4], [4, 3, 2, 1]]
    n = 300
    errors = []

    def drive():
        try:
            for _ in range(n):
                step(engine, [counts])
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    t = threading.Thread(target=drive)
    t.start()
    while t.is_alive():
        s = scrape(metrics)
        tot = [value(s, "moeray:expert_tokens_total", layer="1", expert=str(e)) for e in range(NUM_EXPERTS)]
        assert [x / tot[0] for x in tot] == [1, 2, 3, 4] if tot[0] else tot == [0, 0, 0, 0]
    t.join()
    assert not errors
    s = scrape(metrics)
    assert value(s, "moeray:engine_steps_total") == n
    assert value(s, "moeray:expert_actor_tokens_total", actor="1") == n * (3 + 4 + 2 + 1)
