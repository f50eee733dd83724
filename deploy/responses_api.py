"""OpenAI's Responses API (``POST /v1/responses``) as a front door to the chat pipeline: a request
becomes a :class:`~deploy.openai_models.ChatCompletionRequest` (the same template, grammar, K2 parser
and prefix cache as /v1/chat/completions), and the output processor's deltas become the response's
output items and typed stream events (:class:`ResponseStream`); the non-streamed response is the
stream's events assembled, by the same object.

Mapping (docs/operations.md, "The Anthropic and Responses APIs"):
- ``input``: a string (one user message) or items: messages (``input_text`` / ``output_text`` parts;
  ``developer`` is ``system``), ``function_call`` (an assistant turn's calls, consecutive ones one
  turn), ``function_call_output`` (tool messages), ``reasoning`` (its text becomes the next assistant
  turn's ``reasoning_content``). ``instructions`` is a system message first; it is not carried over
  by ``previous_response_id``, as OpenAI's.
- ``tools``: function tools (``name``, ``parameters``, ``strict``); built-in tools (web search, file
  search, computer use, code interpreter, ...) are a 400 naming them. ``tool_choice`` as chat's.
  ``text.format`` ``json_schema`` / ``json_object`` → ``response_format``. ``max_output_tokens`` →
  ``max_tokens``; ``reasoning.effort`` ``none`` → the template's ``thinking: false``.
- ``store`` (default true) keeps the conversation (input and output as chat messages) in the engine
  server's memory (:class:`ResponseStore`: at most :data:`STORE_MAX` responses, each for
  :data:`STORE_TTL_S`), so a later request may continue it with ``previous_response_id``; gone
  (expired, evicted, another app) it is a 400 naming the field.
- Output: a ``reasoning`` item (K2-Thinking), a ``message`` with ``output_text``, ``function_call``
  items (``call_id`` is K2's call id). ``status`` ``incomplete`` with ``incomplete_details.reason``
  ``max_output_tokens`` when cut off. ``usage.input_tokens_details.cached_tokens`` from the prefix cache.

Pure protocol: no engine, no FastAPI app (deploy/ingress.py serves the route).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError

from .openai_api import APIError, from_validation_error, parse_request, sse
from .openai_models import ChatCompletionRequest, Number, Strict

STORE_MAX = 4096  # stored responses per engine server
STORE_TTL_S = 3600.0
BUILT_IN_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                  "computer_use_preview", "computer_use", "code_interpreter", "image_generation", "mcp", "local_shell",
                  "shell", "apply_patch", "custom"}


class TextFormat(Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted and ignored.")


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Accepted and ignored.")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Accepted and ignored.")


class ResponsesRequest(Strict):
    """POST /v1/responses."""

    model: StrictStr
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    # accepted and ignored
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    service_tier: StrictStr | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[StrictStr] | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[StrictInt, Field(ge=1)] | None = None
    background: Literal[False] | None = Field(None, description="Only false: responses are not run in the background.")


def parse(raw: bytes, max_body_bytes: int) -> ResponsesRequest:
    return parse_request(ResponsesRequest, raw, max_body_bytes)


# ---------------------------------------------------------------- the store


class ResponseStore:
    """Stored conversations by response id, bounded (oldest out first) and expiring; thread-safe."""

    def __init__(self, max_items: int = STORE_MAX, ttl_s: float = STORE_TTL_S, clock=time.monotonic):
        self.max_items, self.ttl_s, self._clock = max_items, ttl_s, clock
        self._items: OrderedDict[str, tuple[float, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = (self._clock() + self.ttl_s, messages)
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is None or entry[0] < self._clock():
                self._items.pop(response_id, None)
                return None
            return entry[1]

    def __len__(self) -> int:
        return len(self._items)


# ---------------------------------------------------------------- request → chat request


def _part_text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content: must be a string or a list of text parts", param="input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise APIError(400, f"input[{i}].content[{j}]: only text parts (input_text, output_text) are supported, "
                                f"got {kind!r}", param="input")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"input[{i}].content[{j}].text: must be a string", param="input")
        out.append(text)
    return "".join(out)


def _require(i: int, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key}: a string is required for a {item.get('type')} item", param="input")
    return value


def input_messages(items: str | list[dict]) -> list[dict]:
    """The chat messages of ``input`` (module docstring); a 400 names the item at fault."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []

    def assistant() -> dict:  # the assistant turn the next text, call or reasoning joins
        if out and out[-1]["role"] == "assistant":
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}]: must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role: must be user, system, developer or assistant, got {role!r}",
                               param="input")
            text = _part_text(i, item.get("content"))
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _require(i, item, "call_id"), "type": "function",
                    "function": {"name": _require(i, item, "name"), "arguments": _require(i, item, "arguments")}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _part_text(i, output)
            out.append({"role": "tool", "tool_call_id": _require(i, item, "call_id"), "content": text})
        elif kind == "reasoning":
            text = "".join(p.get("text", "") for p in item.get("content") or () if isinstance(p, dict))
            text = text or "".join(p.get("text", "") for p in item.get("summary") or () if isinstance(p, dict))
            msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + text
        else:
            raise APIError(400, f"input[{i}].type: {kind!r} items are not supported (message, function_call, "
                                "function_call_output, reasoning are)", param="input")
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls") and not m["content"]:
            m["content"] = None
    return out


def _tools(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in BUILT_IN_TOOLS or (isinstance(kind, str) and kind != "function"):
            raise APIError(400, f"tools[{i}]: the built-in tool {kind!r} is not available here; only function "
                                "tools are", param="tools")
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}]: must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}}",
                           param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice: must be 'none', 'auto', 'required' or {{'type': 'function', "
                                f"'name': ...}}, got {choice!r}", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice: only 'none', 'auto', 'required' or a function ({{'type': 'function', "
                        f"'name': ...}}) are supported, got {choice!r:.200}", param="tool_choice")


def chat_request(req: ResponsesRequest, served_name: str, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request this response is (``history``: the stored conversation it continues) and the
    conversation to store after it (without the instructions)."""
    conversation = [*history, *input_messages(req.input)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"model": served_name, "messages": messages, "stream": req.stream}
    if req.tools:
        body["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or not fmt.name:
            raise APIError(400, "text.format: a json_schema format needs a name and a schema", param="text")
        spec = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"thinking": False}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    try:
        return ChatCompletionRequest.model_validate(body), conversation
    except ValidationError as e:
        err = from_validation_error(e)
        raise APIError(400, f"the request cannot be served as a chat turn: {err.message}", param=err.param) from None


# ---------------------------------------------------------------- the answer


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseStream:
    """One response's output items, built from the output processor's deltas (the renderer protocol
    of deploy/answer.py, choice 0): :meth:`feed` returns the typed events they make
    (``response.output_item.added`` … ``.done``, indices in the order of the final output),
    :meth:`start` and :meth:`finish` the events around them, :meth:`whole` the whole response — the
    same items, so a non-streamed response is the stream assembled. An event is ``(name, data)``."""

    def __init__(self, req: ResponsesRequest, model: str, prompt_tokens: int):
        self.req, self.model, self.prompt_tokens = req, model, prompt_tokens
        self.id, self.created_at = _id("resp"), int(time.time())
        self.output: list[dict] = []
        self._open: str | None = None  # the open item's kind: "message", "reasoning", "function_call"
        self._calls: dict[int, int] = {}  # tool-call index → output index
        self._seq = 0
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return kind, event

    def response(self) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "error": None, "incomplete_details": self.incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "model": self.model, "output": self.output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id,
                "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
                "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature,
                "text": {"format": fmt}, "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
                "tools": r.tools or [], "top_p": 1.0 if r.top_p is None else r.top_p,
                "truncation": r.truncation or "disabled", "usage": self.usage, "user": r.user,
                "metadata": r.metadata or {}}

    def start(self, cached_tokens: int = 0) -> list[tuple[str, dict]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        index, item = len(self.output) - 1, self.output[-1]
        item["status"] = "completed"
        events = []
        if self._open == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(part))]
        elif self._open == "reasoning":
            part = item["content"][0]
            events += [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"])]
            item.pop("status")
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        self._open = None
        return events + [self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))]

    def _begin(self, item: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.output.append(item)
        self._open = item["type"]
        index = len(self.output) - 1
        shell = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            shell["content"] = []
        if item["type"] == "reasoning":
            shell.pop("status")
        events.append(self._event("response.output_item.added", output_index=index, item=shell))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def feed(self, out, piece) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        for d in piece.deltas:
            if d.get("content"):
                if self._open != "message":
                    events += self._begin({"type": "message", "id": _id("msg"), "status": "in_progress",
                                           "role": "assistant",
                                           "content": [{"type": "output_text", "text": "", "annotations": []}]})
                self.output[-1]["content"][0]["text"] += d["content"]
                events.append(self._event("response.output_text.delta", item_id=self.output[-1]["id"],
                                          output_index=len(self.output) - 1, content_index=0, delta=d["content"],
                                          logprobs=[]))
            elif d.get("reasoning_content"):
                if self._open != "reasoning":
                    events += self._begin({"type": "reasoning", "id": _id("rs"), "summary": [],
                                           "content": [{"type": "reasoning_text", "text": ""}]})
                self.output[-1]["content"][0]["text"] += d["reasoning_content"]
                events.append(self._event("response.reasoning_text.delta", item_id=self.output[-1]["id"],
                                          output_index=len(self.output) - 1, content_index=0,
                                          delta=d["reasoning_content"]))
            for call in d.get("tool_calls", ()):
                if "id" in call:
                    events += self._begin({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                           "name": call["function"]["name"], "arguments": "",
                                           "status": "in_progress"})
                    self._calls[call["index"]] = len(self.output) - 1
                fragment = call["function"].get("arguments", "")
                if fragment:
                    index = self._calls[call["index"]]
                    self.output[index]["arguments"] += fragment
                    events.append(self._event("response.function_call_arguments.delta",
                                              item_id=self.output[index]["id"], output_index=index, delta=fragment))
        return events

    def finish(self, outs: list) -> list[tuple[str, dict]]:
        out, events = outs[0], self._close()
        self.usage = usage(self.prompt_tokens, len(out.token_ids), out.cached_tokens)
        if out.finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return events + [self._event("response.completed", response=self.response())]

    def whole(self) -> dict:
        return self.response()

    def failed(self, message: str) -> list[tuple[str, dict]]:
        return [("error", {"type": "error", "sequence_number": 0, "code": "engine_failed", "message": message,
                           "param": None})]

    def sse(self, event: tuple[str, dict]) -> str:
        return sse(event[1], event[0])

    def conversation_tail(self) -> list[dict]:
        """The output as chat messages, to store after the input."""
        return input_messages(self.output) if self.output else []
