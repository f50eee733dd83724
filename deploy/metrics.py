"""Prometheus metrics of one engine, rendered by the Serve ingress on ``/metrics``.

:class:`EngineMetrics` owns a private :class:`prometheus_client.CollectorRegistry` (never the
process-global one, so two engines in one process — tests, benchmarks — never collide) and the
histograms and counters fed by the engine's typed statistics records (:mod:`cluster.stats`). It
listens on ``engine.stats.listeners``: records arrive on the engine thread, scrapes on another;
prometheus-client's metric objects are thread-safe on their own. The per-expert token counts are
the router's (kept there once, behind its lock), read at scrape time.

Names follow vLLM's (``vllm:x`` → ``moeray:x``) where the meaning is the same. With
``prefix="vllm"`` the serving series that have a vLLM counterpart (:data:`SERVING`) take vLLM's
exact names and label sets (``model_name``, ``engine``), so vLLM's published Grafana dashboard works
unchanged; the expert plane keeps ``moeray:``. The expert plane: per-expert-actor tokens, per-layer
load imbalance, the hottest experts of each layer, dispatch / combine / compute latency, the
placement epoch and its pauses. The per-(layer, expert) counter (~23k series at Kimi K2 scale,
~82k at K3) is opt-in (``expert_metrics="full"``); :meth:`EngineMetrics.expert_distribution` is the
full distribution as JSON-ready data. Units are in the names. Labels are bounded: ``model_name``,
``engine``, ``layer`` (model layer id), ``expert`` (logical expert id), ``rank`` (1 = hottest),
``actor`` (actor index; the metric name says which kind), ``kind``, ``finished_reason`` — never
request ids.

Never: mutates the engine, calls an actor, keeps a copy of the token counts, or blocks the engine thread.
Scrape-time gauges read the scheduler with single ``len()``-sized reads (atomic under the GIL).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from actors.router import max_over_mean
from cluster.stats import ActorFailed, ActorHung, EpochPaused, Finished, Record, Recovered, StepRecord, TokenTiming
from model.compiled import FALLBACK_REASONS

log = logging.getLogger(__name__)

# All names and labels here are legacy-valid, so the classic text format describes the output exactly and
# every Prometheus (2.x included) parses it.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
PREFIX = "moeray:"
PREFIXES = ("moeray", "vllm")
EXPERT_METRICS = ("summary", "full")
HOT_EXPERTS = 4  # per MoE layer, by tokens over the window
# Serving series with a vLLM counterpart (vllm/v1/metrics/loggers.py, PrometheusStatLogger): under
# prefix="vllm" they are named vllm:<name> and labelled (model_name, engine[, finished_reason]).
SERVING = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
           "prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
           "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
           "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
           "request_generation_tokens", "request_max_num_generation_tokens", "prefix_cache_queries",
           "prefix_cache_hits")
VLLM_ENGINE = "0"  # vLLM's data-parallel engine index; one engine per moeray deployment
DEFAULT_MAX_MODEL_LEN = 131072  # token buckets' top when the scheduler does not say (stubs)
FINISHED_REASONS = ("stop", "length")  # what model.runner.check_stop returns; pre-created at 0

# Buckets: vLLM's (v1 loggers) for the request latencies; the per-step ones reach down to 100 µs
# because a decode step on GPUs, and one layer's all-to-all, are sub-millisecond.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
REQUEST_PHASE_BUCKETS = E2E_BUCKETS  # vLLM's request_latency_buckets: queue, prefill and decode time too
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0, 120.0)
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
EXCHANGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets`` (vllm/v1/metrics/loggers.py): 1, 2, 5, 10, 20, 50, ... up to
    ``max_value`` (its max_model_len), the buckets of its per-request token-count histograms."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return tuple(out)
            out.append(v)
        exp += 1


class _Registry(CollectorRegistry):
    """A registry without the ``*_created`` timestamp series. They are an OpenMetrics notion; in the
    classic text format they become extra gauge series per counter / histogram child (as vLLM,
    which disables them process-wide; this keeps the change to our own registry)."""

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():  # fresh Metric objects per collect: safe to filter
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class EngineMetrics:
    """The ``/metrics`` of one engine. ``engine`` needs ``.stats`` (an EngineStats), ``.router`` (the
    Router: token counts, read under its lock), ``.snapshot`` (the :class:`~cluster.scheduler.SchedulerSnapshot`
    the engine thread publishes between steps: a scrape never reads the live scheduler) and ``.table``
    (the current PlacementTable). ``prefix``: "moeray" or "vllm" (see the module docstring);
    ``expert_metrics``: "summary" (default) or "full" (adds the per-(layer, expert) counter);
    ``max_model_len``: the top of the per-request token-count buckets (default: the scheduler's
    ``max_context``, the model's context); ``pd``: the deployment's prefill/decode coordinator
    (:class:`~cluster.pd.Disaggregated`), whose routes, transfers and holds are read at scrape time."""

    CONTENT_TYPE = CONTENT_TYPE

    def __init__(self, engine: Any, model_name: str, *, prefix: Literal["moeray", "vllm"] = "moeray",
                 expert_metrics: Literal["summary", "full"] = "summary", hot_experts: int = HOT_EXPERTS,
                 max_model_len: int | None = None, pd: Any = None):
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        if prefix not in PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {PREFIXES}, got {prefix!r}")
        if expert_metrics not in EXPERT_METRICS:
            raise ValueError(f"expert_metrics must be one of {EXPERT_METRICS}, got {expert_metrics!r}")
        if hot_experts < 1:
            raise ValueError(f"hot_experts must be >= 1, got {hot_experts}")
        self.engine, self.model_name, self.pd = engine, model_name, pd
        self.prefix, self.expert_metrics, self.hot_experts = prefix, expert_metrics, hot_experts
        self.max_model_len = int(max_model_len or getattr(engine.scheduler, "max_context", DEFAULT_MAX_MODEL_LEN))
        # the serving series' (name prefix, label names, label values)
        self._serving = (("vllm:", ("model_name", "engine"), (model_name, VLLM_ENGINE)) if prefix == "vllm"
                         else (PREFIX, ("model_name",), (model_name,)))
        self.registry = _Registry()
        self.router = engine.router
        self._moe_layers: list[int] = list(self.router.moe_layers)
        self._make_metrics()
        self.registry.register(_ScrapeCollector(self))
        engine.stats.listeners.append(self._on_event)

    # ---- public ------------------------------------------------------------------------------
    def render(self) -> bytes:
        """Prometheus text exposition of this engine's registry (serve with :data:`CONTENT_TYPE`).
        With ``expert_metrics="full"`` at Kimi K2 scale (~23k series, ~1.7 MB) this takes ~0.25 s of
        CPU: keep it off event loops."""
        return generate_latest(self.registry)

    def expert_distribution(self) -> dict:
        """The full token distribution over (MoE layer, logical expert), JSON-ready: what the
        ``full`` counter would export, without its series (served by ``GET /admin/experts``)."""
        r = self.router
        totals, window, actors, steps = r.snapshot()
        return {"model": self.model_name, "epoch": self.engine.table.epoch, "moe_layers": list(self._moe_layers),
                "num_experts": r.num_experts, "window_steps": r.window_steps,
                "steps_in_window": steps, "tokens_total": totals.tolist(),
                "tokens_window": window.tolist(), "imbalance_window": max_over_mean(window),
                "expert_actor_tokens_total": actors}

    def close(self) -> None:
        """Stop listening to the engine: the histograms and counters it feeds stop moving (the expert
        series are read from the router at scrape time and still do)."""
        try:
            self.engine.stats.listeners.remove(self._on_event)
        except ValueError:  # not registered (closed twice)
            pass

    # ---- series owned by prometheus-client ---------------------------------------------------
    def _make_metrics(self) -> None:
        r, m, name = self.registry, ("model_name",), self.model_name
        sp, slabels, svalues = self._serving

        def counter(metric: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + metric, doc, m + labels, registry=r)

        def histogram(metric: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + metric, doc, m + labels, buckets=buckets, registry=r)

        def serving_hist(metric: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(sp + metric, doc, slabels, buckets=buckets, registry=r).labels(*svalues)

        self.prompt_tokens = Counter(sp + "prompt_tokens", "Prompt tokens of finished requests.", slabels,
                                     registry=r).labels(*svalues)
        self.generation_tokens = Counter(sp + "generation_tokens", "Tokens generated (counted as sampled).",
                                         slabels, registry=r).labels(*svalues)
        self.request_success = Counter(sp + "request_success", "Finished requests, by finish reason.",
                                       slabels + ("finished_reason",), registry=r)
        self.ttft = serving_hist("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = [serving_hist("inter_token_latency_seconds", "Time between two tokens of one request.",
                                 ITL_BUCKETS)]
        if self.prefix == "vllm":  # vLLM's pre-0.11 name of the same histogram, which it still emits
            self.itl.append(serving_hist("time_per_output_token_seconds",
                                         "Time between two tokens of one request (vLLM's older name).", ITL_BUCKETS))
        self.e2e = serving_hist("e2e_request_latency_seconds", "Arrival to last token of finished requests.",
                                E2E_BUCKETS)
        # per finished request, as vLLM's PrometheusStatLogger observes its FinishedRequestStats
        self.queue_time = serving_hist("request_queue_time_seconds", "Arrival to first scheduled (waiting).",
                                       REQUEST_PHASE_BUCKETS)
        self.prefill_time = serving_hist("request_prefill_time_seconds", "First scheduled to first token.",
                                         REQUEST_PHASE_BUCKETS)
        self.decode_time = serving_hist("request_decode_time_seconds", "First token to last token.",
                                        REQUEST_PHASE_BUCKETS)
        tokens = buckets_1_2_5(self.max_model_len)
        self.request_prompt_tokens = serving_hist("request_prompt_tokens", "Prompt tokens per finished request.",
                                                  tokens)
        self.request_generation_tokens = serving_hist("request_generation_tokens",
                                                      "Generated tokens per finished request.", tokens)
        self.request_max_generation = serving_hist(
            "request_max_num_generation_tokens", "Most tokens generated by one sequence of a finished request "
            "(one sequence per request here: its generated tokens).", tokens)
        self.steps = counter("engine_steps_total", "Engine steps run.").labels(name)
        self.step_duration = histogram("step_duration_seconds", "Wall time of one engine step.",
                                       STEP_BUCKETS).labels(name)
        self.dispatch = histogram("moe_dispatch_latency_seconds",
                                  "Per step and attention actor: time sending token rows to experts, "
                                  "summed over MoE layers.", EXCHANGE_BUCKETS, ("actor",))
        self.combine = histogram("moe_combine_latency_seconds",
                                 "Per step and attention actor: time receiving expert outputs back, "
                                 "summed over MoE layers.", EXCHANGE_BUCKETS, ("actor",))
        self.exchange = histogram("moe_exchange_seconds",
                                  "Per step and actor: time inside the dispatch/combine collectives, "
                                  "summed over MoE layers.", EXCHANGE_BUCKETS, ("kind", "actor"))
        self.expert_compute = histogram("expert_compute_seconds",
                                        "Per step and expert actor: time computing experts, summed over MoE layers.",
                                        EXCHANGE_BUCKETS, ("actor",))
        self.epoch_pause = histogram("epoch_pause_seconds", "Steps paused by one epoch change (scale, rebalance).",
                                     PAUSE_BUCKETS).labels(name)
        self.recovery = histogram("recovery_seconds", "From a failed step (an actor died or a collective failed) "
                                  "to the cluster serving again in a recovery epoch.", PAUSE_BUCKETS).labels(name)
        self.actor_failures = counter("actor_failures_total", "Actors found dead or stuck, by kind.", ("kind",))
        self.actor_hangs = counter("actor_hangs_total", "Actors found hung by the watchdog (silent past their "
                                   "step budget, no heartbeat) and killed, by kind.", ("kind",))
        for kind in ("attention", "expert", "worker"):  # worker: the colocated layout's
            self.actor_failures.labels(model_name=self.model_name, kind=kind)
            self.actor_hangs.labels(model_name=self.model_name, kind=kind)
        for reason in FINISHED_REASONS:  # so rate() works before the first request of each kind
            self.request_success.labels(*svalues, reason)

    # ---- engine thread -----------------------------------------------------------------------
    def _on_event(self, rec: Record) -> None:
        """EngineStats listener. A metrics fault is logged and must never fail the engine step."""
        try:
            handler = self._handlers.get(type(rec))
            if handler is not None:  # records added later are ignored until mapped here
                handler(self, rec)
        except Exception:
            log.exception("moeray metrics: dropping a %s record after an error", type(rec).__name__)

    def _on_step(self, rec: StepRecord) -> None:
        name = self.model_name
        self.steps.inc()
        self.step_duration.observe(rec.step_s)
        for hist, series in ((self.dispatch, rec.attention_dispatch_s), (self.combine, rec.attention_combine_s),
                             (self.expert_compute, rec.expert_compute_s)):
            for actor, seconds in enumerate(series):
                hist.labels(model_name=name, actor=str(actor)).observe(seconds)
        for kind, series in (("attention", rec.attention_exchange_s), ("expert", rec.expert_exchange_s)):
            for actor, seconds in enumerate(series):
                self.exchange.labels(model_name=name, kind=kind, actor=str(actor)).observe(seconds)

    def _on_epoch(self, rec: EpochPaused) -> None:
        self.epoch_pause.observe(rec.pause_s)  # the epoch itself is read from engine.table at scrape time

    def _on_failure(self, rec: ActorFailed) -> None:
        self.actor_failures.labels(model_name=self.model_name, kind=rec.kind).inc()

    def _on_hang(self, rec: ActorHung) -> None:
        self.actor_hangs.labels(model_name=self.model_name, kind=rec.kind).inc()

    def _on_recovery(self, rec: Recovered) -> None:
        self.recovery.observe(rec.seconds)

    def _on_token(self, rec: TokenTiming) -> None:
        for hist in ([self.ttft] if rec.first else self.itl):
            hist.observe(rec.seconds)
        self.generation_tokens.inc()  # one per sampled token

    def _on_finished(self, rec: Finished) -> None:
        self.e2e.observe(rec.seconds)
        self.queue_time.observe(rec.queue_s)
        self.prefill_time.observe(rec.prefill_s)
        self.decode_time.observe(rec.decode_s)
        self.request_prompt_tokens.observe(rec.prompt_tokens)
        self.request_generation_tokens.observe(rec.generation_tokens)
        self.request_max_generation.observe(rec.generation_tokens)
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.request_success.labels(*self._serving[2], rec.finish_reason).inc()

    _handlers = {StepRecord: _on_step, TokenTiming: _on_token, Finished: _on_finished, EpochPaused: _on_epoch,
                 ActorFailed: _on_failure, ActorHung: _on_hang, Recovered: _on_recovery}

    # ---- scrape thread -----------------------------------------------------------------------
    def snapshot(self) -> tuple[list[list[int]], list[int], list[float]]:
        """(expert tokens total [moe layer][expert], tokens total [expert actor], imbalance [moe layer]
        over the router's window), read from the router."""
        totals, window, actors, _ = self.router.snapshot()
        return totals.tolist(), actors, max_over_mean(window)

    def hot(self) -> list[list[tuple[int, int]]]:
        """[moe layer][rank] (logical expert, tokens over the window) of the ``hot_experts`` hottest."""
        return self.router.hot(self.hot_experts)


class _ScrapeCollector:
    """Series computed when scraped: scheduler and cache gauges, the epoch, preemptions (the engine
    counts them on ``stats`` without an event), and the expert families (built once per scrape
    from EngineMetrics' aggregated state instead of touched per step)."""

    def __init__(self, owner: EngineMetrics):
        self.owner = owner

    def collect(self) -> Iterable[Metric]:
        o = self.owner
        engine, name = o.engine, o.model_name
        sp, slabels, svalues = o._serving

        def gauge(metric: str, doc: str, value: float, prefix: str = PREFIX, labels=("model_name",),
                  values=(name,)) -> GaugeMetricFamily:
            g = GaugeMetricFamily(prefix + metric, doc, labels=list(labels))
            g.add_metric(list(values), value)
            return g

        snap = engine.snapshot  # published by the engine thread between steps; never the live scheduler
        yield gauge("num_requests_running", "Requests scheduled on attention replicas.", snap.running,
                    sp, slabels, svalues)
        yield gauge("num_requests_waiting", "Requests queued (new or preempted).", snap.waiting,
                    sp, slabels, svalues)
        used, total = snap.blocks_held, snap.blocks_total
        yield gauge("kv_cache_usage_perc", "Fraction of cache blocks held by running sequences over all attention "
                    "replicas (0..1); cached blocks nobody holds count as free, as vLLM's.",
                    sum(used) / sum(total) if sum(total) else 0.0, sp, slabels, svalues)
        for metric, doc, values in (
                ("cache_blocks_used", "Cache blocks held by running sequences, per attention replica.", used),
                ("cache_blocks_free", "Cache blocks a new sequence can take (free or cached), per attention replica.",
                 snap.blocks_available),
                ("cache_blocks_cached", "Cache blocks nobody holds whose content a prefix hit can reuse, per "
                 "attention replica.", snap.blocks_cached)):
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name", "actor"])
            for actor, v in enumerate(values):
                g.add_metric([name, str(actor)], v)
            yield g
        # over the engine's life: per attention replica (``actor``); under vLLM's names, the engine's total
        for metric, doc, pairs in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snap.prefix_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).", snap.prefix_hits)):
            counts = dict(pairs)
            if sp != PREFIX:
                c = CounterMetricFamily(sp + metric, doc, labels=list(slabels))
                c.add_metric(list(svalues), sum(counts.values()))
            else:
                c = CounterMetricFamily(sp + metric, doc, labels=["model_name", "actor"])
                for replica in range(max(len(total), max(counts, default=-1) + 1)):
                    c.add_metric([name, str(replica)], counts.get(replica, 0))
            yield c
        yield gauge("epoch", "Placement-table epoch (increments when experts are re-placed).", engine.table.epoch)
        pre = CounterMetricFamily(sp + "num_preemptions", "Sequences preempted for lack of cache blocks.",
                                  labels=list(slabels))
        pre.add_metric(list(svalues), engine.stats.preemptions)
        yield pre
        compiled = dict(engine.stats.compiled)  # (a copy: the engine thread adds keys)
        c = CounterMetricFamily(PREFIX + "compiled_decode_steps", "Decode forwards (per attention replica and "
                                "micro-batch) that ran the compiled decode step (data_plane.compile: decode).",
                                labels=["model_name"])
        c.add_metric([name], compiled.get("compiled", 0))
        yield c
        c = CounterMetricFamily(PREFIX + "compiled_verify_steps", "Those of the compiled decode forwards that "
                                "verified speculative drafts (each query token a row).", labels=["model_name"])
        c.add_metric([name], compiled.get("verify", 0))
        yield c
        c = CounterMetricFamily(PREFIX + "compile_fallbacks", "Decode forwards the compiled step did not cover and "
                                "that ran eager, by reason: batch (above max_num_seqs rows, drafts included), "
                                "recompile (a shape its warm-up did not compile), error, drafts (a hybrid model "
                                "verifying drafts: KDA runs them one at a time).", labels=["model_name", "reason"])
        for reason in FALLBACK_REASONS:
            c.add_metric([name, reason], compiled.get(reason, 0))
        yield c
        if getattr(getattr(engine, "config", None), "speculative", None) is not None:  # (stub engines have no config)
            yield from self._spec_families(engine.stats, sp, slabels, svalues, name)
        if o.pd is not None:
            yield from self._pd_families(o.pd.status(), sp, slabels, svalues, name)
        if getattr(engine, "tier", None) is not None:
            yield from self._tier_families(engine.tier.status(), sp, slabels, svalues, name)
        yield from self._expert_families(o, name)

    @staticmethod
    def _pd_families(s: dict, sp: str, slabels, svalues, name: str) -> Iterable[Metric]:
        """Prefill/decode disaggregation (cluster/pd.py): routes, transfers, failures, what is held for them."""
        from cluster.pd import FAILURE_KINDS, ROUTES

        def family(kind, metric: str, doc: str, rows: list[tuple[tuple, float]], labels=("model_name",)):
            f = kind(PREFIX + metric, doc, labels=list(labels))
            for values, v in rows:
                f.add_metric([name, *values], v)
            return f

        routes, failures = s["routes"], s["failures"]
        yield family(CounterMetricFamily, "pd_requests", "Requests ended, by the route their prompt took: pd (its "
                     "blocks from the prefill engine), local (prefilled on the decode engine), aborted.",
                     [((r,), routes.get(r, 0)) for r in ROUTES], ("model_name", "route"))
        yield family(CounterMetricFamily, "kv_transfer_bytes", "Bytes of cached blocks moved from the prefill engine "
                     "to the decode engine.", [((), s["bytes_moved"])])
        yield family(CounterMetricFamily, "kv_transfer_seconds", "Time of those transfers, from pinning the blocks on "
                     "prefill to their registration on decode.", [((), s["transfer_s"])])
        yield family(CounterMetricFamily, "kv_transfer_failures", "Transfers that failed (each request then "
                     "prefilled on decode), by kind.", [((k,), failures.get(k, 0)) for k in FAILURE_KINDS],
                     ("model_name", "reason"))
        yield family(CounterMetricFamily, "kv_transfer_evicted", "Transfers evicted on decode before their request "
                     "was admitted (computed again there).", [((), s["evicted_before_admission"])])
        yield family(CounterMetricFamily, "pd_recovered_sequences", "Sequences of a lost decode worker re-prefilled, "
                     "by where: pd (through the prefill engine) or local (on decode).",
                     [((k,), s.get("recovered", {}).get(k, 0)) for k in ("pd", "local")], ("model_name", "route"))
        yield family(CounterMetricFamily, "kv_leases_expired", "Prefill leases that ran out before the decode engine "
                     "had their blocks.", [((), s["leases_expired"])])
        yield family(GaugeMetricFamily, "kv_transfer_leased_blocks", "Prefill cache blocks held for transfers now.",
                     [((), s["prefill_blocks_leased"])])
        yield family(GaugeMetricFamily, "kv_transfer_arriving_blocks", "Decode cache blocks written for requests "
                     "not yet queued.", [((), s["decode_blocks_arriving"])])
        if sp != PREFIX:  # vLLM's NIXL connector's counters of the same meaning
            for metric, doc, v in (("nixl_num_failed_transfers", "Failed KV transfers.", sum(failures.values())),
                                   ("nixl_num_kv_expired_reqs", "KV leases expired.", s["leases_expired"])):
                c = CounterMetricFamily(sp + metric, doc, labels=list(slabels))
                c.add_metric(list(svalues), v)
                yield c

    @staticmethod
    def _tier_families(s: dict, sp: str, slabels, svalues, name: str) -> Iterable[Metric]:
        """The KV tier (cluster/tiering.py, actors/tier.py): the engine's lookups under vLLM's external prefix
        cache names, and each attention actor's tiers as its last step reported them."""
        from actors.kv_tier import MISSES

        for metric, doc, v in (
                ("external_prefix_cache_queries", "Prompt tokens past a device prefix hit looked up in the KV tier.",
                 s["queried_tokens"]),
                ("external_prefix_cache_hits", "Prompt tokens loaded from the KV tier (not computed).",
                 s["loaded_tokens"])):
            c = CounterMetricFamily(sp + metric, doc, labels=list(slabels))
            c.add_metric(list(svalues), v)
            yield c

        def family(kind, metric: str, doc: str, labels=()):
            return kind(PREFIX + metric, doc, labels=["model_name", *labels])

        load = family(CounterMetricFamily, "kv_tier_load_seconds", "Time spent looking up and loading KV tier entries "
                      "between steps.")
        load.add_metric([name], s["load_s"])
        yield load
        remote = family(CounterMetricFamily, "kv_tier_remote_blocks", "Blocks loaded from another node's tier (read "
                        "there by one of its replicas, checked again on arrival) where the replica's own node lacked "
                        "them.")
        remote.add_metric([name], s.get("remote_blocks", 0))
        yield remote
        failed = family(CounterMetricFamily, "kv_tier_failed_loads", "Lookups whose entries the tier held but did "
                        "not load whole (the request was prefilled).")
        failed.add_metric([name], s["missed"])
        yield failed
        writes = family(CounterMetricFamily, "kv_tier_writes", "Blocks and snapshots written through, by outcome: "
                        "copied (queued to the writer), dropped (its queue was full), error.", ("actor", "outcome"))
        hits = family(CounterMetricFamily, "kv_tier_hits", "Entries read back whole.", ("actor", "tier"))
        misses = family(CounterMetricFamily, "kv_tier_misses", "Entries looked for and not read back, by reason: "
                        "absent, torn, layout, corrupt.", ("actor", "tier", "reason"))
        moved = family(CounterMetricFamily, "kv_tier_bytes", "Bytes written to (in) and read from (out) each tier.",
                       ("actor", "tier", "direction"))
        evictions = family(CounterMetricFamily, "kv_tier_evictions", "Entries evicted (least recently used first; "
                           "the node tier's move down to disk when there is one).", ("actor", "tier"))
        used = family(GaugeMetricFamily, "kv_tier_used_bytes", "Bytes each tier holds (its directory on the actor's "
                      "node; replicas of one node see the same).", ("actor", "tier"))
        capacity = family(GaugeMetricFamily, "kv_tier_capacity_bytes", "Each tier's size bound.", ("actor", "tier"))
        for actor, a in s["actors"].items():
            for outcome, key in (("copied", "copied"), ("dropped", "dropped"), ("error", "write_errors")):
                writes.add_metric([name, actor, outcome], a[key])
            for t in a["tiers"]:
                tier = t["tier"]
                hits.add_metric([name, actor, tier], t["hits"])
                for reason in MISSES:
                    misses.add_metric([name, actor, tier, reason], t["misses"].get(reason, 0))
                moved.add_metric([name, actor, tier, "in"], t["bytes_in"])
                moved.add_metric([name, actor, tier, "out"], t["bytes_out"])
                evictions.add_metric([name, actor, tier], t["evictions"])
                used.add_metric([name, actor, tier], t["used_bytes"])
                capacity.add_metric([name, actor, tier], t["capacity_bytes"])
        yield from (writes, hits, misses, moved, evictions, used, capacity)

    @staticmethod
    def _spec_families(stats, sp: str, slabels, svalues, name: str) -> Iterable[Metric]:
        """Speculative decoding's counters (vLLM's spec_decode_* names), and the experts its
        verification steps touch."""
        for metric, doc, value in (
                ("spec_decode_num_drafts", "Sequence steps that carried draft tokens.", stats.spec_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_accepted_tokens)):
            c = CounterMetricFamily(sp + metric, doc, labels=list(slabels))
            c.add_metric(list(svalues), value)
            yield c
        per = CounterMetricFamily(sp + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, per "
                                  "draft position (0: the first draft).", labels=[*slabels, "position"])
        for pos, n in enumerate(list(stats.spec_accepted_per_pos)):
            per.add_metric([*svalues, str(pos)], n)
        yield per
        steps = CounterMetricFamily(PREFIX + "spec_decode_verify_steps", "Engine steps that verified drafts.",
                                    labels=["model_name"])
        steps.add_metric([name], stats.spec_verify_steps)
        yield steps
        touched = CounterMetricFamily(PREFIX + "spec_decode_experts_touched", "Over the steps that verified "
                                      "drafts: the sum of the mean distinct routed experts a MoE layer touched "
                                      "(divide by spec_decode_verify_steps for the mean per step).",
                                      labels=["model_name"])
        touched.add_metric([name], stats.spec_experts_touched)
        yield touched

    @staticmethod
    def _expert_families(o: EngineMetrics, name: str) -> Iterable[Metric]:
        totals, actors, imbalance = o.snapshot()
        layers = [str(layer) for layer in o._moe_layers]
        if o.expert_metrics == "full":  # ~23k series at Kimi K2 scale: opt-in
            experts = CounterMetricFamily(PREFIX + "expert_tokens",
                                          "Tokens routed to each logical expert, per MoE layer.",
                                          labels=["model_name", "layer", "expert"])
            for layer, row in zip(layers, totals):
                for e, n in enumerate(row):
                    experts.add_metric([name, layer, str(e)], n)
            yield experts
        per_actor = CounterMetricFamily(PREFIX + "expert_actor_tokens",
                                        "Token-expert pairs computed by each expert actor, over all MoE layers.",
                                        labels=["model_name", "actor"])
        for j, n in enumerate(actors):
            per_actor.add_metric([name, str(j)], n)
        yield per_actor
        window = o.router.window_steps
        imb = GaugeMetricFamily(PREFIX + "moe_load_imbalance",
                                f"Max over mean tokens per expert of a MoE layer over the last {window} steps "
                                "(1 = balanced; 0 = no tokens).", labels=["model_name", "layer"])
        for layer, v in zip(layers, imbalance):
            imb.add_metric([name, layer], v)
        yield imb
        hot = GaugeMetricFamily(PREFIX + "moe_hot_expert_tokens",
                                f"Tokens over the last {window} steps of the {o.hot_experts} hottest experts of "
                                "each MoE layer (rank 1 = hottest).", labels=["model_name", "layer", "rank", "expert"])
        for layer, ranked in zip(layers, o.hot()):
            for rank, (e, n) in enumerate(ranked, 1):
                hot.add_metric([name, layer, str(rank), str(e)], n)
        yield hot
        actor_imb = GaugeMetricFamily(PREFIX + "expert_actor_imbalance",
                                      f"Max over mean tokens per expert actor of a MoE layer over the last "
                                      f"{window} steps of the current epoch (1 = balanced; 0 = no "
                                      f"tokens); `moeray rebalance` lowers it.", labels=["model_name", "layer"])
        for layer, v in zip(layers, o.router.measured_imbalance()):
            actor_imb.add_metric([name, layer], v)
        yield actor_imb
