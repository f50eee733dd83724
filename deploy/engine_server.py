"""The engine server: one deployment's engine behind the calls the Ingress makes.

A plain class; deploy/app.py wraps it for Ray Serve (one replica), deploy/inprocess.py serves it in
the caller's process. It owns the :class:`~cluster.engine.Engine` — whose executor it is given a
factory for (default: the Ray executor, which reserves the attention and expert actors from inside
this process) — its :class:`~cluster.aengine.AsyncEngine` thread, the Ingress streams
(:class:`~deploy.mux.EngineStreams`) and the Prometheus registry.
Never: makes text (the engine streams ids; the Ingress decodes), touches the engine off its thread
(control calls go through the async engine's inbox; ``/metrics`` reads the published snapshot),
or waits on the engine without a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cluster.aengine import AsyncEngine
from cluster.apd import AsyncDisaggregated
from cluster.engine import Engine
from cluster.stream import EngineRequest
from model.config import load_config
from model.tokenizer import Tokenizer

from .config import ServeConfig
from .metrics import EngineMetrics
from .mux import EngineStreams
from .responses_api import ResponseStore
from .settings import serve_ingress

CONTROL_TIMEOUT_S = 15.0
ADMIN_TIMEOUT_S = 900.0  # an epoch change waits for new actors to load their weights

# (EngineConfig, ClusterSpec, ModelConfig) → an Executor (cluster/executor.py); None: the Ray executor
ExecutorFactory = Callable[..., object]


@dataclass(frozen=True)
class Reject:
    """EngineServer → Ingress, the answer to a submit: the request was not admitted."""

    status: int
    message: str
    param: str | None = None


class EngineServer:
    def __init__(self, raw: dict, model_path: str, *, owner: str | None = None,
                 executor_factory: ExecutorFactory | None = None):
        """``raw``: a :class:`ServeConfig` as a dict. ``owner`` names the engine's placement groups
        (and cleans up a dead predecessor's)."""
        serve_cfg = ServeConfig.parse(raw)
        tok = Tokenizer.from_dir(model_path)  # its stop ids only: no text is made here
        self.name = serve_cfg.name_for(Path(model_path))
        self.max_queue = serve_cfg.max_queue
        config, spec = serve_cfg.engine_config(model_path, owner), serve_cfg.cluster_spec()
        mc = load_config(model_path)
        executor = executor_factory(config, spec, mc) if executor_factory else None
        self.engine = Engine(config, spec, stop_ids=tok.stop_token_ids, executor=executor).start()
        self._closed = False
        self.responses = ResponseStore()  # /v1/responses with store: one per app, so any Ingress replica finds them
        self.aengine = AsyncEngine(self.engine).start()
        # prefill/decode disaggregation: this deployment's engine decodes; a second one prefills long prompts
        self.prefill: AsyncEngine | None = None
        self.pd: AsyncDisaggregated | None = None
        if serve_cfg.disaggregation is not None:
            d = serve_cfg.disaggregation.record
            pconfig, pspec = d.prefill_engine(config, spec.attention_resources)
            try:
                pexec = executor_factory(pconfig, pspec, mc) if executor_factory else None
                prefill = Engine(pconfig, pspec, stop_ids=tok.stop_token_ids, executor=pexec).start()
            except BaseException:
                self.shutdown()
                raise
            self.prefill = AsyncEngine(prefill).start()
            self.pd = AsyncDisaggregated(self.prefill, self.aengine, min_uncached_tokens=d.min_uncached_tokens,
                                         lease_s=d.lease_s, transport=d.transport)
        self.streams = EngineStreams(self.pd or self.aengine)
        self.metrics = EngineMetrics(self.engine, self.name, prefix=serve_cfg.metrics_prefix,
                                     expert_metrics=serve_cfg.expert_metrics, pd=self.pd.core if self.pd else None)
        self.ingress = serve_ingress()  # set when the Ray nodes start, not by the app (settings.py)
        if executor_factory is None and self.ingress != serve_cfg.ingress:  # on Ray: its nodes decide
            logging.getLogger("ray.serve").warning(
                "the serving config asks for ingress %r, but this Ray cluster's nodes run %r: the `ray start` "
                "environment decides (deploy/ray-cluster-*.yaml carry the haproxy one)", serve_cfg.ingress, self.ingress)

    async def subscribe(self, sink: str):
        """One Ingress replica's stream of every chunk of its requests (:mod:`deploy.mux`)."""
        async for batch in self.streams.subscribe(sink):
            yield batch

    async def submit(self, sink: str, key: int, requests: list[EngineRequest]) -> Reject | None:
        """Admit one request's sequences together; their chunks ride on subscription ``sink``. None, or
        a :class:`Reject` when the request was not admitted."""
        front = self.pd or self.aengine  # (with PD, the requests in a transfer wait too)
        if front.num_waiting + self.streams.num_starting + len(requests) > self.max_queue:
            return Reject(503, f"the request queue is full ({self.max_queue} waiting); retry shortly")
        try:
            self.streams.submit(sink, key, requests)
        except ValueError as e:
            return Reject(400, str(e), "prompt")
        except RuntimeError as e:
            return Reject(503, f"the engine is unavailable: {e}")
        return None

    def cancel(self, sink: str, keys: list[int]) -> None:
        self.streams.cancel(sink, keys)

    def stop_choice(self, sink: str, key: int, index: int) -> None:
        self.streams.stop_choice(sink, key, index)

    def store_response(self, response_id: str, messages: list[dict]) -> None:
        """Keep a Responses API conversation for ``previous_response_id`` (bounded, expiring)."""
        self.responses.put(response_id, messages)

    def recall_response(self, response_id: str) -> list[dict] | None:
        return self.responses.get(response_id)

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def experts(self) -> dict:
        return self.metrics.expert_distribution()

    def health(self) -> dict:
        a = self.aengine
        why = a.unavailable if a.alive else f"the engine failed: {a.error}"
        return {"healthy": a.healthy, "error": why}

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine failed for good is replaced. One waiting for
        capacity to recover stays (it heals itself and answers 503 meanwhile)."""
        if not self.aengine.alive:
            raise RuntimeError(f"the engine failed: {self.aengine.error}")

    async def chaos(self, kind: str, index: int) -> dict:
        """Fault injection: a kill of one attention or expert actor (``moeray chaos``), done on the
        engine thread between steps."""
        try:
            killed = await self._on_engine_thread(lambda e: e.executor.kill(kind, index))
        except ValueError as e:
            return {"ok": False, "status": 400, "error": str(e)}
        except Exception as e:  # noqa: BLE001 — the engine is gone or did not answer
            return {"ok": False, "status": 503, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "killed": killed}

    async def _on_engine_thread(self, fn):
        """``fn(engine)`` on the engine thread (the only one that touches the engine), waited for."""
        fut = self.aengine.control(fn, even_if_unavailable=True)
        return await asyncio.wait_for(asyncio.wrap_future(fut), CONTROL_TIMEOUT_S)

    async def change(self, kind: str, value: int | None, engine: str = "decode") -> dict:
        """An epoch change (``kind``: experts, attention, workers, rebalance) of the serving engine, or with
        ``engine="prefill"`` of a PD deployment's prefill engine, waited for; ``{"ok", "change"}`` or
        ``{"ok": False, "status", "error"}`` (a shape the router refuses is the caller's error)."""
        target = self.aengine
        if engine == "prefill":
            if self.prefill is None:
                return {"ok": False, "status": 400, "error": "this deployment has no prefill engine (the serving "
                                                             "config's disaggregation section starts one)"}
            target = self.prefill
        begin = {"experts": lambda e: e.begin_scale_experts(value),
                 "attention": lambda e: e.begin_scale_attention(value),
                 "workers": lambda e: e.begin_scale_workers(value),
                 "rebalance": lambda e: e.begin_rebalance(value)}[kind]
        which = "the prefill engine: " if engine == "prefill" else ""
        try:
            change = await target.change(begin, ADMIN_TIMEOUT_S)
        except ValueError as e:
            return {"ok": False, "status": 400, "error": f"{which}{e}"}
        except Exception as e:  # noqa: BLE001 — the change did not happen; the engine serves on
            return {"ok": False, "status": 503, "error": f"{which}{type(e).__name__}: {e}"}
        return {"ok": True, "change": change.as_dict()}

    async def status(self) -> dict:
        snap = await self._on_engine_thread(lambda e: e.status())
        table, tokens, actors = snap["table"], snap["actor_tokens"], snap["actors"]
        weights = []  # each expert actor's resident bytes: asked on the engine thread, waited for here
        if actors["weight_bytes"]:
            futs = [asyncio.wrap_future(f) for f in actors["weight_bytes"]]
            _, pending = await asyncio.wait(futs, timeout=CONTROL_TIMEOUT_S)  # never cancels Ray's futures
            if not pending and not any(f.exception() for f in futs):  # else an expert actor is down
                weights = [f.result() for f in futs]
        replicated = [set(table.replicated(i)) for i in range(len(table.moe_layers))]
        layout = "colocated" if table.colocated else "disaggregated"
        out = {
            "model": self.name, "healthy": self.aengine.healthy, "shape": table.shape(), "pid": os.getpid(),
            "layout": layout,
            "failures": snap["failures"], "recoveries_s": snap["recoveries_s"], "hangs": snap["hangs"],
            "last_hang": snap["last_hang"],
            "running": snap["running"], "waiting": snap["waiting"], "steps": snap["steps"],
            "epoch": table.epoch, "last_change": snap["changes"][-1] if snap["changes"] else None,
            "changing": snap["changing"], "change": snap["change"], "ping_pong": snap["ping_pong"],
            "breakdown": snap["breakdown"], "profile": snap["profile"], "compile": snap["compile"],
            "ingress": self.ingress,
            "streams": {"subscriptions": len(self.streams.sinks), "requests": self.streams.num_requests},
            "prefix_caching": self.engine.config.cache.prefix_caching,
            "speculative": snap["speculative"],
            "kv_tier": snap["kv_tier"],
            "attention": [{"index": i, "node": a["node"], "sequences": seqs, "cache_blocks_used": used,
                           "cache_blocks": total, "prefix_cache": pc}
                          for i, (a, seqs, (used, total), pc) in enumerate(zip(actors["attention"], snap["sequences"],
                                                                               snap["cache"], snap["prefix_cache"]))],
            "experts": [{"index": j, "node": x["node"],
                         "slots": {str(layer): list(ids) for layer, ids in table.experts_of(j).items()},
                         "replicas": {str(layer): [e for e in ids if e in replicated[i]]
                                      for i, (layer, ids) in enumerate(table.experts_of(j).items())},
                         "tokens": tokens[j] if j < len(tokens) else 0,
                         "weight_bytes": weights[j] if j < len(weights) else None}
                        for j, x in enumerate(actors["experts"])],
        }
        if self.pd is not None:  # the prefill engine, the routes and the transfers
            p = self.prefill.engine.snapshot
            out["disaggregation"] = {**self.pd.status(), "prefill": {
                "healthy": self.prefill.healthy, "shape": self.prefill.engine.executor.table.shape(),
                "running": p.running, "waiting": p.waiting}}
        # colocated: worker i is attention replica i and expert shard i, shown together
        out["workers"] = ([{"index": i, "node": a["node"], "attention": a, "experts": x}
                           for i, (a, x) in enumerate(zip(out["attention"], out["experts"]))] if table.colocated else [])
        return out

    def shutdown(self) -> None:
        """Stop the engine thread and the actors (once)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self.aengine.stop(timeout=5)
            if getattr(self, "prefill", None) is not None:
                self.prefill.stop(timeout=5)
        finally:
            try:
                self.engine.shutdown()
            finally:
                if getattr(self, "prefill", None) is not None:
                    self.prefill.engine.shutdown()

    def __del__(self):  # Serve calls it when the replica stops
        self.shutdown()
