"""The Ingress: the HTTP front of one deployment (OpenAI's Completions, Chat Completions and Responses,
Anthropic's Messages).

A plain class; its routes are listed once (:data:`deploy.routes.ROUTES`) and made into a FastAPI app
by :func:`deploy.routes.make_api` — for Ray Serve (deploy/app.py) or bound to an instance in this
process (deploy/inprocess.py). It owns HTTP: auth (:class:`~deploy.access.Access`), body limits,
parsing, tokenisation and chat templates, the request's limits (once: context and cache), and the
output — token ids from the engine become text, stop strings and tool calls here
(:class:`~deploy.output.ChoiceOutput`), never in the engine. Every front door's answer takes one
path (:meth:`Ingress._serve`, deploy/answer.py): the output processor's pieces go to the API's
renderer, which makes the stream's events and, from the same events, the whole answer.
Never: touches the engine directly (every call goes through the engine handle, each with a
timeout), sends text or output options to the engine, or answers user input with a 500 — every
error leaves in the API's envelope.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cluster.stream import EngineRequest
from cluster.progress import load_progress, still_loading
from model.config import load_config
from model.tokenizer import Tokenizer

from . import anthropic_api, responses_api
from . import openai_api as oa
from .access import Access, ChaosRequest, RebalanceRequest, ScaleRequest
from .answer import Choice, Renderer, answer, failure_message
from .chat_turn import ChatPlan, plan_chat
from .config import ServeConfig
from .engine_server import ADMIN_TIMEOUT_S, CONTROL_TIMEOUT_S, Reject
from .fanout import Fanout
from .mux import StreamMux
from .output import ChoiceOutput, OutputOptions


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
            raise oa.APIError(503, failure_message(e), retry_after_s=1) from None
        if refusal is not None:
            _raise_reject(refusal)
        try:
            return fan, await fan.open()
        except Exception as e:  # noqa: BLE001 — the engine failed before the first tokens
            fan.close()
            raise oa.APIError(503, failure_message(e), retry_after_s=1) from None
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
    async def _admin(self, kind: str, value: int | None, engine: str = "decode"):
        """An epoch change through the engine server: its report, or the engine's refusal as an error."""
        out = await self._ask_engine(self.engine.change, f"the {kind} change", kind, value, engine,
                                     timeout_s=ADMIN_TIMEOUT_S)
        if not out["ok"]:
            raise oa.APIError(out["status"], out["error"], param="n" if kind != "rebalance" else "redundant_slots",
                              retry_after_s=5 if out["status"] == 503 else None)
        return out["change"]

    async def scale_experts(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ScaleRequest)
        self._check_max("experts", body.n)
        return await self._admin("experts", body.n, body.engine)

    async def scale_attention(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ScaleRequest)
        self._check_max("attention", body.n)
        return await self._admin("attention", body.n, body.engine)

    async def scale_workers(self, request: Request):
        self.access.check_admin(request)
        body = await self._parse(request, ScaleRequest)
        self._check_max("workers", body.n)
        return await self._admin("workers", body.n, body.engine)

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
        return await self._serve(request, turn, oa.CompletionStream(self.name, req, prompts))

    async def chat(self, request: Request):
        self.access.check(request)
        req = await self._parse(request, oa.ChatCompletionRequest)
        oa.resolve_model(req.model, [self.name])
        turn = await self._chat_turn(req)
        return await self._serve(request, turn, oa.ChatStream(self.name, req, turn.prompts))

    async def _chat_turn(self, req: oa.ChatCompletionRequest) -> "_Turn":
        """A chat request planned (template, grammar, parser) and made into engine requests: what every
        chat front door (chat, Messages, Responses) serves."""
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
        return await self._serve(request, turn, anthropic_api.MessageStream(self.name, turn.prompt_tokens))

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
            await self._ask_engine(self.engine.store_response, "storing the response", render.id,
                                   conversation + render.conversation_tail())

        return await self._serve(request, turn, render, before_end=store if req.store else None)

    # ---- the one response path ------------------------------------------------------------------
    async def _serve(self, request: Request, turn: "_Turn", renderer: Renderer,
                     before_end: Callable[[], Awaitable[None]] | None = None):
        """Every front door's answer: the turn's choices, each through its output processor, into
        ``renderer`` (:func:`deploy.answer.answer`); ``before_end`` is awaited before the closing events."""
        fan, firsts = await self._open(turn.requests)
        choices = [Choice(ChoiceOutput(self.tok, i, turn.options, chat=turn.chat, plan=turn.plan), fan.stream(i),
                          first) for i, first in enumerate(firsts)]
        n = turn.n
        # the choices of one prompt share its cache hit
        cached = sum(max(c.first.cached_tokens for c in choices[p * n:(p + 1) * n]) for p in range(len(turn.prompts)))
        return await answer(request, fan, choices, renderer, stream=turn.req.stream, cached_tokens=cached,
                            before_end=before_end)


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


def _raise_reject(first: Reject):
    raise oa.APIError(first.status, first.message, param=first.param,
                      retry_after_s=1 if first.status == 503 else None)


def served_context(serve_cfg: ServeConfig, model_path: str) -> int:
    """The context served: the model's, or the serving config's max_model_len if smaller."""
    ctx = load_config(model_path).max_position_embeddings
    return min(ctx, serve_cfg.max_model_len or ctx)
