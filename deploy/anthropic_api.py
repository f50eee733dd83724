"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a front door to
the chat pipeline: a request becomes a :class:`~deploy.openai_models.ChatCompletionRequest` (the same
template, grammar, K2 parser and prefix cache as /v1/chat/completions), and the output processor's
deltas become Anthropic's content blocks and stream events (:class:`MessageStream`); the non-streamed
answer is the stream's events assembled, by the same object.

Mapping (docs/operations.md, "The Anthropic and Responses APIs"):
- ``system`` (a string or text blocks) → a system message; a user turn's ``tool_result`` blocks →
  tool messages (``is_error``: the text is prefixed ``Error: ``), its text blocks → one user message;
  an assistant turn's ``thinking`` → ``reasoning_content``, ``text`` → content, ``tool_use`` →
  tool calls (``input`` as JSON arguments). Every block the ``anthropic`` SDK returns is accepted back
  as it dumps (``None`` values included): ``redacted_thinking``, server-tool blocks
  (``server_tool_use``, ``*_tool_result``) and ``container_upload`` are not rendered (no server tool
  runs here; their content is mostly Anthropic's encryption), ``citations``, ``signature``, ``caller``,
  ``toolset_name`` and ``cache_control`` are ignored.
- Unknown fields (top level, message, block) are a 400 naming them, as Anthropic's "Extra inputs are
  not permitted"; the known ones ignored carry ``Accepted and ignored`` (:func:`ignored_fields`).
- ``tools`` (``name``, ``description``, ``input_schema``) → function tools; server tools (web search,
  bash, computer use, ...) are a 400 naming them. ``tool_choice`` ``auto`` / ``any`` / ``tool`` /
  ``none`` → ``auto`` / ``required`` / the named function / ``none``; ``disable_parallel_tool_use`` →
  one call. ``thinking`` ``disabled`` → the template's ``thinking: false``. ``output_config.format``
  (``json_schema``; the older ``output_format``) → structured output.
- Tool-use ids are K2's call ids (``functions.NAME:IDX``), which the template renders back.
- ``stop_reason``: ``tool_use`` when the turn called a tool, ``max_tokens``, ``stop_sequence`` (with
  the sequence), else ``end_turn``. ``usage.input_tokens`` counts the prompt tokens not read from the
  prefix cache, ``cache_read_input_tokens`` those that were (Anthropic's split).
- Errors leave in Anthropic's envelope: ``{"type": "error", "error": {"type", "message"}}``.

Pure protocol: no engine, no FastAPI app (deploy/ingress.py serves the routes).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StrictInt, StrictStr, ValidationError

from .openai_api import ERROR_TYPES, APIError, from_validation_error, parse_request, sse
from .openai_models import MAX_STOP_STRINGS, ChatCompletionRequest, Number, Strict

ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
              503: "overloaded_error"}
SIGNATURE = "moeray"  # thinking blocks carry one (clients send it back); nothing is signed here


_IGNORED = "Accepted and ignored."


class _Block(Strict):
    """A content block: the fields of Anthropic's block params (what the SDK's response blocks dump to,
    ``None`` values included), unknown ones a 400 as at Anthropic."""

    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored: caching is automatic.")


class Caller(Strict):
    """Who made a tool call: ``direct`` (the model) or a code-execution tool (``tool_id``)."""

    type: StrictStr
    tool_id: StrictStr | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr
    citations: list[dict[str, Any]] | None = Field(None, description=_IGNORED)


def _as_blocks(value: Any) -> Any:
    """A string where blocks may stand is one text block (Anthropic's shorthand), so a union of the two
    never hides the blocks' own errors behind "not a string"."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("should be a string or a list of content blocks")
    return value


TextBlocks = Annotated[list[TextBlock],
                       BeforeValidator(_as_blocks, json_schema_input_type=Union[str, list[TextBlock]])]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    caller: Caller | None = Field(None, description=_IGNORED)
    toolset_name: StrictStr | None = Field(None, description=_IGNORED)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: TextBlocks | None = None
    is_error: StrictBool | None = None
    toolset_name: StrictStr | None = Field(None, description=_IGNORED)


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = Field(None, description=_IGNORED)


class RedactedThinkingBlock(Strict):
    """Not rendered: its ``data`` is Anthropic's encryption."""

    type: Literal["redacted_thinking"]
    data: StrictStr


class ServerToolUseBlock(_Block):
    """A call of one of Anthropic's server tools (web search, code execution, ...): not rendered, as its
    result is not (no server tool runs here)."""

    type: Literal["server_tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    caller: Caller | None = None


class ServerToolResultBlock(_Block):
    """A server tool's result, kept in the assistant turn: not rendered (the model here never had the
    tool, and Anthropic encrypts most of it); ``content`` is read only as JSON objects."""

    type: Literal["code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "tool_search_tool_result"]
    tool_use_id: StrictStr
    content: dict[str, Any] | list[dict[str, Any]]


class WebToolResultBlock(ServerToolResultBlock):
    type: Literal["web_search_tool_result", "web_fetch_tool_result"]  # type: ignore[assignment]
    caller: Caller | None = None


class ContainerUploadBlock(_Block):
    """A file for Anthropic's code-execution container: not rendered (there is no container here)."""

    type: Literal["container_upload"]
    file_id: StrictStr


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                        ServerToolUseBlock, ServerToolResultBlock, WebToolResultBlock, ContainerUploadBlock],
                  Field(discriminator="type")]
UNRENDERED = (RedactedThinkingBlock, ServerToolUseBlock, ServerToolResultBlock, ContainerUploadBlock)


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Annotated[list[Block], BeforeValidator(_as_blocks, json_schema_input_type=Union[str, list[Block]])]


class Tool(Strict):
    type: Literal["custom"] | None = None
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(None, description=_IGNORED)


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: StrictStr | None = Field(None, description=_IGNORED)


class _Request(Strict):
    """The fields both routes take (Anthropic's count_tokens params); any other top-level field is a 400
    naming it, as Anthropic's ``Extra inputs are not permitted``."""

    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: TextBlocks | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: a server tool is named in the error
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = Field(None, description="format (json_schema): structured output.")
    output_format: OutputFormat | None = Field(None, description="The older spelling of output_config.format.")
    cache_control: dict[str, Any] | None = Field(None, description="Accepted and ignored: prefix caching is automatic.")
    context_management: Any = Field(None, description=_IGNORED)
    mcp_servers: list[Any] | None = Field(None, description=_IGNORED)
    speed: StrictStr | None = Field(None, description=_IGNORED)
    user_profile_id: StrictStr | None = Field(None, description=_IGNORED)
    workspace_id: StrictStr | None = Field(None, description=_IGNORED)


class MessagesRequest(_Request):
    """POST /v1/messages."""

    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(
        max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    temperature: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = Field(None, description=_IGNORED)
    service_tier: StrictStr | None = Field(None, description="Accepted and ignored: there is one tier.")
    container: Any = Field(None, description=_IGNORED)
    diagnostics: Any = Field(None, description=_IGNORED)
    inference_geo: StrictStr | None = Field(None, description=_IGNORED)


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt's token count, as /v1/messages would render it."""


def ignored_fields(model: type[BaseModel] = MessagesRequest) -> list[str]:
    """The top-level fields ``model`` accepts and ignores (docs/operations.md lists them)."""
    return [f.alias or name for name, f in model.model_fields.items()
            if (f.description or "").startswith("Accepted and ignored")]


# ---------------------------------------------------------------- request → chat request


def parse(raw: bytes, max_body_bytes: int, *, count: bool = False) -> MessagesRequest | CountTokensRequest:
    return parse_request(CountTokensRequest if count else MessagesRequest, raw, max_body_bytes)


def _text(content: list[TextBlock] | None) -> str:
    return "".join(b.text for b in content or ())


def _tool(i: int, raw: dict) -> dict:
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise APIError(400, f"tools[{i}]: the server tool {kind!r} ({raw.get('name', '?')}) is not available "
                            "here; only client tools (name, description, input_schema) are", param="tools")
    try:
        tool = Tool.model_validate(raw)
    except ValidationError as e:
        raise APIError(400, f"tools[{i}].{from_validation_error(e).message}", param="tools") from None
    fn = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def _chat_messages(req: _Request) -> list[dict]:
    out: list[dict] = []
    if req.system is not None and _text(req.system):
        out.append({"role": "system", "content": _text(req.system)})
    for i, m in enumerate(req.messages):
        blocks = m.content
        if m.role == "user":
            for j, b in enumerate(blocks):
                if isinstance(b, ToolResultBlock):
                    text = _text(b.content)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": f"Error: {text}" if b.is_error else text})
                elif not isinstance(b, TextBlock):
                    raise APIError(400, f"messages[{i}].content[{j}]: a user turn holds text and "
                                        f"tool_result blocks, not {b.type!r}", param="messages")
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
            continue
        if any(isinstance(b, ToolResultBlock) for b in blocks):
            raise APIError(400, f"messages[{i}]: tool_result blocks belong in a user turn", param="messages")
        if blocks and all(isinstance(b, UNRENDERED) for b in blocks):
            continue  # nothing of it is rendered: no empty assistant turn either
        msg: dict = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
        reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_request(req: _Request, served_name: str) -> ChatCompletionRequest:
    """The chat request this Messages request is, validated as one (a 400 names the field)."""
    body: dict[str, Any] = {"model": served_name, "messages": _chat_messages(req)}
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice: {'type': 'tool'} needs a name", param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None and req.thinking.type == "disabled":
        body["chat_template_kwargs"] = {"thinking": False}
    fmt = req.output_config.format if req.output_config is not None and req.output_config.format else req.output_format
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        body["stream"] = req.stream
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        for key in ("temperature", "top_p", "top_k"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what the messages became does not hold (a tool name, ...)
        err = from_validation_error(e)
        raise APIError(400, f"the request cannot be served as a chat turn: {err.message}", param=err.param) from None


# ---------------------------------------------------------------- the answer


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:  # cut off by max_tokens: what there is cannot be read as JSON
        return {}
    return value if isinstance(value, dict) else {}


class MessageStream:
    """One turn's content blocks, built from the output processor's deltas (the renderer protocol of
    deploy/answer.py, choice 0): :meth:`feed` returns the stream events they make
    (``content_block_start`` / ``_delta`` / ``_stop``, indices in the order of the final content),
    :meth:`start` and :meth:`finish` the events around them, :meth:`whole` the whole answer — the same
    blocks, so a non-streamed answer is the stream assembled. An event is ``(name, data)``."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = new_message_id(), model, prompt_tokens
        self.blocks: list[dict] = []
        self._json: list[str] = []  # each tool_use block's arguments as streamed (the others: "")
        self._open: str | None = None  # the open block's kind: "text", "thinking", "tool_use"
        self._calls: dict[int, int] = {}  # tool-call index → block index
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.output_tokens = 0
        self.cached_tokens = 0

    def start(self, cached_tokens: int) -> list[tuple[str, dict]]:
        self.cached_tokens = cached_tokens
        shell = {**self._shell(), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": usage(self.prompt_tokens, 0, cached_tokens)}
        return [("message_start", {"type": "message_start", "message": shell}), ("ping", {"type": "ping"})]

    def _shell(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        events = []
        index = len(self.blocks) - 1
        if self._open == "thinking":
            self.blocks[index]["signature"] = SIGNATURE
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": SIGNATURE}}))
        if self._open == "tool_use":
            self.blocks[index]["input"] = _arguments(self._json[index])
        self._open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _begin(self, block: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.blocks.append(block)
        self._json.append("")
        self._open = block["type"]
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return events + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                  "content_block": start})]

    def _delta(self, delta: dict, index: int | None = None) -> tuple[str, dict]:
        index = len(self.blocks) - 1 if index is None else index
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}

    def feed(self, out, piece) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        for d in piece.deltas:
            if d.get("content"):
                if self._open != "text":
                    events += self._begin({"type": "text", "text": ""})
                self.blocks[-1]["text"] += d["content"]
                events.append(self._delta({"type": "text_delta", "text": d["content"]}))
            elif d.get("reasoning_content"):
                if self._open != "thinking":
                    events += self._begin({"type": "thinking", "thinking": "", "signature": ""})
                self.blocks[-1]["thinking"] += d["reasoning_content"]
                events.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
            for call in d.get("tool_calls", ()):
                if "id" in call:
                    events += self._begin({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                           "input": {}})
                    self._calls[call["index"]] = len(self.blocks) - 1
                fragment = call["function"].get("arguments", "")
                if fragment:
                    index = self._calls[call["index"]]
                    self._json[index] += fragment
                    events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}, index))
        return events

    def finish(self, outs: list) -> list[tuple[str, dict]]:
        out, events = outs[0], self._close()
        self.stop_reason, self.stop_sequence = stop_reason(out.finish_reason, out.stop_string), out.stop_string
        self.output_tokens = len(out.token_ids)
        return events + [("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": self.stop_reason,
                                                      "stop_sequence": self.stop_sequence},
                                            "usage": {"output_tokens": self.output_tokens}}),
                         ("message_stop", {"type": "message_stop"})]

    def whole(self) -> dict:
        return {**self._shell(), "content": self.blocks, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence,
                "usage": usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)}

    def failed(self, message: str) -> list[tuple[str, dict]]:
        return [("error", error_body(503, message))]

    def sse(self, event: tuple[str, dict]) -> str:
        return sse(event[1], event[0])


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPE.get(status, ERROR_TYPES.get(status, "api_error")),
                                       "message": message}}
