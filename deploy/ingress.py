"""The Ingress: the OpenAI-compatible HTTP front of one deployment.

A plain class; its routes are listed once (:data:`ROUTES`) and made into a FastAPI app by
:func:`make_api` — for Ray Serve (deploy/app.py) or bound to an instance in this process
(deploy/inprocess.py). It owns HTTP: auth (:class:`~deploy.access.Access`), body limits, OpenAI
parsing, tokenisation and chat templates, the request's limits (once: context and cache), and the
output — token ids from the engine become text, stop strings, tool calls and SSE here
(:class:`~deploy.output.ChoiceOutput`), never in the engine.
Never: touches the engine directly (every call goes through the engine handle, each with a
timeout), sends text or output options to the engine, or answers user input with a 500 — every
error leaves as OpenAI's envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.engine import EngineRequest
from cluster.progress import load_progress, still_loading
from model.config import load_config
from model.tokenizer import Tokenizer

from . import anthropic_api, responses_api
from . import openai_api as oa
from . import openai_responses as schemas
from .access import Access, ChaosRequest, RebalanceRequest, ScaleRequest
from .chat_turn import ChatPlan, plan_chat
from .config import ServeConfig
from .engine_server import ADMIN_TIMEOUT_S, CONTROL_TIMEOUT_S, Reject
from .fanout import Fanout
from .mux import StreamMux
from .openapi_doc import OpenAPIDoc, anthropic_errors, errors, ok, ok_text
from .output import ChoiceOutput, OutputOptions, Piece

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request asks whether its client is still there
FORBIDDEN = {403: {"model": schemas.ErrorResponse,
                   "description": "The admin routes are off: no admin key is configured."}}
ADMIN_DOC = {**ok(schemas.EpochChangeReport), **errors(400, 401, 413, 503), **FORBIDDEN}


class Ingress:
    def __init__(self, engine, raw: dict, model_path: str, *, admin_key: str | None = None):
        """``engine``: the engine server's handle (a Serve ``DeploymentHandle``, or
        :class:`~deploy.inprocess.LocalHandle`). ``raw``: a :class:`ServeConfig` as a dict.
        ``admin_key``: $MOERAY_ADMIN_KEY of this node (deploy/settings.py), if any."""
        self.serve_cfg = ServeConfig.parse(raw)
        self.own_address = None  # () -> (host, port) of this replica's own HTTP server, where it has one
        self.access = Access.of(self.serve_cfg, admin_key)
        self.engine = engine
        self.mux = StreamMux(engine, CONTROL_TIMEOUT_S)
        self.tok = Tokenizer.from_dir(model_path)
        self.context = served_context(self.serve_cfg, model_path)
        self.cache_tokens = self.serve_cfg.num_blocks * self.serve_cfg.block_size  # one replica's cache
        self.name = self.serve_cfg.name_for(Path(model_path))
        self.created = int(time.time())

    def __del__(self):  # Serve calls it at shutdown, on the replica's event loop
        self.mux.close()

    # ---- plumbing ---------------------------------------------------------------------------
    def _check_max(self, kind: str, n: int) -> None:
        """A scale beyond the serving config's maximum is refused here, before the engine is asked."""
        key = {"experts": "max_expert_actors", "workers": "max_expert_actors", "attention": "max_attention"}[kind]
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

    async def _parse(self, request: Request, model_cls):
        return oa.parse_request(model_cls, await self._body(request), self.serve_cfg.max_body_bytes)

    async def _open(self, requests: list[EngineRequest]) -> tuple[Fanout, list]:
        """Submit every sequence of one request in one call (the engine admits them together); the
        engine's refusal is the request's error status, and so is an engine that fails before every
        choice's first chunk."""
        try:
            fan, refusal = await self.mux.open(requests)
        except asyncio.TimeoutError:
            raise oa.APIError(503, f"the engine did not take the request within {CONTROL_TIMEOUT_S:.0f}s",
                              retry_after_s=1) from None
        except Exception as e:  # noqa: BLE001 — the engine replica is unreachable (restarting)
            raise oa.APIError(503, stream_error(e)["error"]["message"], retry_after_s=1) from None
        if refusal is not None:
            _raise_reject(refusal)
        try:
            return fan, await fan.open()
        except Exception as e:  # noqa: BLE001 — the engine failed before the first tokens
            fan.close()
            raise oa.APIError(503, stream_error(e)["error"]["message"], retry_after_s=1) from None
        except BaseException:
            fan.close()
            raise

    async def _ask_engine(self, call, what: str, *args, timeout_s: float = CONTROL_TIMEOUT_S):
        """A control call to the engine server, bounded in time (503 rather than a hang)."""
        try:
            return await asyncio.wait_for(call.remote(*args), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise oa.APIError(503, f"the engine did not answer {what} within {timeout_s:.0f}s",
                              retry_after_s=1 if timeout_s <= CONTROL_TIMEOUT_S else 5) from None

    # ---- routes: service --------------------------------------------------------------------
    async def health(self, request: Request):
        try:
            h = await asyncio.wait_for(self.engine.health.remote(), timeout=3)  # inside a client's 5 s default
        except Exception as e:  # noqa: BLE001 — any failure to answer is "not ready"
            return JSONResponse({"status": "unavailable", "error": str(e)}, status_code=503)
        if not h["healthy"]:
            return JSONResponse({"status": "degraded", "error": h["error"]}, status_code=503)
        # the HTTP server of this replica: its own under Serve's direct ingress (deploy/app.py), else the one
        # that answered
        server = (self.own_address and self.own_address()) or request.scope.get("server")
        return {"status": "ok", "server": f"{server[0]}:{server[1]}" if server else None}

    async def models(self, request: Request):
        self.access.check(request)
        return oa.models_response([self.name], self.created, max_model_len=self.context)

    async def tokenize(self, request: Request):
        """vLLM's: a prompt's or a conversation's token ids, as the generation routes would encode them."""
        self.access.check(request)
        req = oa.parse_tokenize(await self._body(request), self.serve_cfg.max_body_bytes)
        if req.model is not None:
            oa.resolve_model(req.model, [self.name])
        ids = oa.tokenize_ids(req, self.tok)
        return oa.tokenize_response(ids, self.tok, max_model_len=self.context, token_strs=bool(req.return_token_strs))

    async def detokenize(self, request: Request):
        """vLLM's: token ids back to text."""
        self.access.check(request)
        req = await self._parse(request, oa.DetokenizeRequest)
        if req.model is not None:
            oa.resolve_model(req.model, [self.name])
        return {"prompt": oa.detokenize_text(req, self.tok)}

    async def metrics(self, request: Request):
        self.access.check(request)
        text = await self._ask_engine(self.engine.metrics_text, "/metrics")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def status(self, request: Request):
        self.access.check(request)
        loading = load_progress()  # the engine server is still in its constructor while actors load
        if still_loading(loading):
            return {"model": self.name, "loading": loading}
        return await self._ask_engine(self.engine.status, "/status")

    # ---- routes: admin ----------------------------------------------------------------------
    async def _admin(self, kind: str, value: int | None):
        """An epoch change through the engine server: its report, or the engine's refusal as an error."""
        out = await self._ask_engine(self.engine.change, f"the {kind} change", kind, value, timeout_s=ADMIN_TIMEOUT_S)
        if not out["ok"]:
            raise oa.APIError(out["status"], out["error"], param="n" if kind != "rebalance" else "redundant_slots",
                              retry_after_s=5 if out["status"] == 503 else None)
        return out["change"]

    async def scale_experts(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ScaleRequest)
        self._check_max("experts", body.n)
        return await self._admin("experts", body.n)

    async def scale_attention(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ScaleRequest)
        self._check_max("attention", body.n)
        return await self._admin("attention", body.n)

    async def scale_workers(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ScaleRequest)
        self._check_max("workers", body.n)
        return await self._admin("workers", body.n)

    async def rebalance(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, RebalanceRequest)
        return await self._admin("rebalance", body.redundant_slots)

    async def chaos(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ChaosRequest)
        out = await self._ask_engine(self.engine.chaos.options(), "the kill", body.kind, body.index)
        if not out["ok"]:
            raise oa.APIError(out["status"], out["error"], param="index")
        return out

    async def experts(self, request: Request):
        """The full token distribution over (MoE layer, logical expert), as JSON."""
        self.access.check_admin(request)
        return await self._ask_engine(self.engine.experts, "/admin/experts")

    # ---- routes: generation -------------------------------------------------------------------
    async def completions(self, request: Request):
        self.access.check(request)
        req = await self._parse(request, oa.CompletionRequest)
        oa.resolve_model(req.model, [self.name])
        prompts = oa.prompt_token_lists(req, self.tok)
        turn = _Turn(req, chat=False, prompts=prompts)
        for ids in prompts:
            params = oa.sampling_params(req, prompt_len=len(ids), max_model_len=self.context,
                                        cache_tokens=self.cache_tokens, vocab_size=self.tok.vocab_size)
            turn.requests += [EngineRequest(tuple(ids), sp, req.cache_salt) for sp in oa.choice_params(params, req.n)]
        return await self._respond(request, turn)

    async def chat(self, request: Request):
        self.access.check(request)
        req = await self._parse(request, oa.ChatCompletionRequest)
        oa.resolve_model(req.model, [self.name])
        return await self._respond(request, await self._chat_turn(req))

    async def _chat_turn(self, req: oa.ChatCompletionRequest) -> "_Turn":
        """A chat request planned (template, grammar, parser) and made into engine requests: what every
        front door (chat, Messages, Responses) serves."""
        plan = await asyncio.to_thread(plan_chat, req, self.tok, self.serve_cfg.json_whitespace)  # off the loop
        ids = plan.prompt_ids
        params = oa.sampling_params(req, prompt_len=len(ids), max_model_len=self.context,
                                    cache_tokens=self.cache_tokens, vocab_size=self.tok.vocab_size)
        params = replace(params, grammar=plan.grammar)
        turn = _Turn(req, chat=True, prompts=[ids], plan=plan)
        turn.requests = [EngineRequest(tuple(ids), sp, req.cache_salt) for sp in oa.choice_params(params, req.n)]
        return turn

    # ---- routes: the Anthropic and Responses front doors ----------------------------------------
    async def messages(self, request: Request):
        """Anthropic's Messages API over the chat pipeline (deploy/anthropic_api.py)."""
        self.access.check(request)
        req = anthropic_api.parse(await self._body(request), self.serve_cfg.max_body_bytes)
        oa.resolve_model(req.model, [self.name])
        turn = await self._chat_turn(anthropic_api.chat_request(req, self.name))
        render = anthropic_api.MessageStream(self.name, turn.prompt_tokens)
        return await self._render(request, turn, render, anthropic_api.sse, req.stream,
                                  lambda out: render.finish(out.finish_reason, out.stop_string, len(out.token_ids)),
                                  lambda: render.message(), lambda e: ("error", anthropic_api.error_body(
                                      503, stream_error(e)["error"]["message"])))

    async def count_tokens(self, request: Request):
        """Anthropic's token count: the prompt /v1/messages would give the model."""
        self.access.check(request)
        req = anthropic_api.parse(await self._body(request), self.serve_cfg.max_body_bytes, count=True)
        oa.resolve_model(req.model, [self.name])
        chat = anthropic_api.chat_request(req, self.name)
        return {"input_tokens": len(await asyncio.to_thread(oa.chat_prompt_ids, chat, self.tok))}

    async def responses(self, request: Request):
        """OpenAI's Responses API over the chat pipeline (deploy/responses_api.py)."""
        self.access.check(request)
        req = responses_api.parse(await self._body(request), self.serve_cfg.max_body_bytes)
        oa.resolve_model(req.model, [self.name])
        history: list[dict] = []
        if req.previous_response_id is not None:
            history = await self._ask_engine(self.engine.recall_response, "the stored response",
                                             req.previous_response_id)
            if history is None:
                raise oa.APIError(400, f"previous_response_id: no stored response {req.previous_response_id!r} "
                                       "(never stored, expired or evicted)", param="previous_response_id")
        chat, conversation = responses_api.chat_request(req, self.name, history)
        turn = await self._chat_turn(chat)
        render = responses_api.ResponseStream(req, self.name, turn.prompt_tokens)

        async def store():  # before the answer ends, so that the client's next turn finds it
            if req.store:
                await self._ask_engine(self.engine.store_response, "storing the response", render.id,
                                       conversation + render.conversation_tail())

        return await self._render(request, turn, render, responses_api.sse, req.stream,
                                  lambda out: render.finish(out.finish_reason, len(out.token_ids), out.cached_tokens),
                                  lambda: render.response(), lambda e: ("error", {
                                      "type": "error", "sequence_number": 0, "code": "engine_failed",
                                      "message": stream_error(e)["error"]["message"], "param": None}), store)

    async def _render(self, request: Request, turn: "_Turn", render, sse, stream: bool, finish, whole, failed,
                      before_end=None):
        """One choice through a front door's renderer: ``render.feed`` the output processor's deltas
        into events, ``finish(output)`` the closing events (after ``await before_end()``, if given),
        ``whole()`` the non-streamed body (the same events assembled), ``failed(error)`` the event that
        ends a stream whose engine failed."""
        fan, firsts = await self._open(turn.requests)
        choice = _Choice(ChoiceOutput(self.tok, 0, turn.options, chat=True, plan=turn.plan), fan.stream(0), firsts[0])
        start = render.start(firsts[0].cached_tokens)

        async def events():
            try:
                for e in start:
                    yield e
                async for piece in choice.pieces():
                    for e in render.feed(piece.deltas):
                        yield e
                    if piece.finish_reason is not None:
                        closing = finish(choice.out)
                        if before_end is not None:
                            await before_end()
                        for e in closing:
                            yield e
            finally:
                fan.close()

        if stream:
            async def body():
                try:
                    async for name, data in events():
                        yield sse(name, data)
                except Exception as e:  # noqa: BLE001 — the engine failed mid-stream: an error event, not a hang
                    yield sse(*failed(e))
            return StreamingResponse(body(), media_type="text/event-stream")
        try:
            gen = events()
            drain = asyncio.ensure_future(_consume(gen))
            if not await _wait_while_connected(request, drain):
                return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 — the engine failed mid-request
            raise oa.APIError(503, stream_error(e)["error"]["message"], retry_after_s=1) from None
        finally:
            fan.close()
        return whole()


    async def _respond(self, request: Request, turn: "_Turn"):
        fan, firsts = await self._open(turn.requests)
        choices = [_Choice(ChoiceOutput(self.tok, i, turn.options, chat=turn.chat, plan=turn.plan), fan.stream(i),
                           first) for i, first in enumerate(firsts)]
        n = turn.n
        # the choices of one prompt share its cache hit
        cached = sum(max(c.first.cached_tokens for c in choices[p * n:(p + 1) * n]) for p in range(len(turn.prompts)))
        if turn.req.stream:
            return StreamingResponse(self._sse(fan, choices, turn, cached), media_type="text/event-stream")
        try:
            if not await _drain_while_connected(request, choices):
                return Response(status_code=499)  # nobody reads it: the client went away
        except Exception as e:  # noqa: BLE001 — the engine failed mid-request
            raise oa.APIError(503, stream_error(e)["error"]["message"], retry_after_s=1) from None
        finally:  # done, failed, or the client went away (Serve cancels the handler): free every sequence
            fan.close()
        return self._whole(turn, [c.out.result() for c in choices], cached)

    def _whole(self, turn: "_Turn", results: list, cached: int) -> dict:
        """The non-streamed answer: every choice's output, assembled."""
        tokens = oa.usage(turn.prompt_tokens, sum(len(r.token_ids) for r in results), cached)
        if turn.chat:
            body = oa.chat_response(self.name, results, tokens, tokenizer=self.tok)
        else:
            body = oa.completion_response(self.name, results, tokens, tokenizer=self.tok,
                                          skip_special_tokens=turn.req.skip_special_tokens)
        if turn.req.return_token_ids:  # vLLM's fields: chat's prompt ids on the response, a completion's per choice
            for choice, result in zip(body["choices"], results):
                choice["token_ids"] = list(result.token_ids)
                if not turn.chat:
                    choice["prompt_token_ids"] = list(turn.prompts[result.index // turn.n])
            if turn.chat:
                body["prompt_token_ids"] = list(turn.prompts[0])
        return body

    async def _sse(self, fan: Fanout, choices: list["_Choice"], turn: "_Turn", cached_tokens: int):
        rid, created = oa.new_request_id("chatcmpl" if turn.chat else "cmpl"), int(time.time())
        try:
            async with contextlib.aclosing(_events(choices)) as events:
                async for item in events:
                    if isinstance(item, Exception):
                        yield oa.sse(stream_error(item))
                        yield oa.SSE_DONE
                        return
                    choice, piece = item
                    for chunk in self._chunks(rid, created, turn.chat, choice, piece):
                        yield oa.sse(chunk)
            if turn.req.include_usage:
                done = sum(len(c.out.token_ids) for c in choices)
                yield oa.sse(oa.usage_chunk(rid, self.name, created, oa.usage(turn.prompt_tokens, done, cached_tokens),
                                            chat=turn.chat))
            yield oa.SSE_DONE
        finally:  # a client that went away cancels every choice, which frees its cache
            fan.close()

    def _chunks(self, rid: str, created: int, chat: bool, choice: "_Choice", piece: Piece) -> list[dict]:
        """The SSE chunks of one piece: a completion's text, or a chat choice's deltas (one chunk
        each, as OpenAI sends them: the logprobs ride on the first, the finish reason on the last)."""
        index = choice.out.index
        if not chat:
            return [oa.completion_chunk(rid, self.name, created, index=index, text=piece.text,
                                        finish_reason=piece.finish_reason, logprobs=piece.logprobs)]
        if not piece.deltas and piece.finish_reason is None and piece.logprobs is None and choice.role_sent:
            return []  # nothing to say yet (a call id or a split character held back)
        out = []
        deltas = piece.deltas or ({},)
        for i, delta in enumerate(deltas):
            first, choice.role_sent = not choice.role_sent, True
            out.append(oa.chat_chunk(rid, self.name, created, index=index, first=first, delta=delta,
                                     finish_reason=piece.finish_reason if i == len(deltas) - 1 else None,
                                     logprobs=piece.logprobs if i == 0 else None))
        return out


@dataclass
class _Turn:
    """One generation request as the Ingress serves it: the parsed request, its prompts, the engine
    requests (``n`` per prompt, in order) and the output options only the Ingress uses."""

    req: Any
    chat: bool
    prompts: list[list[int]]
    plan: ChatPlan | None = None
    requests: list[EngineRequest] = field(default_factory=list)

    @property
    def n(self) -> int:
        return getattr(self.req, "n", 1)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def options(self) -> OutputOptions:
        req = self.req
        return OutputOptions(stop=tuple(req.stop_list), include_stop_str_in_output=req.include_stop_str_in_output,
                             skip_special_tokens=req.skip_special_tokens,
                             logprobs=(req.logprobs is not False and req.logprobs is not None))


class _Choice:
    """One choice's stream from the engine through its output processor."""

    def __init__(self, out: ChoiceOutput, gen, first):
        self.out, self.gen, self.first = out, gen, first
        self.role_sent = False  # a chat choice's first SSE chunk carries the role

    async def pieces(self):
        """The choice's pieces until it ends (a stop string stops its sequence in the engine)."""
        chunk = self.first
        while True:
            piece, stopped = self.out.push(chunk)
            if stopped:
                self.gen.cancel()
            yield piece
            if piece.finish_reason is not None:
                return
            chunk = await self.gen.__anext__()

    async def drain(self) -> None:
        async for _ in self.pieces():
            pass

    async def pump(self, queue: asyncio.Queue) -> None:
        try:
            async for piece in self.pieces():
                await queue.put((self, piece))
        except Exception as e:  # noqa: BLE001 — the engine failed mid-stream: an error event, not a hang
            await queue.put(e)
        finally:
            await queue.put(None)


async def _events(choices: list[_Choice]):
    """Every choice's ``(choice, piece)`` as they come, or the exception that ended them. One choice
    is read directly; several are pumped into one queue."""
    if len(choices) == 1:
        c = choices[0]
        try:
            async for piece in c.pieces():
                yield c, piece
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


async def _consume(gen) -> None:
    async for _ in gen:
        pass


async def _wait_while_connected(request: Request, task: asyncio.Future) -> bool:
    """Wait for ``task``; False as soon as the client is found gone (the task is then cancelled)."""
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return False
        task.result()
        return True
    finally:
        if not task.done():
            task.cancel()


async def _drain_while_connected(request: Request, choices: list[_Choice]) -> bool:
    """Read every choice to its end; False as soon as the client is found gone (the caller frees the
    sequences). Serve cancels a handler whose client went away; the poll covers servers that do not."""
    return await _wait_while_connected(request, asyncio.ensure_future(asyncio.gather(*(c.drain() for c in choices))))


def _raise_reject(first: Reject):
    raise oa.APIError(first.status, first.message, param=first.param,
                      retry_after_s=1 if first.status == 503 else None)


def stream_error(err: BaseException) -> dict:
    """The error event that ends a stream whose engine failed (OpenAI's envelope, status 503)."""
    cause = getattr(err, "cause", None)  # a Ray task error: the engine server's own error
    if isinstance(cause, BaseException):
        err = cause
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return oa.error_body(503, f"the request failed while generating ({type(err).__name__}: {first}); "
                              "retry it", code="engine_failed")


def served_context(serve_cfg: ServeConfig, model_path: str) -> int:
    """The context served: the model's, or the serving config's max_model_len if smaller."""
    ctx = load_config(model_path).max_position_embeddings
    return min(ctx, serve_cfg.max_model_len or ctx)


# ---- the routes, declared once -----------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    method: str
    path: str
    name: str  # the Ingress method that serves it
    responses: dict
    bodies: tuple = ()  # the request body models (the route parses them itself: OpenAPIDoc declares them)
    text: bool = False  # a plain-text response (/metrics)


ROUTES = (
    Route("GET", "/health", "health", {**ok(schemas.Health), 503: {"model": schemas.Health}}),
    Route("GET", "/v1/models", "models", {**ok(schemas.ModelList), **errors(401)}),
    Route("POST", "/tokenize", "tokenize", {**ok(schemas.TokenizeResponse), **errors(400, 401, 404, 413)},
          (oa.TokenizeCompletionRequest, oa.TokenizeChatRequest)),
    Route("POST", "/detokenize", "detokenize", {**ok(schemas.DetokenizeResponse), **errors(400, 401, 404, 413)},
          (oa.DetokenizeRequest,)),
    Route("GET", "/metrics", "metrics", {**ok_text(), **errors(401, 503)}, text=True),
    Route("GET", "/status", "status", {**ok(schemas.ClusterStatus), **errors(401, 503)}),
    Route("POST", "/admin/scale/experts", "scale_experts", ADMIN_DOC, (ScaleRequest,)),
    Route("POST", "/admin/scale/attention", "scale_attention", ADMIN_DOC, (ScaleRequest,)),
    Route("POST", "/admin/scale/workers", "scale_workers", ADMIN_DOC, (ScaleRequest,)),
    Route("POST", "/admin/rebalance", "rebalance", ADMIN_DOC, (RebalanceRequest,)),
    Route("POST", "/admin/chaos", "chaos", {**errors(400, 401, 413, 503), **FORBIDDEN}, (ChaosRequest,)),
    Route("GET", "/admin/experts", "experts", {**errors(401, 503), **FORBIDDEN}),
    Route("POST", "/v1/completions", "completions",
          {**ok(schemas.CompletionResponse, stream=True), **errors(400, 401, 404, 413, 503)}, (oa.CompletionRequest,)),
    Route("POST", "/v1/chat/completions", "chat",
          {**ok(schemas.ChatCompletionResponse, stream=True), **errors(400, 401, 404, 413, 503)},
          (oa.ChatCompletionRequest,)),
    Route("POST", "/v1/responses", "responses", {**ok(schemas.ResponseObject, stream=True),
                                                  **errors(400, 401, 404, 413, 503)}, (responses_api.ResponsesRequest,)),
    Route("POST", "/v1/messages", "messages", {**ok(schemas.AnthropicMessage, stream=True),
                                               **anthropic_errors(400, 401, 404, 413, 503)},
          (anthropic_api.MessagesRequest,)),
    Route("POST", "/v1/messages/count_tokens", "count_tokens", {**ok(schemas.AnthropicTokenCount),
                                                                **anthropic_errors(400, 401, 404, 413)},
          (anthropic_api.CountTokensRequest,)),
)
API_ROUTES = tuple(f"{r.method} {r.path}" for r in ROUTES if not r.path.startswith("/admin"))


def make_api(endpoint: Callable[[str], Callable]) -> tuple[FastAPI, OpenAPIDoc]:
    """The FastAPI app of :data:`ROUTES`: each route served by ``endpoint(route.name)`` — the Ingress
    class's method (for Serve, which binds each replica's instance) or an instance's bound method
    (in this process). Every error leaves as OpenAI's envelope; returns the app and its OpenAPI
    document (``specialize`` it to the served model)."""
    api = FastAPI(title="moeray", description="OpenAI-compatible serving of MoE models on Ray")
    doc = OpenAPIDoc(api)
    for r in ROUTES:
        extra = {"openapi_extra": doc.body(*r.bodies)} if r.bodies else {}
        if r.text:
            extra["response_class"] = Response
        api.add_api_route(r.path, endpoint(r.name), methods=[r.method], responses=r.responses, **extra)
    _install_error_handlers(api)
    return api, doc


def specialize(doc: OpenAPIDoc, serve_cfg: ServeConfig, model_path: str) -> None:
    """Narrow the OpenAPI document to the model this deployment serves."""
    doc.specialize(model_names=[serve_cfg.name_for(Path(model_path))],
                   vocab_size=Tokenizer.from_dir(model_path).vocab_size,
                   max_model_len=served_context(serve_cfg, model_path),
                   api_key=bool(serve_cfg.api_key or serve_cfg.api_keys or serve_cfg.api_keys_file))


def _anthropic(request: Request) -> bool:
    """A Messages API route: its errors leave in Anthropic's envelope."""
    return "/v1/messages" in request.url.path


def _error(request: Request, err: oa.APIError) -> JSONResponse:
    body = anthropic_api.error_body(err.status, err.message) if _anthropic(request) else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):  # unknown route, wrong method
        message = str(err.detail)
        if err.status_code == 404 and "endpoint" not in request.scope:
            message = f"no route {request.method} {request.url.path}; this server serves {', '.join(API_ROUTES)}"
        return _error(request, oa.APIError(err.status_code, message))

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):  # never FastAPI's 422
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        return _error(request, oa.APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}"))

    @api.exception_handler(oa.APIError)
    async def _api_error(request: Request, err: oa.APIError):
        return _error(request, err)

    @api.exception_handler(Exception)
    async def _server_error(request: Request, err: Exception):
        return _error(request, oa.APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error"))
