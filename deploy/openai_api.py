"""The OpenAI protocol between HTTP bytes and the engine: errors in OpenAI's envelope, request
parsing, request → :class:`SamplingParams`, prompts → token ids, response / SSE chunk builders,
and the two renderers of OpenAI answers (:class:`CompletionStream`, :class:`ChatStream`: the output
processor's pieces → chunks, or the whole body).

Pure protocol: no Ray, no engine, no FastAPI app. deploy/routes.py owns the one exception handler
that turns :class:`APIError` into a response (``err.status``, ``err.body()``, ``err.headers``).
Nothing here may raise anything but :class:`APIError` for user input: a 500 is never the answer to
a bad request. Text (stop strings, logprobs' shape) is the output processor's (deploy/output.py).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import replace
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from deploy.openai_models import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                  TokenizeCompletionRequest)
from model.chat_template import check_template_kwargs
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

__all__ = [
    "APIError", "error_body", "from_validation_error", "parse_request", "resolve_model",
    "sampling_params", "choice_params", "prompt_token_lists", "chat_prompt_ids", "usage", "new_request_id",
    "completion_response", "chat_response", "completion_chunk", "chat_chunk", "usage_chunk", "CompletionStream",
    "ChatStream", "models_response", "sse", "SSE_DONE", "CompletionRequest", "ChatCompletionRequest",
    "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest", "parse_tokenize", "tokenize_ids",
    "tokenize_response", "detokenize_text",
]

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 503: "service_unavailable"}
SSE_DONE = "data: [DONE]\n\n"
M = TypeVar("M", bound=BaseModel)


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An HTTP error in OpenAI's shape. ``retry_after_s`` (503) becomes a Retry-After header."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type, self.param, self.code)

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``; ``type`` defaults from the status."""
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def _loc_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def from_validation_error(err: ValidationError) -> APIError:
    """400 naming the first failing field's path and what is wrong; ``param`` is the top-level field."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    path = _loc_path(loc)
    if first["type"] == "extra_forbidden":
        message = f"unknown field {path!r}: it is not part of this API"
    elif first["type"] == "missing":
        message = f"{path}: field required"
    else:
        why = first["msg"].removeprefix("Value error, ")
        message = f"{path}: {why} (got {first.get('input')!r:.80})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    param = loc[0] if loc and isinstance(loc[0], str) else None
    return APIError(400, message, param=param)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_request(model_cls: type[M], raw: bytes, max_body_bytes: int) -> M:
    """Body bytes → a validated request; 413 over ``max_body_bytes``, 400 for anything malformed."""
    return _validate(model_cls, _json_object(raw, max_body_bytes))


def parse_tokenize(raw: bytes, max_body_bytes: int) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """POST /tokenize's body: with ``messages`` a chat request, else a prompt (vLLM's two forms)."""
    obj = _json_object(raw, max_body_bytes)
    return _validate(TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest, obj)


def _json_object(raw: bytes, max_body_bytes: int) -> dict:
    if len(raw) > max_body_bytes:
        raise APIError(413, f"request body is {len(raw)} bytes, over the limit of {max_body_bytes}",
                       code="request_too_large")
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints, deep nesting
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be a JSON object, got a JSON {type(obj).__name__}",
                       code="invalid_json")
    return obj


def _validate(model_cls: type[M], obj: dict) -> M:
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def resolve_model(requested: str, served: list[str]) -> str:
    if requested not in served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")
    return requested


# ---------------------------------------------------------------- request → engine


def _check_ids(ids, vocab_size: int | None, param: str) -> None:
    for t in ids if vocab_size is not None else ():
        if not 0 <= t < vocab_size:
            raise APIError(400, f"{param}: token id {t} is outside the vocabulary [0, {vocab_size})", param=param)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, stop_token_ids: tuple[int, ...] = (),
                    prompt_len: int | None = None, max_model_len: int | None = None,
                    cache_tokens: int | None = None, vocab_size: int | None = None) -> SamplingParams:
    """The request's sampling parameters for one prompt. With ``prompt_len`` and ``max_model_len``
    an unset max_tokens becomes the largest that fits both the rest of the context and, when
    ``cache_tokens`` (one replica's cache) is given, the rest of the cache — as vLLM caps it by
    its max_model_len; a prompt plus max_tokens over the context is a 400 (code
    ``context_length_exceeded``). With ``vocab_size`` the token ids of ``logit_bias`` and
    ``stop_token_ids`` must be inside the vocabulary (400 naming the field). ``stop_token_ids``
    (the caller's) and the request's are both stop ids."""
    bias = tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items()))
    _check_ids((t for t, _ in bias), vocab_size, "logit_bias")
    _check_ids(req.stop_token_ids or (), vocab_size, "stop_token_ids")
    stops = tuple(dict.fromkeys((*stop_token_ids, *(req.stop_token_ids or ()))))
    chat = isinstance(req, ChatCompletionRequest)
    max_tokens = req.max_output_tokens if chat else req.max_tokens
    max_param = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    if prompt_len is not None and max_model_len is not None:
        room = max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt is {prompt_len} tokens, which leaves no room in this model's "
                                f"context of {max_model_len} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room if cache_tokens is None else min(room, cache_tokens - prompt_len)
            if max_tokens < 1:
                raise APIError(400, f"the prompt is {prompt_len} tokens, which leaves no room in one replica's "
                                    f"cache of {cache_tokens} tokens", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
        elif max_tokens > room:
            raise APIError(400, f"the prompt ({prompt_len} tokens) plus {max_param} ({max_tokens}) is over this "
                                f"model's context length of {max_model_len} tokens", param=max_param,
                           code="context_length_exceeded")
    if chat:
        logprobs = (0 if req.top_logprobs is None else req.top_logprobs) if req.logprobs else None
    else:
        logprobs = req.logprobs
    try:
        return SamplingParams(max_tokens=16 if max_tokens is None else max_tokens,
                              temperature=float(req.temperature), top_p=float(req.top_p),
                              top_k=max(req.top_k, 0), seed=req.seed, stop_token_ids=stops,
                              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                              presence_penalty=float(req.presence_penalty or 0.0),
                              frequency_penalty=float(req.frequency_penalty or 0.0),
                              repetition_penalty=float(1.0 if req.repetition_penalty is None else req.repetition_penalty),
                              min_p=float(req.min_p or 0.0), logit_bias=bias)
    except ValueError as e:
        found = re.search(r"sampling parameter '(\w+)'", str(e))
        param = found.group(1) if found else None
        if param == "logprobs" and chat:
            param = "top_logprobs"
        elif param == "max_tokens":
            param = max_param
        raise APIError(400, str(e), param=param) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One params per choice. Seeded choice i uses ``seed + i``: the n choices differ, and the
    same request reproduces them all."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]


def prompt_token_lists(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """The completion request's prompts as token ids, each id checked against the vocabulary."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    out: list[list[int]] = []
    for i, p in enumerate(prompt):
        ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, f"prompt[{i}]: must not be empty", param="prompt")
        for j, t in enumerate(ids):
            if not 0 <= t < tokenizer.vocab_size:
                raise APIError(400, f"prompt[{i}][{j}]: token id {t} is outside the vocabulary "
                                    f"[0, {tokenizer.vocab_size})", param="prompt")
        out.append(ids)
    return out


def _template_message(msg) -> dict:
    content = msg.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
        if getattr(msg, key) is not None:
            out[key] = getattr(msg, key)
    if msg.tool_calls is not None:
        out["tool_calls"] = [call.model_dump() for call in msg.tool_calls]
    return out


def chat_prompt_ids(req: ChatCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer) -> list[int]:
    """Render the checkpoint's chat template (text parts joined, developer → system; the request's
    ``chat_template_kwargs`` passed on, e.g. ``{"thinking": false}``) and encode it."""
    messages = [_template_message(m) for m in req.messages]
    tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
    add_generation_prompt = getattr(req, "add_generation_prompt", True)
    try:
        kwargs = check_template_kwargs(req.chat_template_kwargs or {})
    except ValueError as e:
        raise APIError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    return tokenizer.encode(text, allow_special=True)


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_request_id(prefix: str) -> str:
    """``cmpl-<hex>`` for completions, ``chatcmpl-<hex>`` for chat."""
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(model: str, choices: list, usage: dict, *, request_id: str | None = None,
                        created: int | None = None) -> dict:
    """``choices``: :class:`~deploy.output.ChoiceResult` each, its logprobs already shaped."""
    return {"id": request_id or new_request_id("cmpl"), "object": "text_completion",
            "created": created or int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
                        for c in choices],
            "usage": usage}


def chat_response(model: str, choices: list, usage: dict, *, request_id: str | None = None,
                  created: int | None = None) -> dict:
    """``choices``: :class:`~deploy.output.ChoiceResult` each, its logprobs already shaped."""
    return {"id": request_id or new_request_id("chatcmpl"), "object": "chat.completion",
            "created": created or int(time.time()), "model": model,
            "choices": [{"index": c.index, "message": c.message or {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason, "logprobs": c.logprobs}
                        for c in choices],
            "usage": usage}


def completion_chunk(request_id: str, model: str, created: int, *, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """One streamed piece of one choice; ``logprobs`` from :func:`~deploy.output.completion_logprobs`."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def chat_chunk(request_id: str, model: str, created: int, *, index: int, text: str = "", first: bool = False,
               finish_reason: str | None = None, logprobs: dict | None = None, delta: dict | None = None) -> dict:
    """One streamed delta of one choice: ``text`` as content, or a ``delta`` from
    :class:`deploy.output.ChoiceOutput` (reasoning, a tool call's header or argument fragment). The
    ``first`` chunk of each choice carries the role; a final chunk with only a finish reason has an
    empty delta."""
    if delta is not None:
        delta = {"role": "assistant", **delta} if first else dict(delta)
    else:
        delta = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def usage_chunk(request_id: str, model: str, created: int, usage: dict, *, chat: bool) -> dict:
    """The last chunk before [DONE] with ``stream_options.include_usage``: no choices, only usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage}


class CompletionStream:
    """A completion request's answer (``n`` choices per prompt), rendered from the output processor
    (the renderer protocol of deploy/answer.py): each piece is a chunk, the end the usage chunk (if
    asked) and ``[DONE]``; :meth:`whole` is the non-streamed body of the same choices."""

    chat = False

    def __init__(self, model: str, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]]):
        self.model, self.req, self.prompts = model, req, prompts
        self.id, self.created = new_request_id("chatcmpl" if self.chat else "cmpl"), int(time.time())
        self.cached_tokens = 0
        self.results: list = []  # every choice's ChoiceResult, once all ended

    def start(self, cached_tokens: int) -> list:
        self.cached_tokens = cached_tokens
        return []

    def feed(self, out, piece) -> list[dict]:
        return [completion_chunk(self.id, self.model, self.created, index=out.index, text=piece.text,
                                 finish_reason=piece.finish_reason, logprobs=piece.logprobs)]

    def finish(self, outs: list) -> list:
        self.results = [o.result() for o in outs]
        if not self.req.include_usage:
            return [SSE_DONE]
        return [usage_chunk(self.id, self.model, self.created, self._usage(), chat=self.chat), SSE_DONE]

    def _usage(self) -> dict:
        return usage(sum(len(p) for p in self.prompts), sum(len(r.token_ids) for r in self.results),
                     self.cached_tokens)

    def whole(self) -> dict:
        body = completion_response(self.model, self.results, self._usage(), request_id=self.id, created=self.created)
        if self.req.return_token_ids:  # vLLM's fields: per choice, its ids and its prompt's
            for choice, result in zip(body["choices"], self.results):
                choice["token_ids"] = list(result.token_ids)
                choice["prompt_token_ids"] = list(self.prompts[result.index // self.req.n])
        return body

    def failed(self, message: str) -> list:
        return [error_body(503, message, code="engine_failed"), SSE_DONE]

    def sse(self, event: dict | str) -> str:
        return event if event == SSE_DONE else sse(event)


class ChatStream(CompletionStream):
    """A chat request's answer: each piece's deltas are chunks, one each, as OpenAI sends them (the
    first of a choice carries the role, a piece's logprobs ride on its first, the finish reason on
    its last)."""

    chat = True

    def __init__(self, model: str, req: ChatCompletionRequest, prompts: list[list[int]]):
        super().__init__(model, req, prompts)
        self.role_sent: set[int] = set()  # the choices whose first chunk is out

    def feed(self, out, piece) -> list[dict]:
        first = out.index not in self.role_sent
        if not piece.deltas and piece.finish_reason is None and piece.logprobs is None and not first:
            return []  # nothing to say yet (a call id or a split character held back)
        self.role_sent.add(out.index)
        deltas = piece.deltas or ({},)
        return [chat_chunk(self.id, self.model, self.created, index=out.index, first=first and i == 0, delta=delta,
                           finish_reason=piece.finish_reason if i == len(deltas) - 1 else None,
                           logprobs=piece.logprobs if i == 0 else None) for i, delta in enumerate(deltas)]

    def whole(self) -> dict:
        body = chat_response(self.model, self.results, self._usage(), request_id=self.id, created=self.created)
        if self.req.return_token_ids:  # vLLM's fields: each choice's ids, the prompt's on the response
            for choice, result in zip(body["choices"], self.results):
                choice["token_ids"] = list(result.token_ids)
            body["prompt_token_ids"] = list(self.prompts[0])
        return body


def models_response(model_names: list[str], created: int, *, max_model_len: int | None = None) -> dict:
    """GET /v1/models; ``max_model_len``: the context each model serves (vLLM's field)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "moeray",
                                        "max_model_len": max_model_len} for name in model_names]}


# ---------------------------------------------------------------- /tokenize and /detokenize


def tokenize_ids(req: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer) -> list[int]:
    """The ids the generation routes would give the model: a prompt encoded as /v1/completions
    encodes it, messages rendered and encoded as /v1/chat/completions does."""
    if isinstance(req, TokenizeChatRequest):
        return chat_prompt_ids(req, tokenizer)
    return tokenizer.encode(req.prompt)


def tokenize_response(ids: list[int], tokenizer: Tokenizer, *, max_model_len: int, token_strs: bool) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [tokenizer.id_to_token(i) for i in ids] if token_strs else None}


def detokenize_text(req: DetokenizeRequest, tokenizer: Tokenizer) -> str:
    """The text of ``req.tokens``, special tokens included (400 naming ``tokens`` for an id outside
    the vocabulary)."""
    for j, t in enumerate(req.tokens):
        if not 0 <= t < tokenizer.vocab_size:
            raise APIError(400, f"tokens[{j}]: token id {t} is outside the vocabulary [0, {tokenizer.vocab_size})",
                           param="tokens")
    return tokenizer.decode(req.tokens)


def sse(obj: dict, event: str | None = None) -> str:
    """One server-sent event: OpenAI's chunks are bare ``data``; Anthropic's and the Responses API's
    events are named."""
    data = f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return data if event is None else f"event: {event}\n{data}"
