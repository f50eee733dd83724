"""The Ray Serve application: an OpenAI-compatible FastAPI ingress and the engine deployment.

:class:`EngineServer` (one replica) owns the :class:`~cluster.engine.Engine` — which reserves
the attention and expert actors from inside this replica — its :class:`AsyncEngine` thread and
the Prometheus registry. :class:`Ingress` owns HTTP: auth, body limits, OpenAI parsing, prompt
tokenisation, stop strings, and streaming through a Serve handle. It never touches the engine
directly, and every error leaves as OpenAI's envelope.
"""

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.aengine import AsyncEngine, StreamChunk
from cluster.engine import Engine, EngineConfig
from model.config import load_config
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

from . import openai_api as oa
from .config import ServeConfig
from .metrics import EngineMetrics


CONTROL_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Reject:
    """EngineServer → Ingress instead of a first chunk: the request was not admitted."""

    status: int
    message: str
    param: str | None = None


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
class EngineServer:
    def __init__(self, raw: dict, model_path: str):
        cfg = ServeConfig.parse(raw)
        tok = Tokenizer.from_dir(model_path)
        self.name = cfg.name_for(Path(model_path))
        self.max_queue = cfg.max_queue
        self.engine = Engine(
            EngineConfig(model=model_path, dtype=cfg.dtype, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
                         num_slots=cfg.num_slots, max_num_seqs=cfg.max_num_seqs,
                         max_tokens_per_step=cfg.max_tokens_per_step),
            cfg.cluster_spec(), stop_ids=tok.stop_token_ids).start()
        self.aengine = AsyncEngine(self.engine, tok).start()
        self.metrics = EngineMetrics(self.engine, self.name, prefix=cfg.metrics_prefix,
                                     expert_metrics=cfg.expert_metrics)

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        if self.aengine.num_waiting >= self.max_queue:
            yield Reject(503, f"the request queue is full ({self.max_queue} waiting); retry shortly")
            return
        try:
            stream = self.aengine.generate(prompt_ids, params)
            first = await stream.__anext__()
        except ValueError as e:
            yield Reject(400, str(e), "prompt")
            return
        except RuntimeError as e:
            yield Reject(503, f"the engine is unavailable: {e}")
            return
        yield first
        async for chunk in stream:
            yield chunk

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def experts(self) -> dict:
        return self.metrics.expert_distribution()

    def health(self) -> dict:
        return {"healthy": self.aengine.healthy, "error": None if self.aengine.error is None else str(self.aengine.error)}

    def status(self) -> dict:
        eng, res = self.engine, self.engine.reservation
        sched = eng.scheduler
        return {
            "model": self.name, "healthy": self.aengine.healthy, "shape": eng.spec.describe(),
            "running": len(sched.running), "waiting": len(sched.waiting), "steps": eng.stats.steps,
            "attention": [{"index": i, "node": res.node_ip_of("attention", i),
                           "cache_blocks_used": a.num_blocks - a.num_free, "cache_blocks": a.num_blocks}
                          for i, a in enumerate(sched.blocks)],
            "experts": [{"index": j, "node": res.node_ip_of("expert", j), "experts": list(r),
                         "tokens": (eng.stats.actor_tokens_total or [0] * len(eng.table.ranges))[j]}
                        for j, r in enumerate(eng.table.ranges)],
            "epoch": eng.table.epoch,
        }

    def __del__(self):
        try:
            self.aengine.stop(timeout=5)
        finally:
            self.engine.shutdown()


class _Choice:
    """One choice of a request: its stream from the engine, with stop strings applied."""

    def __init__(self, index: int, gen, first: StreamChunk, stops: oa.StopStrings, want_logprobs: bool):
        self.index, self.gen, self.first, self.stops = index, gen, first, stops
        self.want_logprobs, self.role_sent = want_logprobs, False
        self.text, self.token_ids, self.sampled, self.finish = "", [], [], None

    async def chunks(self):
        """(text, sampled, finish_reason) pieces until the choice ends."""
        pending = [self.first]
        while True:
            chunk = pending.pop() if pending else await self.gen.__anext__()
            self.token_ids.extend(chunk.token_ids)
            self.sampled.extend(chunk.sampled)
            text, stopped = self.stops.push(chunk.text)
            if stopped:
                self.gen.cancel()
                self.finish = "stop"
                yield text, list(chunk.sampled), "stop"
                return
            finish = chunk.finish_reason
            if finish is not None:
                text += self.stops.flush()
                self.finish = "stop" if finish == "stop" else "length"
                yield text, list(chunk.sampled), self.finish
                return
            yield text, list(chunk.sampled), None

    async def drain(self) -> None:
        async for text, _, _ in self.chunks():
            self.text += text

    async def pump(self, queue: asyncio.Queue) -> None:
        try:
            async for text, sampled, finish in self.chunks():
                await queue.put((self, text, sampled, finish))
        finally:
            await queue.put(None)

    def result(self) -> oa.ChoiceResult:
        return oa.ChoiceResult(self.index, self.text, self.token_ids, self.finish,
                               self.sampled if self.want_logprobs else None)


api = FastAPI(title="moeray", description="OpenAI-compatible serving of MoE models on Ray")


@api.exception_handler(oa.APIError)
async def _api_error(_request: Request, err: oa.APIError):
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(Exception)
async def _server_error(_request: Request, err: Exception):
    return JSONResponse(oa.error_body(500, f"internal error: {type(err).__name__}: {err}", "server_error"),
                        status_code=500)


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, engine: DeploymentHandle, raw: dict, model_path: str):
        self.cfg = ServeConfig.parse(raw)
        self.engine = engine
        self.stream_handle = engine.options(stream=True)
        self.tok = Tokenizer.from_dir(model_path)
        mcfg = load_config(model_path)
        self.context = mcfg.max_position_embeddings
        self.name = self.cfg.name_for(Path(model_path))
        self.created = int(time.time())

    # ---- plumbing ---------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.cfg.api_key
        if key is not None and request.headers.get("authorization", "") != f"Bearer {key}":
            raise oa.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            raise oa.APIError(413, f"request body is {declared} bytes, over the limit of {self.cfg.max_body_bytes}",
                              code="request_too_large")
        return await request.body()

    async def _open(self, ids: list[int], params: SamplingParams):
        """Start one choice; its first chunk decides the status (Reject → error)."""
        gen = self.stream_handle.generate.remote(ids, params)
        first = await gen.__anext__()
        if isinstance(first, Reject):
            raise oa.APIError(first.status, first.message, param=first.param,
                              retry_after_s=1 if first.status == 503 else None)
        return gen, first

    # ---- routes -------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        try:
            h = await asyncio.wait_for(self.engine.health.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 — any failure to answer is "not ready"
            return JSONResponse({"status": "unavailable", "error": str(e)}, status_code=503)
        if not h["healthy"]:
            return JSONResponse({"status": "degraded", "error": h["error"]}, status_code=503)
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return oa.models_response([self.name], self.created)

    async def _ask_engine(self, call, what: str):
        """A control call to the engine replica, bounded in time (503 rather than a hang)."""
        try:
            return await asyncio.wait_for(call.remote(), timeout=CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise oa.APIError(503, f"the engine did not answer {what} within {CONTROL_TIMEOUT_S:.0f}s",
                              retry_after_s=1) from None

    @api.get("/metrics")
    async def metrics(self, request: Request):
        self._auth(request)
        text = await self._ask_engine(self.engine.metrics_text, "/metrics")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/status")
    async def status(self, request: Request):
        self._auth(request)
        return await self._ask_engine(self.engine.status, "/status")

    @api.get("/admin/experts")
    async def experts(self, request: Request):
        """The full token distribution over (MoE layer, logical expert), as JSON."""
        self._auth(request)
        return await self._ask_engine(self.engine.experts, "/admin/experts")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._auth(request)
        req = oa.parse_request(oa.CompletionRequest, await self._body(request), self.cfg.max_body_bytes)
        oa.resolve_model(req.model, [self.name])
        prompts = oa.prompt_token_lists(req, self.tok)
        jobs = []
        for p_i, ids in enumerate(prompts):
            params = oa.sampling_params(req, prompt_len=len(ids), max_model_len=self.context)
            jobs += [(p_i * req.n + j, ids, sp) for j, sp in enumerate(oa.choice_params(params, req.n))]
        return await self._respond(req, jobs, sum(len(p) for p in prompts), chat=False)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        self._auth(request)
        req = oa.parse_request(oa.ChatCompletionRequest, await self._body(request), self.cfg.max_body_bytes)
        oa.resolve_model(req.model, [self.name])
        ids = oa.chat_prompt_ids(req, self.tok)
        params = oa.sampling_params(req, prompt_len=len(ids), max_model_len=self.context)
        jobs = [(j, ids, sp) for j, sp in enumerate(oa.choice_params(params, req.n))]
        return await self._respond(req, jobs, len(ids), chat=True)

    async def _respond(self, req, jobs, prompt_tokens: int, chat: bool):
        stops = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
        opened = []
        try:
            for index, ids, sp in jobs:
                opened.append((index, *await self._open(ids, sp), sp))
        except BaseException:
            for _, gen, _, _ in opened:
                gen.cancel()
            raise
        choices = [_Choice(index, gen, first, oa.StopStrings(stops), sp.logprobs is not None)
                   for index, gen, first, sp in opened]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(choices, chat, prompt_tokens, include_usage),
                                     media_type="text/event-stream")
        await asyncio.gather(*(c.drain() for c in choices))
        results = [c.result() for c in choices]
        build = oa.chat_response if chat else oa.completion_response
        return build(self.name, results, oa.usage(prompt_tokens, sum(len(r.token_ids) for r in results)),
                     tokenizer=self.tok)

    async def _sse(self, choices: list, chat: bool, prompt_tokens: int, include_usage: bool):
        rid, created = oa.new_request_id("chatcmpl" if chat else "cmpl"), int(time.time())
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(c.pump(queue)) for c in choices]
        try:
            for _ in choices:
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    yield oa.sse(self._chunk(rid, created, chat, *item))
            if include_usage:
                done = sum(len(c.token_ids) for c in choices)
                yield oa.sse(oa.usage_chunk(rid, self.name, created, oa.usage(prompt_tokens, done), chat=chat))
            yield oa.SSE_DONE
        finally:  # a client that went away cancels every choice, which frees its cache
            for t in tasks:
                t.cancel()
            for c in choices:
                c.gen.cancel()

    def _chunk(self, rid, created, chat, choice, text, sampled, finish):
        if chat:
            lp = oa.chat_logprobs(sampled, self.tok) if choice.want_logprobs and sampled else None
            first = not choice.role_sent
            choice.role_sent = True
            return oa.chat_chunk(rid, self.name, created, index=choice.index, text=text, first=first,
                                 finish_reason=finish, logprobs=lp)
        lp = oa.completion_logprobs(sampled, self.tok) if choice.want_logprobs and sampled else None
        return oa.completion_chunk(rid, self.name, created, index=choice.index, text=text, finish_reason=finish,
                                   logprobs=lp)


def build_app(args: dict):
    """`serve deploy` / `serve run deploy.app:build_app`: args are a :class:`ServeConfig`."""
    from model.presets import resolve_model

    from .settings import cache_root

    cfg = ServeConfig.parse(args or {})
    path = str(resolve_model(cfg.model, cache_root()).resolve())
    raw = cfg.model_dump()
    return Ingress.bind(EngineServer.bind(raw, path), raw, path)
