"""OpenAI request bodies as pydantic models: /v1/completions and /v1/chat/completions, with
vLLM's ``top_k``, ``ignore_eos`` and ``min_tokens``.

Pure protocol: validation only, no engine, no tokenizer. Unknown fields are rejected
(``extra="forbid"``) and types are strict (``"5"`` is not an integer; an int is accepted where
a float is expected). Parameters we accept only at their neutral value (penalties,
``logit_bias``, ``best_of``, ``suffix``, ``echo``) fail loudly rather than being ignored.
Turning a ``ValidationError`` into an HTTP error is :mod:`deploy.openai_api`'s job.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, WithJsonSchema, WrapValidator, field_validator)
from pydantic_core import PydanticCustomError

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_PROMPTS = 16  # prompts in one /v1/completions batch
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_TOP_K = (1 << 31) - 1


def _one_message(message: str):
    """A wrap validator that replaces a union's per-member error list with one readable error."""

    def check(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", message) from None

    return WrapValidator(check)


Number = StrictFloat | StrictInt


def _number(*, ge: float | None = None, gt: float | None = None, le: float | None = None):
    """A JSON number (int or float) in bounds; pydantic would put the bounds of a union beside it."""
    bounds = {"minimum": ge, "exclusiveMinimum": gt, "maximum": le}
    return Annotated[Number, Field(ge=ge, gt=gt, le=le),
                     WithJsonSchema({"type": "number", **{k: v for k, v in bounds.items() if v is not None}})]


TokenIds = list[StrictInt]
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# The documented schemas say what is accepted, checks in deploy.openai_api included (non-empty
# prompts, ids >= 0; the app narrows ids to its vocabulary), so generated valid data is valid.
Prompt = Annotated[StrictStr | list[StrictStr] | TokenIds | list[TokenIds], _one_message(
    "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"), WithJsonSchema({
        "anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                   "maxItems": MAX_PROMPTS},
                  _IDS, {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS}],
        "description": "One prompt or a batch of prompts, as text or token ids."})]
Stop = Annotated[StrictStr | list[StrictStr] | None, _one_message(
    f"must be a string or a list of at most {MAX_STOP_STRINGS} strings"), WithJsonSchema({
        "anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
                  {"type": "null"}],
        "description": "Up to 4 non-empty strings; the text stops before the first one and excludes it."})]
# Parameters accepted only at their neutral value (validators below say "not supported").
ZeroOnly = WithJsonSchema({"anyOf": [{"const": 0}, {"type": "null"}],
                           "description": "Not supported: only 0 or null is accepted."})
NullOnly = WithJsonSchema({"type": "null", "description": "Not supported: only null is accepted."})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


Content = Annotated[StrictStr | list[TextPart] | None, _one_message(
    "must be a string, null, or a list of {'type': 'text', 'text': str} parts (only text is supported)")]


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = ""


class ToolCall(_Strict):
    """An assistant turn's call, as OpenAI returns it (and clients send back in the history)."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


_TEXT = {"anyOf": [{"type": "string"}, {"type": "array"}]}
# What the chat template accepts (model.chat_template.validate_messages): content is required,
# except on an assistant turn that only calls tools; only assistant turns carry tool_calls.
_MESSAGE_RULES = {"anyOf": [
    {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}, "content": _TEXT,
                    "tool_calls": {"type": "null"}}, "required": ["content"]},
    {"properties": {"role": {"const": "assistant"}, "content": _TEXT}, "required": ["content"]},
    {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
     "required": ["tool_calls"]}]}


class ChatMessage(_Strict):
    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # Fields of OpenAI's own response message: clients append `choice.message.model_dump()` to
    # the history, so these must be accepted. They are not rendered.
    refusal: StrictStr | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    reasoning_content: StrictStr | None = None


def _fail(kind: str, message: str):
    raise PydanticCustomError(kind, message)


class _SamplingRequest(_Strict):
    """Fields both endpoints share, in OpenAI's meaning (vLLM's for top_k/ignore_eos/min_tokens)."""

    model: StrictStr
    temperature: _number(ge=0.0, le=2.0) = 1.0
    top_p: _number(gt=0.0, le=1.0) = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] = 0  # 0 or -1: off
    seed: Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1] - MAX_N)] | None = None  # choice i: seed + i
    stop: Stop = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    user: StrictStr | None = None
    presence_penalty: Annotated[Number | None, ZeroOnly] = None
    frequency_penalty: Annotated[Number | None, ZeroOnly] = None
    logit_bias: Annotated[dict[str, Any] | None, WithJsonSchema({
        "anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}],
        "description": "Not supported: only null or {} is accepted."})] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            _fail("too_many", f"at most {MAX_STOP_STRINGS} strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            _fail("empty_string", "each stop string must be non-empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            _fail("unsupported", "only allowed when stream is true")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            _fail("unsupported", "not supported: only 0 or null is accepted")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            _fail("unsupported", "not supported: only null or {} is accepted")
        return v

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt`` is one or many prompts, as text or token ids; choice
    ``i * n + j`` is the j-th sample of prompt i."""

    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Annotated[StrictBool, WithJsonSchema({"const": False, "description": "Not supported: only false."})] = False
    best_of: Annotated[StrictInt | None, WithJsonSchema({
        "anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_N}, {"type": "null"}],
        "description": "Only null or equal to n."})] = None
    suffix: Annotated[StrictStr | None, NullOnly] = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            _fail("unsupported", "true is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            _fail("unsupported", "not supported: must be null or equal to n")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v is not None:
            _fail("unsupported", "not supported: must be null")
        return v


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; unset, the app gives the rest of the context."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            _fail("conflict", f"conflicts with max_tokens={other}: give one of them")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            _fail("requires_logprobs", "requires logprobs=true")
        return v

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
