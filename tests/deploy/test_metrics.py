"""EngineMetrics against a stub engine: the real EngineStats, Router, Scheduler and actor messages,
driven by hand as Engine.record drives them (no Ray, no model). The rendered text is parsed back with prometheus-client's own parser."""

import threading
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.messages import ExpertStepResult, StepResult
from actors.router import Router, even_table
from cluster.config import CacheConfig, SchedulerConfig
from cluster.scheduler import Scheduler
from cluster.seq import Seq
from cluster.stats import EngineStats, StepRecord
from deploy.metrics import CONTENT_TYPE, EngineMetrics
from model.sampling import SamplingParams

MOE_LAYERS = [1, 3]  # model layer ids (layer 0 is dense)
NUM_EXPERTS = 4
MAX_CONTEXT = 4096  # the model's context: the top of the per-request token buckets
ALLOWED_LABELS = {"model_name", "layer", "expert", "rank", "actor", "kind", "finished_reason", "reason", "le"}  # (reason: the compile fallbacks, three values)


def make_engine(*, replicas: int = 2, expert_actors: int = 2, window_steps: int = 256):
    stats = EngineStats(len(MOE_LAYERS))
    router = Router(NUM_EXPERTS, MOE_LAYERS, window_steps=window_steps)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_tokens_per_step=64),
                          CacheConfig(num_blocks=8, block_size=4, prefix_caching=False), num_replicas=replicas,
                          max_context=MAX_CONTEXT)
    table = router.initial(replicas, expert_actors)
    return SimpleNamespace(stats=stats, router=router, scheduler=scheduler, table=table, snapshot=scheduler.snapshot())


def record(engine, rec: StepRecord) -> None:
    """What Engine.record does with a finished step's record."""
    if rec.expert_tokens is not None:
        engine.router.report(rec.expert_tokens, rec.actor_tokens, epoch=rec.epoch)
    engine.stats.record_step(rec)


def step(engine, counts_per_attention, *, step_s=0.02, dispatch=(0.001, 0.002), combine=(0.003, 0.004),
         compute=(0.01, 0.02)):
    attn = [StepResult(1, f"attention[{i}]", expert_tokens=tuple(map(tuple, c)), slot_tokens=_slots(engine.table, c),
                       exchange_s=d + cb, dispatch_s=d, combine_s=cb)
            for i, (c, d, cb) in enumerate(zip(counts_per_attention, dispatch, combine))]
    expert = [ExpertStepResult(1, f"expert[{j}]", compute_s=s, exchange_s=0.005) for j, s in enumerate(compute)]
    tokens = sum(sum(row) for c in counts_per_attention for row in c[:1])
    record(engine, StepRecord.of(tokens, attn, expert, step_s, engine.table))


def _slots(table, counts):
    """Rows per (MoE layer, expert actor, local slot) of per-expert counts, under a table without replicas."""
    return tuple(tuple(tuple(row[e] for e in ids) + (0,) * (table.max_local - len(ids)) for ids in per_actor)
                 for row, per_actor in zip(counts, table.slots))


def publish(engine) -> None:
    """What the engine thread does between steps (Engine.publish): the scheduler's snapshot for readers."""
    engine.snapshot = engine.scheduler.snapshot()


def scrape(metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels)): value} from the rendered text, after a step boundary's publish."""
    publish(metrics.engine)
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
    m = EngineMetrics(engine, "tiny", expert_metrics="full")
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
        "moeray:request_queue_time_seconds": "histogram", "moeray:request_prefill_time_seconds": "histogram",
        "moeray:request_decode_time_seconds": "histogram", "moeray:request_prompt_tokens": "histogram",
        "moeray:request_generation_tokens": "histogram", "moeray:request_max_num_generation_tokens": "histogram",
        "moeray:moe_dispatch_latency_seconds": "histogram", "moeray:moe_combine_latency_seconds": "histogram",
        "moeray:expert_compute_seconds": "histogram", "moeray:epoch_pause_seconds": "histogram",
        "moeray:moe_hot_expert_tokens": "gauge",
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


def test_load_imbalance_is_over_a_sliding_window():
    engine = make_engine(window_steps=2)  # the router's window is the only one
    m = EngineMetrics(engine, "tiny", expert_metrics="full")
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


def test_per_request_phase_and_length_histograms(engine, metrics):
    """vLLM's per-finished-request histograms: queue (arrival → first scheduled), prefill (→ first
    token), decode (→ last token), prompt and generated tokens."""
    seq = Seq(8, list(range(1, 31)), 23, SamplingParams(max_tokens=64))  # 23 prompt + 7 generated
    seq.finish_reason = "stop"
    engine.stats.observe_finished(3.0, seq, queue_s=0.4, prefill_s=0.9, decode_s=1.7)
    s = scrape(metrics)
    for name, total, le_below, le_at in (("request_queue_time_seconds", 0.4, "0.3", "0.5"),
                                         ("request_prefill_time_seconds", 0.9, "0.8", "1.0"),
                                         ("request_decode_time_seconds", 1.7, "1.5", "2.0"),
                                         ("request_prompt_tokens", 23, "20.0", "50.0"),
                                         ("request_generation_tokens", 7, "5.0", "10.0"),
                                         ("request_max_num_generation_tokens", 7, "5.0", "10.0")):
        assert value(s, f"moeray:{name}_count") == 1, name
        assert value(s, f"moeray:{name}_sum") == pytest.approx(total), name
        assert value(s, f"moeray:{name}_bucket", le=le_below) == 0, name
        assert value(s, f"moeray:{name}_bucket", le=le_at) == 1, name


def test_engine_times_queue_prefill_and_decode():
    """Engine._send stamps a request's first scheduling (once) and Engine._events splits its life into
    queue, prefill and decode for the Finished record, driven on a stand-in engine (no cluster)."""
    from actors.messages import SampledToken
    from cluster.engine import Engine, Request
    from cluster.scheduler import Applied
    from cluster.stats import Finished

    stats = EngineStats(1)
    got = []
    stats.listeners.append(got.append)
    seq = Seq(3, [1, 2, 3], 3, SamplingParams(max_tokens=2))
    req = Request(seq, arrival=100.0)
    plan = SimpleNamespace(chunks=[[SimpleNamespace(seq_id=3)]])
    fake = SimpleNamespace(requests={3: req}, stats=stats, step_no=0,
                           executor=SimpleNamespace(table=SimpleNamespace(epoch=0)))
    for _ in range(2):  # the stamp comes before the step is sent; the stand-in cannot send it
        with pytest.raises(AttributeError):
            Engine._send(fake, plan, ahead=False, t_plan=0.0)
        stamped = stamped if _ else req.scheduled
    assert req.scheduled == stamped > 100.0  # the first scheduling only
    req.scheduled, req.first_token, req.last_token = 101.0, 102.5, 102.5  # as if the first token came at 102.5
    seq.token_ids.append(7)
    seq.finish_reason = "length"
    Engine._events(fake, [Applied(seq, SampledToken(3, 7), "length")])
    fin = [r for r in got if isinstance(r, Finished)]
    assert len(fin) == 1 and fin[0].queue_s == pytest.approx(1.0) and fin[0].prefill_s == pytest.approx(1.5)
    assert fin[0].decode_s == pytest.approx(fin[0].seconds - 2.5) and fin[0].decode_s > 0


def test_no_request_ids_in_labels(engine, metrics):
    for i in range(5):
        seq = Seq(91000 + i, [1, 2, 3], 2, SamplingParams(max_tokens=1))
        seq.finish_reason = "stop"
        engine.stats.observe_ttft(0.1)
        engine.stats.observe_finished(0.2, seq)
    step(engine, [[[1, 0, 0, 0], [0, 1, 0, 0]]])
    text = metrics.render().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (sample.name, sample.labels)
            assert "seq" not in sample.name and "request_id" not in sample.name
    assert "91000" not in text and "91004" not in text


def test_listener_errors_never_reach_the_engine(engine, metrics, caplog):
    record(engine, StepRecord.of(1, [], [], 0.01, engine.table))  # no expert counts: fine
    for fn in engine.stats.listeners:
        fn(StepRecord(0, 1, None))  # malformed (no step time): logged, not raised
        fn(object())  # a record type it does not know: ignored
    assert "dropping a StepRecord record" in caplog.text
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


def test_constructor_rejects_bad_prefix_and_expert_mode(engine):
    with pytest.raises(ValueError, match="metrics_prefix"):
        EngineMetrics(engine, "tiny", prefix="sglang")
    with pytest.raises(ValueError, match="expert_metrics"):
        EngineMetrics(engine, "tiny", expert_metrics="all")
    with pytest.raises(ValueError, match="hot_experts"):
        EngineMetrics(engine, "tiny", hot_experts=0)


# ---- cardinality: the per-(layer, expert) counter is opt-in ----------------------------------------
def test_summary_is_the_default_and_bounded(engine):
    """Default export: no per-(layer, expert) series; per-layer imbalance, per-actor tokens and the top
    hot experts per layer, whose series count does not grow with the number of experts."""
    m = EngineMetrics(engine, "tiny", hot_experts=2)
    step(engine, [[[5, 1, 0, 3], [0, 2, 2, 7]]])
    s = scrape(m)
    assert not any(name == "moeray:expert_tokens_total" for name, _ in s)
    assert value(s, "moeray:expert_actor_tokens_total", actor="0") == 5 + 1 + 0 + 2
    assert value(s, "moeray:moe_load_imbalance", layer="3") == pytest.approx(7 * 4 / 11)
    assert value(s, "moeray:moe_hot_expert_tokens", layer="1", rank="1", expert="0") == 5
    assert value(s, "moeray:moe_hot_expert_tokens", layer="1", rank="2", expert="3") == 3
    assert value(s, "moeray:moe_hot_expert_tokens", layer="3", rank="1", expert="3") == 7
    assert value(s, "moeray:moe_hot_expert_tokens", layer="3", rank="2", expert="1") == 2  # tie: lower id
    hot = [k for k in s if k[0] == "moeray:moe_hot_expert_tokens"]
    assert len(hot) == len(MOE_LAYERS) * 2
    m.close()


def test_full_mode_adds_the_per_expert_counter(engine):
    m = EngineMetrics(engine, "tiny", expert_metrics="full")
    step(engine, [[[5, 1, 0, 3], [0, 2, 2, 7]]])
    s = scrape(m)
    per_expert = [k for k in s if k[0] == "moeray:expert_tokens_total"]
    assert len(per_expert) == len(MOE_LAYERS) * NUM_EXPERTS
    assert value(s, "moeray:expert_tokens_total", layer="3", expert="3") == 7
    assert ("moeray:moe_hot_expert_tokens", frozenset(
        {"model_name": "tiny", "layer": "1", "rank": "1", "expert": "0"}.items())) in s  # summary kept
    m.close()


def test_expert_distribution_is_the_full_json_dump(engine, metrics):
    import json

    a = [[5, 1, 0, 3], [0, 2, 2, 7]]
    step(engine, [a])
    step(engine, [a])
    d = json.loads(json.dumps(metrics.expert_distribution()))  # JSON-ready
    assert d["moe_layers"] == MOE_LAYERS and d["num_experts"] == NUM_EXPERTS and d["epoch"] == 0
    assert d["tokens_total"] == [[10, 2, 0, 6], [0, 4, 4, 14]]
    assert d["tokens_window"] == d["tokens_total"] and d["steps_in_window"] == 2
    assert d["expert_actor_tokens_total"] == [2 * (5 + 1 + 2), 2 * (3 + 2 + 7)]
    assert d["imbalance_window"][1] == pytest.approx(14 * 4 / 22)


# ---- the elastic plane -------------------------------------------------------------------------
def test_epoch_pause_histogram(engine, metrics):
    s = scrape(metrics)
    assert value(s, "moeray:epoch_pause_seconds_count") == 0  # rendered before the first change
    engine.table = even_table(NUM_EXPERTS, MOE_LAYERS, 2, 2, epoch=1)
    engine.stats.observe_epoch(1, 0.3)
    engine.stats.observe_epoch(2, 45.0)
    s = scrape(metrics)
    assert value(s, "moeray:epoch_pause_seconds_count") == 2
    assert value(s, "moeray:epoch_pause_seconds_sum") == pytest.approx(45.3)
    assert value(s, "moeray:epoch_pause_seconds_bucket", le="0.01") == 0
    assert value(s, "moeray:epoch_pause_seconds_bucket", le="0.5") == 1
    assert value(s, "moeray:epoch_pause_seconds_bucket", le="120.0") == 2
    assert value(s, "moeray:epoch") == 1


# ---- metrics_prefix: vllm (Must show 3) ---------------------------------------------------------------
# vLLM's names, types and label sets, taken from vLLM's source: vllm-project/vllm
# vllm/v1/metrics/loggers.py, class PrometheusStatLogger, at commit
# 005a810bc40faa25b8870fbc8559c3462581eee3 (as returned by the code-search index): labelnames =
# ["model_name", "engine"] on every series, plus "finished_reason" on vllm:request_success; counters are
# created without "_total" (prometheus-client appends it) and vLLM disables the *_created series.
# vllm:inter_token_latency_seconds is the 0.11 name of vllm:time_per_output_token_seconds (same
# buckets and labels; loggers.py of 0.11: "Deprecated in 0.11 - Renamed as
# vllm:inter_token_latency_seconds", both emitted), so dashboards of either vintage work.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0]
VLLM_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]
VLLM_TOKEN_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]  # 1-2-5 to MAX_CONTEXT
VLLM_SERIES = {  # family name: (type, label names, histogram buckets or None)
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}, None),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}, None),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}, None),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}, None),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}, None),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}, None),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}, None),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine"}, VLLM_TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("histogram", {"model_name", "engine"}, VLLM_TPOT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine"}, VLLM_TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine"}, VLLM_E2E_BUCKETS),
    # request_latency_buckets, as e2e; and build_1_2_5_buckets(max_model_len) for the token counts
    "vllm:request_queue_time_seconds": ("histogram", {"model_name", "engine"}, VLLM_E2E_BUCKETS),
    "vllm:request_prefill_time_seconds": ("histogram", {"model_name", "engine"}, VLLM_E2E_BUCKETS),
    "vllm:request_decode_time_seconds": ("histogram", {"model_name", "engine"}, VLLM_E2E_BUCKETS),
    "vllm:request_prompt_tokens": ("histogram", {"model_name", "engine"}, VLLM_TOKEN_BUCKETS),
    "vllm:request_generation_tokens": ("histogram", {"model_name", "engine"}, VLLM_TOKEN_BUCKETS),
    "vllm:request_max_num_generation_tokens": ("histogram", {"model_name", "engine"}, VLLM_TOKEN_BUCKETS),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}, None),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}, None),
}
# our moeray: name for each vLLM family (the counterpart)
MOERAY_COUNTERPART = {"vllm:time_per_output_token_seconds": "moeray:inter_token_latency_seconds"}


def _families(m):
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def test_vllm_prefix_names_and_label_sets_equal_vllms(engine):
    m = EngineMetrics(engine, "tiny", prefix="vllm")
    engine.stats.observe_ttft(0.05)
    engine.stats.observe_itl(0.02)
    seq = Seq(1, [1, 2, 3], 3, SamplingParams(max_tokens=2))
    seq.finish_reason = "stop"
    engine.stats.observe_finished(0.4, seq)
    fams = _families(m)
    for name, (kind, labels, buckets) in VLLM_SERIES.items():
        assert name in fams, f"{name} not rendered with prefix vllm"
        f = fams[name]
        assert f.type == kind, (name, f.type)
        assert f.samples, name
        for s in f.samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0"
        if buckets is not None:
            les = sorted(float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket"))
            assert les == buckets + [float("inf")], name
        if kind == "counter":
            assert all(s.name == name + "_total" for s in f.samples), name
    # every vLLM family that has a moeray counterpart moved over: none left under moeray:
    for name in VLLM_SERIES:
        assert MOERAY_COUNTERPART.get(name, name.replace("vllm:", "moeray:")) not in fams, name
    # the expert plane keeps its own prefix; nothing else took vllm:
    assert "moeray:moe_load_imbalance" in fams and "moeray:epoch" in fams
    assert {n for n in fams if n.startswith("vllm:")} == set(VLLM_SERIES)
    s = scrape(m)
    assert s[("vllm:request_success_total", frozenset(
        {"model_name": "tiny", "engine": "0", "finished_reason": "stop"}.items()))] == 1
    assert s[("vllm:inter_token_latency_seconds_count", frozenset({"model_name": "tiny", "engine": "0"}.items()))] == 1
    assert s[("vllm:time_per_output_token_seconds_count", frozenset(
        {"model_name": "tiny", "engine": "0"}.items()))] == 1
    assert s[("vllm:generation_tokens_total", frozenset({"model_name": "tiny", "engine": "0"}.items()))] == 2
    m.close()


def test_moeray_prefix_names_every_vllm_counterpart(metrics):
    """The default prefix renders the same families under moeray: (one per vLLM family but the
    deprecated alias), with model_name only — the prefix-cache counters per attention replica
    (``actor``) too."""
    fams = _families(metrics)
    for name, (kind, labels, _) in VLLM_SERIES.items():
        if name in MOERAY_COUNTERPART:
            continue
        ours = name.replace("vllm:", "moeray:")
        assert ours in fams and fams[ours].type == kind, ours
        per_replica = {"actor"} if "prefix_cache" in name else set()
        for s in fams[ours].samples:
            assert set(s.labels) - {"le"} == labels - {"engine"} | per_replica, (ours, s.labels)



def test_serving_config_and_moeray_up_carry_the_metrics_fields(tmp_path):
    import os
    import subprocess
    import sys

    from deploy.config import ServeConfig

    cfg = ServeConfig.parse({"metrics_prefix": "vllm", "expert_metrics": "full"})
    assert (cfg.metrics_prefix, cfg.expert_metrics) == ("vllm", "full")
    assert (ServeConfig().metrics_prefix, ServeConfig().expert_metrics) == ("moeray", "summary")
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServeConfig.parse({"metrics_prefix": "sglang"})
    (tmp_path / "c.yaml").write_text("expert_metrics: full\n")
    assert ServeConfig.from_yaml(tmp_path / "c.yaml", metrics_prefix="vllm").expert_metrics == "full"
    env = {**os.environ, "MOERAY_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "up", "--metrics-prefix", "sglang"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2 and "metrics_prefix" in out.stderr, out.stderr  # refused before anything starts


def test_moeray_up_no_prefix_caching_reaches_the_engine_config(monkeypatch, tmp_path):
    """`moeray up --no-prefix-caching` (and the serving config's prefix_caching) turn it off in the
    engine the app builds; on by default."""
    from test_cli import in_process

    import deploy.server
    from deploy.config import ServeConfig

    seen = []
    monkeypatch.setenv("MOERAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(deploy.server, "serve_foreground", lambda cfg, *a, **k: seen.append(cfg))
    assert in_process("up", "--no-prefix-caching").returncode == 0
    assert in_process("up").returncode == 0
    assert [c.prefix_caching for c in seen] == [False, True]
    assert seen[0].engine_config("m").cache.prefix_caching is False and seen[1].engine_config("m").cache.prefix_caching is True
    assert ServeConfig.parse({"prefix_caching": False, "prefix_load_weight": 0}).engine_config("m").cache.prefix_load_weight == 0


def test_every_series_of_vllms_dashboard_is_rendered_with_data_under_prefix_vllm(engine):
    """Each sample name that vLLM's Grafana dashboard queries (dashboards.VLLM_DASHBOARD_QUERIES) is
    rendered by the app with prefix vllm, labelled model_name, and after one finished request its
    histograms and counters have counted it (the panels on rate()/increase() have data to show)."""
    from dashboards import VLLM_DASHBOARD_QUERIES, series_names

    assert len(VLLM_DASHBOARD_QUERIES) == 27
    m = EngineMetrics(engine, "tiny", prefix="vllm")
    engine.stats.observe_ttft(0.05)
    engine.stats.observe_itl(0.02)
    seq = Seq(1, [1, 2, 3, 4], 3, SamplingParams(max_tokens=2))
    seq.finish_reason = "stop"
    engine.stats.observe_finished(0.4, seq, queue_s=0.01, prefill_s=0.04, decode_s=0.35)
    s = scrape(m)
    wanted = {n for q in VLLM_DASHBOARD_QUERIES for n in series_names(q)}
    assert len(wanted) == 21, sorted(wanted)
    for name in sorted(wanted):
        got = {k: v for k, v in s.items() if k[0] == name and ("model_name", "tiny") in k[1]}
        assert got, f"{name}: not rendered with prefix vllm"
        if name.endswith(("_sum", "_count", "_total")) and "request_success" not in name:
            assert sum(got.values()) > 0, f"{name}: no data after a finished request"
        if name.endswith("_bucket"):
            assert max(got.values()) >= 1, f"{name}: no observation"
    m.close()
