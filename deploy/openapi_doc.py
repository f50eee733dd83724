"""The Ingress's OpenAPI document: each route's request body and responses, from the same pydantic
models the routes validate with and the builders produce.

The routes parse their JSON bodies themselves (:func:`deploy.openai_api.parse_request`: the body
limit before parsing, strict JSON, OpenAI's error envelope), so FastAPI never sees a body
parameter and never answers 422. This module declares those bodies instead: :meth:`OpenAPIDoc.body`
names a route's model in ``openapi_extra`` and the document's components get the model's own JSON
schema. :meth:`OpenAPIDoc.specialize` narrows the generation routes to what this server accepts
(its model names, vocabulary and context), so generated valid data is valid here.

Must never: validate requests (the routes do), read settings, or touch the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .openai_responses import AnthropicError, ErrorResponse

REF = "#/components/schemas/{model}"
ERRORS = {400: "Invalid request: a malformed body or a field out of its bounds.",
          401: "Missing or wrong API key.", 404: "Unknown model.", 413: "Request body over the limit.",
          503: "The engine cannot take the request now (Retry-After says when to retry)."}
OPEN = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # no API key
GENERATION = ("CompletionRequest", "ChatCompletionRequest")
NAMED = (*GENERATION, "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest")  # carry `model`


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries: OpenAI's error envelope for each status."""
    return {s: {"model": ErrorResponse, "description": ERRORS[s]} for s in statuses}


def anthropic_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries of the /v1/messages routes: Anthropic's error envelope for each status."""
    return {s: {"model": AnthropicError, "description": ERRORS[s]} for s in statuses}


def ok(model: type[BaseModel], *, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entry for 200: ``model`` as JSON, and server-sent events when ``stream``."""
    out: dict[str, Any] = {"model": model, "description": "Success."}
    if stream:
        out["content"] = {"text/event-stream": {"schema": {  # one event (Open API 3.1: schema is per event)
            "type": "object", "required": ["data"], "properties": {"data": {
                "type": "string", "description": "With stream=true: a chunk as JSON; the last event is [DONE]."}}}}}
    return {200: out}


def ok_text() -> dict[int | str, dict[str, Any]]:
    """``responses=`` entry for 200 of /metrics: Prometheus's text format."""
    return {200: {"description": "Prometheus text exposition format.",
                  "content": {"text/plain": {"schema": {"type": "string"}}}}}


class OpenAPIDoc:
    """Owns ``api.openapi``: FastAPI's document plus the request-body models named by :meth:`body`."""

    def __init__(self, api: FastAPI):
        self.api = api
        self.bodies: list[type[BaseModel]] = []
        self.served: dict[str, Any] | None = None
        api.openapi = self.document

    def body(self, *models: type[BaseModel]) -> dict[str, Any]:
        """``openapi_extra`` of a route whose JSON body is validated with ``model`` (or with one of
        ``models``, which the route tells apart)."""
        for model in models:
            if model not in self.bodies:
                self.bodies.append(model)
        refs = [{"$ref": REF.format(model=model.__name__)} for model in models]
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    def specialize(self, *, model_names: list[str], vocab_size: int, max_model_len: int, api_key: bool) -> None:
        """Narrow the document to this server (called by the Ingress replica that serves it)."""
        self.served = {"model_names": list(model_names), "vocab_size": vocab_size,
                       "max_model_len": max_model_len, "api_key": api_key}
        self.api.openapi_schema = None

    def document(self) -> dict[str, Any]:
        if self.api.openapi_schema is None:
            api = self.api
            doc = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
            _, defs = models_json_schema([(m, "validation") for m in self.bodies], ref_template=REF)
            components = doc.setdefault("components", {})
            components.setdefault("schemas", {}).update(defs.get("$defs", {}))
            if self.served is not None:
                self._narrow(doc)
            api.openapi_schema = doc
        return self.api.openapi_schema

    def _narrow(self, doc: dict[str, Any]) -> None:
        served, schemas = self.served, doc["components"]["schemas"]
        model = {"type": "string", "enum": served["model_names"], "title": "Model",
                 "description": "The served model's name (GET /v1/models)."}
        for name in NAMED:
            props = schemas[name]["properties"]
            props["model"] = dict(model) if name in GENERATION else {"anyOf": [model, {"type": "null"}]}
            for key in ("max_tokens", "max_completion_tokens"):
                if key in props:
                    _bound_integers(props[key], maximum=served["max_model_len"] - 1)
            for key in ("stop_token_ids", "tokens"):  # token ids
                if key in props:
                    _bound_integers(props[key], maximum=served["vocab_size"] - 1)
            if "logit_bias" in props:
                props["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"] = _below(served["vocab_size"])
        _bound_integers(schemas["CompletionRequest"]["properties"]["prompt"], maximum=served["vocab_size"] - 1)
        if served["api_key"]:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, ops in doc["paths"].items():
                if path not in OPEN:
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]


def _below(n: int) -> str:
    """A regex matching exactly the decimal numbers 0 .. n - 1, without leading zeros (n >= 1)."""
    top = str(n - 1)
    alts = [f"[1-9][0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else "[1-9]" if len(top) == 2 else None, "0"]
    for i, digit in enumerate(top):  # numbers of top's length, equal to it up to i, smaller at i
        rest = len(top) - i - 1
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            alts.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alts.append(top)
    return "^(" + "|".join(a for a in alts if a) + ")$"


def _bound_integers(schema: Any, *, maximum: int) -> None:
    """Give every integer schema under ``schema`` this ``maximum`` (token ids, token counts)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = min(schema.get("maximum", maximum), maximum)
        for value in schema.values():
            _bound_integers(value, maximum=maximum)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value, maximum=maximum)
