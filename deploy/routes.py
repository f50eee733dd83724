"""The HTTP face of the Ingress: every route declared once (:data:`ROUTES`, each naming the
:class:`~deploy.ingress.Ingress` method that serves it and what the OpenAPI document says of it),
made into a FastAPI app by :func:`make_api`, and the one place errors become responses: each in
its API's envelope (Anthropic's on the Messages routes, OpenAI's elsewhere), never FastAPI's 422
nor a bare 500.

Never: serves a request itself (the Ingress does), or names ``serve`` (deploy/app.py wraps the app
for Ray Serve, deploy/inprocess.py serves it in one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.tokenizer import Tokenizer

from . import anthropic_api, responses_api
from . import openai_api as oa
from . import openai_responses as schemas
from .access import ChaosRequest, RebalanceRequest, ScaleRequest
from .config import ServeConfig
from .ingress import served_context
from .openapi_doc import OpenAPIDoc, anthropic_errors, errors, ok, ok_text

FORBIDDEN = {403: {"model": schemas.ErrorResponse,
                   "description": "The admin routes are off: no admin key is configured."}}
ADMIN_DOC = {**ok(schemas.EpochChangeReport), **errors(400, 401, 413, 503), **FORBIDDEN}


@dataclass(frozen=True)
class Route:
    """One route: ``method`` ``path`` served by the Ingress method ``name``; ``responses`` as the
    OpenAPI document gives them."""

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
