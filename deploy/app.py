"""The Ray Serve application: an OpenAI-compatible FastAPI ingress and the engine deployment.

:class:`EngineServer` (one replica) owns the :class:`~cluster.engine.Engine` — which reserves
the attention and expert actors from inside this replica — its :class:`AsyncEngine` thread and
the Prometheus registry. :class:`Ingress` owns HTTP: auth, body limits, OpenAI parsing, prompt
tokenisation, stop strings, and streaming through a Serve handle. It never touches the engine
directly, and every error leaves as OpenAI's envelope.
"""

import asyncio
import contextlib
import hmac
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
import ray
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray.serve.handle import DeploymentHandle

from cluster.aengine import AsyncEngine, StreamChunk
from cluster.engine import Engine
from cluster.progress import load_progress, still_loading
from model.config import load_config
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

from . import openai_api as oa
from . import openai_responses as out
from .chat_turn import ChatOutput, ChatPlan, plan_chat
from .config import ServeConfig
from .fanout import Fanout
from .mux import EngineStreams, StreamMux
from .metrics import EngineMetrics
from .openapi_doc import OpenAPIDoc, errors, ok, ok_text
from .settings import admin_key, serve_ingress


CONTROL_TIMEOUT_S = 15.0
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request asks whether its client is still there
ADMIN_TIMEOUT_S = 900.0  # an epoch change waits for new actors to load their weights
FORBIDDEN = {403: {"model": out.ErrorResponse, "description": "The admin routes are off: no admin key is configured."}}
ADMIN_DOC = {**ok(out.EpochChangeReport), **errors(400, 401, 413, 503), **FORBIDDEN}
ADMIN_OFF = ("the admin routes are off: this server has no admin key. Give it one with `moeray up --admin-key KEY`, "
             "admin_api_key or admin_api_key_file in the serving config, or MOERAY_ADMIN_KEY in the Ray nodes' "
             "environment (the `ray up` YAMLs and the KubeRay manifest in deploy/ set it from a secret); "
             "`moeray up` on a loopback address makes one by itself")


class ScaleRequest(BaseModel):
    """Body of POST /admin/scale/experts and /admin/scale/attention."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(..., ge=1, le=4096, description="The number of actors of that kind after the change.")


class ChaosRequest(BaseModel):
    """Body of POST /admin/chaos: which actor to kill."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["expert", "attention"]
    index: int = Field(..., ge=0, le=65535)


class RebalanceRequest(BaseModel):
    """Body of POST /admin/rebalance."""

    model_config = ConfigDict(extra="forbid")
    redundant_slots: int | None = Field(None, ge=0, le=65536,
                                        description="Spare physical slots per MoE layer for copies of hot "
                                                    "experts; default: the serving config's.")


class Access:
    """Who may call what, for one Ingress replica: the inference keys (every route but /health, the
    OpenAPI pages and /admin/*; none: open) and the admin key (/admin/*; none: those routes are
    off). Resolved once, when the replica starts. Keys are compared in constant time, every key
    each time. Never logs, returns or echoes a key."""

    def __init__(self, inference: list[str], admin: str | None):
        if admin is not None and admin in inference:
            raise ValueError("the admin key must differ from every inference key")
        self._inference = tuple(k.encode() for k in inference)
        self._admin = admin.encode() if admin is not None else None

    @classmethod
    def of(cls, serve_cfg: ServeConfig, env_admin_key: str | None) -> "Access":
        return cls(serve_cfg.inference_keys(), serve_cfg.admin_key(env_admin_key))

    @property
    def needs_key(self) -> bool:
        return bool(self._inference)

    def check(self, request: Request) -> None:
        """A route behind the inference keys: 401 without one of them."""
        if self._inference and not _matches(_bearer(request), self._inference):
            raise oa.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    def check_admin(self, request: Request) -> None:
        """An /admin/* route: 403 while there is no admin key, 401 without it (an inference key is not it)."""
        if self._admin is None:
            raise oa.APIError(403, ADMIN_OFF, type="permission_error", code="admin_disabled")
        if not _matches(_bearer(request), (self._admin,)):
            raise oa.APIError(401, "missing or wrong admin key: the /admin routes need 'Authorization: Bearer "
                                   "<admin key>', which is not an API key", code="invalid_admin_key")


def _bearer(request: Request) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case), as bytes."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip().encode("latin-1") if scheme.lower() == "bearer" else None  # Starlette decodes latin-1


def _matches(token: bytes | None, keys: tuple[bytes, ...]) -> bool:
    # every key is compared (no early exit): the time does not say which key nearly matched
    return token is not None and sum(hmac.compare_digest(token, k) for k in keys) > 0


@dataclass(frozen=True)
class Reject:
    """EngineServer → Ingress, the answer to a submit: the request was not admitted."""

    status: int
    message: str
    param: str | None = None


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}, health_check_period_s=2,
                  health_check_timeout_s=10)
class EngineServer:
    def __init__(self, raw: dict, model_path: str):
        serve_cfg = ServeConfig.parse(raw)
        tok = Tokenizer.from_dir(model_path)
        self.name = serve_cfg.name_for(Path(model_path))
        self.max_queue = serve_cfg.max_queue
        owner = f"moeray-{serve.get_replica_context().app_name}"  # names its placement groups; cleans up orphans
        self.engine = Engine(serve_cfg.engine_config(model_path, owner), serve_cfg.cluster_spec(),
                             stop_ids=tok.stop_token_ids).start()
        self.aengine = AsyncEngine(self.engine, tok).start()
        self.streams = EngineStreams(self.aengine)
        self.metrics = EngineMetrics(self.engine, self.name, prefix=serve_cfg.metrics_prefix,
                                     expert_metrics=serve_cfg.expert_metrics)
        self.ingress = serve_ingress()  # set when the Ray nodes start, not by the app (settings.py)
        if self.ingress != serve_cfg.ingress:
            logging.getLogger("ray.serve").warning(
                "the serving config asks for ingress %r, but this Ray cluster's nodes run %r: the `ray start` "
                "environment decides (deploy/ray-cluster-*.yaml carry the haproxy one)", serve_cfg.ingress, self.ingress)

    async def subscribe(self, sink: str):
        """One Ingress replica's stream of every chunk of its requests (:mod:`deploy.mux`)."""
        async for batch in self.streams.subscribe(sink):
            yield batch

    async def submit(self, sink: str, key: int, jobs: list[tuple[list[int], SamplingParams]]) -> Reject | None:
        """Admit one request's sequences together; their chunks ride on subscription ``sink``. None, or
        a :class:`Reject` when the request was not admitted."""
        if self.aengine.num_waiting + len(jobs) > self.max_queue:
            return Reject(503, f"the request queue is full ({self.max_queue} waiting); retry shortly")
        try:
            self.streams.submit(sink, key, jobs)
        except ValueError as e:
            return Reject(400, str(e), "prompt")
        except RuntimeError as e:
            return Reject(503, f"the engine is unavailable: {e}")
        return None

    def cancel(self, sink: str, keys: list[int]) -> None:
        self.streams.cancel(sink, keys)

    def stop_choice(self, sink: str, key: int, index: int) -> None:
        self.streams.stop_choice(sink, key, index)

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
        """Fault injection: ``ray.kill`` of one attention or expert actor (``moeray chaos``), done on
        the engine thread between steps."""
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

    async def change(self, kind: str, value: int | None) -> dict:
        """An epoch change (``kind``: experts, attention, rebalance), waited for; ``{"ok", "change"}`` or
        ``{"ok": False, "status", "error"}`` (a shape the router refuses is the caller's error)."""
        begin = {"experts": lambda e: e.begin_scale_experts(value),
                 "attention": lambda e: e.begin_scale_attention(value),
                 "rebalance": lambda e: e.begin_rebalance(value)}[kind]
        try:
            change = await self.aengine.change(begin, ADMIN_TIMEOUT_S)
        except ValueError as e:
            return {"ok": False, "status": 400, "error": str(e)}
        except Exception as e:  # noqa: BLE001 — the change did not happen; the engine serves on
            return {"ok": False, "status": 503, "error": f"{type(e).__name__}: {e}"}
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
        return {
            "model": self.name, "healthy": self.aengine.healthy, "shape": table.shape(), "pid": os.getpid(),
            "failures": snap["failures"], "recoveries_s": snap["recoveries_s"], "hangs": snap["hangs"],
            "last_hang": snap["last_hang"],
            "running": snap["running"], "waiting": snap["waiting"], "steps": snap["steps"],
            "epoch": table.epoch, "last_change": snap["changes"][-1] if snap["changes"] else None,
            "changing": snap["changing"], "change": snap["change"], "ping_pong": snap["ping_pong"],
            "breakdown": snap["breakdown"],
            "ingress": self.ingress,
            "streams": {"subscriptions": len(self.streams.sinks), "requests": self.streams.num_requests},
            "prefix_caching": self.engine.config.prefix_caching,
            "attention": [{"index": i, "node": a["node"], "cache_blocks_used": used, "cache_blocks": total,
                           "prefix_cache": pc}
                          for i, (a, (used, total), pc) in enumerate(zip(actors["attention"], snap["cache"],
                                                                         snap["prefix_cache"]))],
            "experts": [{"index": j, "node": x["node"],
                         "slots": {str(layer): list(ids) for layer, ids in table.experts_of(j).items()},
                         "replicas": {str(layer): [e for e in ids if e in replicated[i]]
                                      for i, (layer, ids) in enumerate(table.experts_of(j).items())},
                         "tokens": tokens[j] if j < len(tokens) else 0,
                         "weight_bytes": weights[j] if j < len(weights) else None}
                        for j, x in enumerate(actors["experts"])],
        }

    def __del__(self):
        try:
            self.aengine.stop(timeout=5)
        finally:
            self.engine.shutdown()


async def _events(choices: list):
    """Every choice's ``(choice, text, sampled, finish)`` pieces as they come, or the exception that
    ended them. One choice is read directly; several are pumped into one queue."""
    if len(choices) == 1:
        c = choices[0]
        try:
            async for piece in c.chunks():
                yield (c, *piece)
        except Exception as e:  # noqa: BLE001 — the engine failed mid-stream: an error event, not a hang
            yield e
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(c.pump(queue)) for c in choices]
    try:
        for _ in choices:
            while (item := await queue.get()) is not None:
                yield item
                if isinstance(item, Exception):
                    return
    finally:
        for t in tasks:
            t.cancel()


async def _drain_while_connected(request: Request, choices: list) -> bool:
    """Read every choice to its end; False as soon as the client is found gone (the caller frees the
    sequences). Serve cancels a handler whose client went away; the poll covers servers that do not."""
    drain = asyncio.ensure_future(asyncio.gather(*(c.drain() for c in choices)))
    try:
        while not drain.done():
            await asyncio.wait({drain}, timeout=DISCONNECT_POLL_S)
            if not drain.done() and await request.is_disconnected():
                return False
        drain.result()
        return True
    finally:
        if not drain.done():
            drain.cancel()


def _raise_reject(first: Reject):
    raise oa.APIError(first.status, first.message, param=first.param,
                      retry_after_s=1 if first.status == 503 else None)


def _stream_error(err: Exception) -> dict:
    """The error event that ends a stream whose engine failed (OpenAI's envelope, status 503)."""
    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:  # the engine replica's own error
        err = err.cause
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return oa.error_body(503, f"the request failed while generating ({type(err).__name__}: {first}); "
                              "retry it", code="engine_failed")


class _TextOutput:
    """A completion choice's output: the text through its stop strings (:class:`ChatOutput`'s
    interface, for text)."""

    def __init__(self, stops: oa.StopStrings):
        self.stops = stops

    def push(self, token_ids, text: str) -> tuple[str, bool]:
        return self.stops.push(text)

    def finish(self, engine_reason: str) -> tuple[str, str]:
        return self.stops.flush(), "stop" if engine_reason == "stop" else "length"


class _Choice:
    """One choice of a request: its stream from the engine, with stop strings applied, and where its
    streamed logprobs' text offsets have got to."""

    def __init__(self, index: int, gen, first: StreamChunk, stops: oa.StopStrings, params: SamplingParams,
                 out: ChatOutput | None = None):
        self.index, self.gen, self.first, self.stops, self.out = index, gen, first, stops, out
        self.cached_tokens = first.cached_tokens  # of its prompt, found in the prefix cache
        self.want_logprobs, self.role_sent = params.logprobs is not None, False
        self.skip_special_tokens = params.skip_special_tokens
        self.text, self.token_ids, self.sampled, self.finish = "", [], [], None
        self.text_offset = 0  # of the next streamed token, as the non-streamed logprobs count it

    async def chunks(self):
        """(piece, sampled, finish_reason) until the choice ends: a completion's pieces are text, a
        chat choice's lists of deltas (:class:`ChatOutput`)."""
        out = self.out if self.out is not None else _TextOutput(self.stops)
        pending = [self.first]
        while True:
            chunk = pending.pop() if pending else await self.gen.__anext__()
            self.token_ids.extend(chunk.token_ids)
            self.sampled.extend(chunk.sampled)
            ids = chunk.token_ids[:-1] if chunk.finish_reason == "stop" and chunk.token_ids else chunk.token_ids
            # the stop token's text, left out unless include_stop_str_in_output (vLLM's meaning)
            piece, stopped = out.push(ids, chunk.text + (chunk.stop_text if self.stops.include else ""))
            if stopped:
                self.gen.cancel()
            reason = "stop" if stopped else chunk.finish_reason
            if reason is not None:
                more, self.finish = out.finish(reason)
                yield piece + more, list(chunk.sampled), self.finish
                return
            yield piece, list(chunk.sampled), None

    async def drain(self) -> None:
        async for text, _, _ in self.chunks():
            if self.out is None:
                self.text += text

    async def pump(self, queue: asyncio.Queue) -> None:
        try:
            async for text, sampled, finish in self.chunks():
                await queue.put((self, text, sampled, finish))
        except Exception as e:  # noqa: BLE001 — the engine failed mid-stream: an error event, not a hang
            await queue.put(e)
        finally:
            await queue.put(None)

    def result(self) -> oa.ChoiceResult:
        return oa.ChoiceResult(self.index, self.text, self.token_ids, self.finish,
                               self.sampled if self.want_logprobs else None,
                               self.out.message if self.out is not None else None)


api = FastAPI(title="moeray", description="OpenAI-compatible serving of MoE models on Ray")
doc = OpenAPIDoc(api)  # request bodies: the same models the routes parse with (oa.parse_request)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, err: StarletteHTTPException):  # unknown route, wrong method
    return JSONResponse(oa.error_body(err.status_code, str(err.detail)), status_code=err.status_code,
                        headers=getattr(err, "headers", None))


@api.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, err: RequestValidationError):  # never FastAPI's 422
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
    return JSONResponse(oa.error_body(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}"), status_code=400)


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
        self.serve_cfg = ServeConfig.parse(raw)
        self.access = Access.of(self.serve_cfg, admin_key())  # $MOERAY_ADMIN_KEY of this node (settings.py)
        self.engine = engine
        self.mux = StreamMux(engine, CONTROL_TIMEOUT_S)
        self.tok = Tokenizer.from_dir(model_path)
        mcfg = load_config(model_path)
        self.context = min(mcfg.max_position_embeddings, self.serve_cfg.max_model_len or mcfg.max_position_embeddings)
        self.cache_tokens = self.serve_cfg.num_blocks * self.serve_cfg.block_size  # one replica's cache
        self.name = self.serve_cfg.name_for(Path(model_path))
        self.created = int(time.time())
        doc.specialize(model_names=[self.name], vocab_size=self.tok.vocab_size, max_model_len=self.context,
                       api_key=self.access.needs_key)

    def __del__(self):  # Serve calls it at shutdown, on the replica's event loop
        self.mux.close()

    # ---- plumbing ---------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        self.access.check(request)

    def _auth_admin(self, request: Request) -> None:
        self.access.check_admin(request)

    def _check_max(self, kind: str, n: int) -> None:
        """A scale beyond the serving config's maximum is refused here, before the engine is asked."""
        key = {"experts": "max_expert_actors", "attention": "max_attention"}[kind]
        most = getattr(self.serve_cfg, key)
        if most is not None and n > most:
            raise oa.APIError(400, f"n={n} is over the serving config's {key} ({most}); raise {key} to allow more",
                              param="n", code="over_configured_maximum")

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.serve_cfg.max_body_bytes:
            raise oa.APIError(413, f"request body is {declared} bytes, over the limit of {self.serve_cfg.max_body_bytes}",
                              code="request_too_large")
        return await request.body()

    async def _open(self, jobs: list[tuple[list[int], SamplingParams]]) -> tuple[Fanout, list[StreamChunk]]:
        """Submit every sequence of one request in one call (the engine admits them together); the
        engine's refusal is the request's error status, and so is an engine that fails before every
        choice's first chunk."""
        try:
            fan, refusal = await self.mux.open(jobs)
        except asyncio.TimeoutError:
            raise oa.APIError(503, f"the engine did not take the request within {CONTROL_TIMEOUT_S:.0f}s",
                              retry_after_s=1) from None
        except Exception as e:  # noqa: BLE001 — the engine replica is unreachable (restarting)
            raise oa.APIError(503, _stream_error(e)["error"]["message"], retry_after_s=1) from None
        if refusal is not None:
            _raise_reject(refusal)
        try:
            return fan, await fan.open()
        except Exception as e:  # noqa: BLE001 — the engine failed before the first tokens
            fan.close()
            raise oa.APIError(503, _stream_error(e)["error"]["message"], retry_after_s=1) from None
        except BaseException:
            fan.close()
            raise

    # ---- routes -------------------------------------------------------------------------------
    @api.get("/health", responses={**ok(out.Health), 503: {"model": out.Health}})
    async def health(self):
        try:
            h = await asyncio.wait_for(self.engine.health.remote(), timeout=3)  # inside a client's 5 s default
        except Exception as e:  # noqa: BLE001 — any failure to answer is "not ready"
            return JSONResponse({"status": "unavailable", "error": str(e)}, status_code=503)
        if not h["healthy"]:
            return JSONResponse({"status": "degraded", "error": h["error"]}, status_code=503)
        return {"status": "ok"}

    @api.get("/v1/models", responses={**ok(out.ModelList), **errors(401)})
    async def models(self, request: Request):
        self._auth(request)
        return oa.models_response([self.name], self.created, max_model_len=self.context)

    def _resolve(self, model: str | None) -> None:
        if model is not None:
            oa.resolve_model(model, [self.name])

    @api.post("/tokenize", openapi_extra=doc.body(oa.TokenizeCompletionRequest, oa.TokenizeChatRequest),
              responses={**ok(out.TokenizeResponse), **errors(400, 401, 404, 413)})
    async def tokenize(self, request: Request):
        """vLLM's: a prompt's or a conversation's token ids, as the generation routes would encode them."""
        self._auth(request)
        req = oa.parse_tokenize(await self._body(request), self.serve_cfg.max_body_bytes)
        self._resolve(req.model)
        ids = oa.tokenize_ids(req, self.tok)
        return oa.tokenize_response(ids, self.tok, max_model_len=self.context, token_strs=bool(req.return_token_strs))

    @api.post("/detokenize", openapi_extra=doc.body(oa.DetokenizeRequest),
              responses={**ok(out.DetokenizeResponse), **errors(400, 401, 404, 413)})
    async def detokenize(self, request: Request):
        """vLLM's: token ids back to text."""
        self._auth(request)
        req = oa.parse_request(oa.DetokenizeRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        self._resolve(req.model)
        return {"prompt": oa.detokenize_text(req, self.tok)}

    async def _ask_engine(self, call, what: str, *args):
        """A control call to the engine replica, bounded in time (503 rather than a hang)."""
        try:
            return await asyncio.wait_for(call.remote(*args), timeout=CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise oa.APIError(503, f"the engine did not answer {what} within {CONTROL_TIMEOUT_S:.0f}s",
                              retry_after_s=1) from None

    @api.get("/metrics", response_class=Response, responses={**ok_text(), **errors(401, 503)})
    async def metrics(self, request: Request):
        self._auth(request)
        text = await self._ask_engine(self.engine.metrics_text, "/metrics")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/status", responses={**ok(out.ClusterStatus), **errors(401, 503)})
    async def status(self, request: Request):
        self._auth(request)
        loading = load_progress()  # the engine replica is still in its constructor while actors load
        if still_loading(loading):
            return {"model": self.name, "loading": loading}
        return await self._ask_engine(self.engine.status, "/status")

    async def _admin(self, request: Request, kind: str, value: int | None):
        """An epoch change through the engine replica: its report, or the engine's refusal as an error."""
        try:
            out = await asyncio.wait_for(self.engine.change.remote(kind, value), timeout=ADMIN_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise oa.APIError(503, f"the {kind} change did not finish within {ADMIN_TIMEOUT_S:.0f}s",
                              retry_after_s=5) from None
        if not out["ok"]:
            raise oa.APIError(out["status"], out["error"], param="n" if kind != "rebalance" else "redundant_slots",
                              retry_after_s=5 if out["status"] == 503 else None)
        return out["change"]

    @api.post("/admin/scale/experts", openapi_extra=doc.body(ScaleRequest), responses=ADMIN_DOC)
    async def scale_experts(self, request: Request):
        self._auth_admin(request)
        body = oa.parse_request(ScaleRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        self._check_max("experts", body.n)
        return await self._admin(request, "experts", body.n)

    @api.post("/admin/scale/attention", openapi_extra=doc.body(ScaleRequest), responses=ADMIN_DOC)
    async def scale_attention(self, request: Request):
        self._auth_admin(request)
        body = oa.parse_request(ScaleRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        self._check_max("attention", body.n)
        return await self._admin(request, "attention", body.n)

    @api.post("/admin/rebalance", openapi_extra=doc.body(RebalanceRequest), responses=ADMIN_DOC)
    async def rebalance(self, request: Request):
        self._auth_admin(request)
        body = oa.parse_request(RebalanceRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        return await self._admin(request, "rebalance", body.redundant_slots)

    @api.post("/admin/chaos", openapi_extra=doc.body(ChaosRequest),
              responses={**errors(400, 401, 413, 503), **FORBIDDEN})
    async def chaos(self, request: Request):
        self._auth_admin(request)
        body = oa.parse_request(ChaosRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        out = await self._ask_engine(self.engine.chaos.options(), "the kill", body.kind, body.index)
        if not out["ok"]:
            raise oa.APIError(out["status"], out["error"], param="index")
        return out

    @api.get("/admin/experts", responses={**errors(401, 503), **FORBIDDEN})
    async def experts(self, request: Request):
        """The full token distribution over (MoE layer, logical expert), as JSON."""
        self._auth_admin(request)
        return await self._ask_engine(self.engine.experts, "/admin/experts")

    @api.post("/v1/completions", openapi_extra=doc.body(oa.CompletionRequest),
              responses={**ok(out.CompletionResponse, stream=True), **errors(400, 401, 404, 413, 503)})
    async def completions(self, request: Request):
        self._auth(request)
        req = oa.parse_request(oa.CompletionRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        oa.resolve_model(req.model, [self.name])
        prompts = oa.prompt_token_lists(req, self.tok)
        jobs = []
        for p_i, ids in enumerate(prompts):
            params = oa.sampling_params(req, prompt_len=len(ids), max_model_len=self.context,
                                        cache_tokens=self.cache_tokens, vocab_size=self.tok.vocab_size)
            jobs += [(p_i * req.n + j, ids, sp) for j, sp in enumerate(oa.choice_params(params, req.n))]
        return await self._respond(request, req, jobs, sum(len(p) for p in prompts), chat=False)

    @api.post("/v1/chat/completions", openapi_extra=doc.body(oa.ChatCompletionRequest),
              responses={**ok(out.ChatCompletionResponse, stream=True), **errors(400, 401, 404, 413, 503)})
    async def chat(self, request: Request):
        self._auth(request)
        req = oa.parse_request(oa.ChatCompletionRequest, await self._body(request), self.serve_cfg.max_body_bytes)
        oa.resolve_model(req.model, [self.name])
        plan = await asyncio.to_thread(plan_chat, req, self.tok)  # a new grammar is checked off the loop
        ids = plan.prompt_ids
        params = oa.sampling_params(req, prompt_len=len(ids), max_model_len=self.context,
                                    cache_tokens=self.cache_tokens, vocab_size=self.tok.vocab_size)
        params = replace(params, grammar=plan.grammar)
        jobs = [(j, ids, sp) for j, sp in enumerate(oa.choice_params(params, req.n))]
        return await self._respond(request, req, jobs, len(ids), chat=True, plan=plan)

    async def _respond(self, request: Request, req, jobs, prompt_tokens: int, chat: bool, plan: ChatPlan | None = None):
        fan, firsts = await self._open([(ids, sp) for _, ids, sp in jobs])
        choices = []
        for i, ((index, _, sp), first) in enumerate(zip(jobs, firsts)):
            stops = oa.StopStrings(req.stop_list, req.include_stop_str_in_output)
            out = None if plan is None else ChatOutput(self.tok, plan, stops, skip_special_tokens=sp.skip_special_tokens)
            choices.append(_Choice(index, fan.stream(i), first, stops, sp, out))
        n = getattr(req, "n", 1)
        prompts = {index // n: ids for index, ids, _ in jobs}  # the choices of one prompt share its cache hit
        cached = sum(max(c.cached_tokens for c in choices if c.index // n == p) for p in prompts)
        if req.stream:
            return StreamingResponse(self._sse(fan, choices, chat, prompt_tokens, req.include_usage, cached),
                                     media_type="text/event-stream")
        try:
            if not await _drain_while_connected(request, choices):
                return Response(status_code=499)  # nobody reads it: the client went away
        except Exception as e:  # noqa: BLE001 — the engine failed mid-request
            raise oa.APIError(503, _stream_error(e)["error"]["message"], retry_after_s=1) from None
        finally:  # done, failed, or the client went away (Serve cancels the handler): free every sequence
            fan.close()
        results = [c.result() for c in choices]
        tokens = oa.usage(prompt_tokens, sum(len(r.token_ids) for r in results), cached)
        if chat:
            body = oa.chat_response(self.name, results, tokens, tokenizer=self.tok)
        else:
            body = oa.completion_response(self.name, results, tokens, tokenizer=self.tok,
                                          skip_special_tokens=req.skip_special_tokens)
        if req.return_token_ids:  # vLLM's fields: chat's prompt ids on the response, a completion's per choice
            for choice, result in zip(body["choices"], results):
                choice["token_ids"] = list(result.token_ids)
                if not chat:
                    choice["prompt_token_ids"] = list(prompts[result.index // n])
            if chat:
                body["prompt_token_ids"] = list(prompts[0])
        return body

    async def _sse(self, fan: Fanout, choices: list, chat: bool, prompt_tokens: int, include_usage: bool,
                   cached_tokens: int = 0):
        rid, created = oa.new_request_id("chatcmpl" if chat else "cmpl"), int(time.time())
        try:
            async with contextlib.aclosing(_events(choices)) as events:
                async for item in events:
                    if isinstance(item, Exception):
                        yield oa.sse(_stream_error(item))
                        yield oa.SSE_DONE
                        return
                    for chunk in self._chunks(rid, created, chat, *item):
                        yield oa.sse(chunk)
            if include_usage:
                done = sum(len(c.token_ids) for c in choices)
                yield oa.sse(oa.usage_chunk(rid, self.name, created, oa.usage(prompt_tokens, done, cached_tokens),
                                                   chat=chat))
            yield oa.SSE_DONE
        finally:  # a client that went away cancels every choice, which frees its cache
            fan.close()

    def _chunks(self, rid, created, chat, choice, piece, sampled, finish) -> list[dict]:
        """The SSE chunks of one piece of a choice: a completion's text, or a chat choice's deltas (one
        chunk each, as OpenAI sends them: the logprobs ride on the first, the finish reason on the last)."""
        if chat:
            lp = oa.chat_logprobs(sampled, self.tok) if choice.want_logprobs and sampled else None
            if not piece and finish is None and lp is None and choice.role_sent:
                return []  # nothing to say yet (a call id or a split character held back)
            out = []
            for i, delta in enumerate(piece or [{}]):
                first = not choice.role_sent
                choice.role_sent = True
                out.append(oa.chat_chunk(rid, self.name, created, index=choice.index, first=first, delta=delta,
                                         finish_reason=finish if i == max(len(piece), 1) - 1 else None,
                                         logprobs=lp if i == 0 else None))
            return out
        return [self._completion_chunk(rid, created, choice, piece, sampled, finish)]

    def _completion_chunk(self, rid, created, choice, text, sampled, finish):
        lp = None
        if choice.want_logprobs and sampled:
            skip = choice.skip_special_tokens
            lp = oa.completion_logprobs(sampled, self.tok, text_offset=choice.text_offset, skip_special_tokens=skip)
            choice.text_offset += sum(oa.text_lengths(sampled, self.tok, skip_special_tokens=skip))
        return oa.completion_chunk(rid, self.name, created, index=choice.index, text=text, finish_reason=finish,
                                   logprobs=lp)


def build_app(args: dict):
    """`serve deploy` / `serve run deploy.app:build_app`: args are a :class:`ServeConfig`."""
    from model.presets import resolve_model

    from .settings import cache_root

    serve_cfg = ServeConfig.parse(args or {})
    path = str(resolve_model(serve_cfg.model, cache_root()).resolve())
    raw = serve_cfg.model_dump()
    return Ingress.bind(EngineServer.bind(raw, path), raw, path)
