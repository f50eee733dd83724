"""OpenAI request bodies as pydantic models: /v1/completions and /v1/chat/completions (every field
of OpenAI's documented bodies, and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output`` and ``chat_template_kwargs``), and vLLM's /tokenize and /detokenize.

Pure protocol: validation only, no engine, no tokenizer. Unknown fields are rejected
(``extra="forbid"``) and types are strict (``"5"`` is not an integer; an int is accepted where
a float is expected). A documented field that has no meaning on this server (``store``,
``metadata``, ``service_tier``, ...) is validated and ignored, and its description says so; one
whose effect we cannot give (``echo``, ``suffix``, ``best_of`` other than n, audio output) fails
loudly rather than being ignored. Checks that need the vocabulary (token ids) are
:mod:`deploy.openai_api`'s, and so is turning a ``ValidationError`` into an HTTP error.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, WithJsonSchema, WrapValidator, field_validator)
from pydantic_core import PydanticCustomError

MAX_N = 16
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_PROMPTS = 16  # prompts in one /v1/completions batch
MAX_LOGIT_BIAS = 300  # entries of logit_bias (each rides on every step's message)
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_TOP_K = (1 << 31) - 1
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,9})$"  # a logit_bias key: a token id written in decimal


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


def _ignored(why: str) -> str:
    return f"Accepted for compatibility and ignored: {why}."


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
        "description": "Up to 4 non-empty strings; the text stops before the first one and excludes it "
                       "(unless include_stop_str_in_output)."})]
LogitBias = Annotated[dict[StrictStr, Number] | None, WithJsonSchema({
    "anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": TOKEN_ID_KEY},
               "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
              {"type": "null"}],
    "description": "Token id (as a decimal string, inside the vocabulary) → bias in [-100, 100] added to "
                   f"its logit before sampling; at most {MAX_LOGIT_BIAS} entries. 100 all but forces the "
                   "token, -100 all but bans it."})]
StopTokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]] | None, Field(description=(
    "Token ids (inside the vocabulary) that end the choice with finish_reason 'stop', besides the "
    "model's own end-of-turn ids (vLLM's meaning). The stop token's text is excluded from the output "
    "unless include_stop_str_in_output."))]
# Parameters accepted only at their neutral value (validators below say "not supported").
NullOnly = WithJsonSchema({"type": "null", "description": "Not supported: only null is accepted."})


class Strict(BaseModel):
    """A request model of any front door: an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(Strict):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = Field(None, description=_ignored("no obfuscation field is sent"))


class CacheBreakpoint(Strict):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr
    prompt_cache_breakpoint: CacheBreakpoint | None = Field(None, description=_ignored(
        "prompt caching is automatic here"))


Content = Annotated[StrictStr | list[TextPart] | None, _one_message(
    "must be a string, null, or a list of {'type': 'text', 'text': str} parts (only text is supported)")]


class FunctionCall(Strict):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = ""


class ToolCall(Strict):
    """An assistant turn's call, as OpenAI returns it (and clients send back in the history)."""

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


_TEXT = {"anyOf": [{"type": "string"}, {"type": "array"}]}
# What the chat template accepts (model.chat_template.validate_messages): content is required,
# except on an assistant turn that only calls tools; only assistant turns carry tool_calls.
_MESSAGE_RULES = {"anyOf": [
    {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}, "content": _TEXT,
                    "tool_calls": {"type": "null"}, "reasoning_content": {"type": "null"},
                    "reasoning": {"type": "null"}}, "required": ["content"]},
    {"properties": {"role": {"const": "assistant"}, "content": _TEXT}, "required": ["content"]},
    {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
     "required": ["tool_calls"]}]}


class ChatMessage(Strict):
    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # an assistant turn's reasoning, sent back in the history; the template decides what it renders
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = Field(None, description="vLLM's newer name for reasoning_content (assistant "
                                                          "turns only; give one of them).")
    # Fields of OpenAI's own response message: clients append `choice.message.model_dump()` to
    # the history, so these must be accepted. They are not rendered.
    refusal: StrictStr | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


# ---------------------------------------------------------------- tools and structured output
# Validated here; what they do to the prompt and the sampling is the app's (deploy.openai_api).


class FunctionDefinition(Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments as a JSON Schema object.")
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ToolName


class JsonSchemaFormat(Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The output's JSON Schema.")
    strict: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


# ---------------------------------------------------------------- fields accepted and ignored


class Prediction(Strict):
    type: Literal["content"]
    content: StrictStr | list[TextPart]


class VoiceId(Strict):
    id: StrictStr


class AudioOutput(Strict):
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
    voice: StrictStr | VoiceId


class ApproximateLocation(Strict):
    city: StrictStr | None = None
    country: StrictStr | None = None
    region: StrictStr | None = None
    timezone: StrictStr | None = None


class UserLocation(Strict):
    type: Literal["approximate"]
    approximate: ApproximateLocation


class WebSearchOptions(Strict):
    search_context_size: Literal["low", "medium", "high"] | None = None
    user_location: UserLocation | None = None


class ModerationPolicyMode(Strict):
    mode: Literal["score", "block"]


class ModerationPolicy(Strict):
    input: ModerationPolicyMode | None = None
    output: ModerationPolicyMode | None = None


class Moderation(Strict):
    model: StrictStr
    policy: ModerationPolicy | None = None


class PromptCacheOptions(Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class FunctionName(Strict):
    name: StrictStr


def _fail(kind: str, message: str):
    raise PydanticCustomError(kind, message)


class _SamplingRequest(Strict):
    """Fields both endpoints share, in OpenAI's meaning (vLLM's for its extensions)."""

    model: StrictStr
    temperature: _number(ge=0.0, le=2.0) = 1.0
    top_p: _number(gt=0.0, le=1.0) = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] = 0  # 0 or -1: off
    min_p: Annotated[_number(ge=0.0, le=1.0) | None, Field(description=(
        "Drop tokens less likely than min_p times the most likely one (vLLM's meaning); 0 or null: off."))] = None
    seed: Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1] - MAX_N)] | None = None  # choice i: seed + i
    stop: Stop = None
    stop_token_ids: StopTokenIds = None
    include_stop_str_in_output: StrictBool = Field(False, description=(
        "Keep the stop string, or the stop token's text, that ended a choice in its text (vLLM's meaning)."))
    skip_special_tokens: StrictBool = Field(True, description=(
        "Leave special tokens (such as the end-of-turn token) out of the output text (vLLM's meaning); "
        "logprobs still show them."))
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    cache_salt: Annotated[StrictStr | None, Field(min_length=1, max_length=256, description=(
        "Requests share cached prompt blocks only with requests of the same salt, so one tenant cannot "
        "learn another's prompts from timing (vLLM's meaning); null: the unsalted cache."))] = None
    return_token_ids: StrictBool = Field(False, description=(
        "Add the prompt's token ids (prompt_token_ids) and each choice's generated ids (token_ids) to a "
        "response that is not streamed (vLLM's meaning)."))
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    user: StrictStr | None = Field(None, description=_ignored("the caller is not tracked"))
    presence_penalty: Annotated[_number(ge=-2.0, le=2.0) | None, Field(description=(
        "Subtracted from the logit of every token generated so far; null: 0."))] = None
    frequency_penalty: Annotated[_number(ge=-2.0, le=2.0) | None, Field(description=(
        "Subtracted from a token's logit once per time it was generated so far; null: 0."))] = None
    repetition_penalty: Annotated[_number(gt=0.0, le=10.0) | None, Field(description=(
        "Divides the positive logits (multiplies the negative ones) of tokens in the prompt or generated so "
        "far (vLLM's meaning); 1 or null: off."))] = None
    logit_bias: LogitBias = None

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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if len(v or {}) > MAX_LOGIT_BIAS:
            _fail("too_many", f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(v)}")
        for key, bias in (v or {}).items():
            if not re.fullmatch(TOKEN_ID_KEY, key):
                _fail("invalid_key", f"keys must be token ids written in decimal, got {key!r}")
            if not -100 <= bias <= 100:
                _fail("out_of_range", f"the bias of token {key} must be in [-100, 100], got {bias}")
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
    tools: list[Tool] | None = Field(None, description="Functions the model may call; rendered into the prompt "
                                                       "by the chat template.")
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, _one_message(
        "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': str}}")] = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "Extra variables for the chat template (vLLM's meaning), e.g. {\"thinking\": false}."))
    # OpenAI's fields that mean nothing here: validated, then ignored
    store: StrictBool | None = Field(None, description=_ignored("nothing is stored"))
    metadata: dict[StrictStr, StrictStr] | None = Field(None, description=_ignored(
        "nothing is stored (at most 16 pairs, keys up to 64 characters, values up to 512)"))
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = Field(
        None, description=_ignored("there is one tier"))
    prediction: Prediction | None = Field(None, description=_ignored("predicted outputs are not used"))
    modalities: Annotated[list[Literal["text", "audio"]] | None, WithJsonSchema({
        "anyOf": [{"type": "array", "items": {"const": "text"}}, {"type": "null"}],
        "description": "Only text output: 'audio' is refused."})] = None
    audio: AudioOutput | None = Field(None, description=_ignored("there is no audio output"))
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description=_ignored("use chat_template_kwargs to control the model's thinking"))
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=_ignored(
        "the model is not steered by it"))
    web_search_options: WebSearchOptions | None = Field(None, description=_ignored("there is no web search"))
    function_call: Annotated[Literal["none", "auto"] | FunctionName | None, _one_message(
        "must be 'none', 'auto' or {'name': str}")] = Field(None, description=_ignored(
            "deprecated by OpenAI for tool_choice"))
    functions: list[FunctionDefinition] | None = Field(None, description=_ignored("deprecated by OpenAI for tools"))
    moderation: Moderation | None = Field(None, description=_ignored("there is no moderation"))
    prompt_cache_key: StrictStr | None = Field(None, description=_ignored("prompt caching is automatic here"))
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description=_ignored(
        "prompt caching is automatic here"))
    prompt_cache_options: PromptCacheOptions | None = Field(None, description=_ignored(
        "prompt caching is automatic here"))
    safety_identifier: StrictStr | None = Field(None, description=_ignored("the caller is not tracked"))

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

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: list[str] | None) -> list[str] | None:
        if v and "audio" in v:
            _fail("unsupported", "only text output is supported, not 'audio'")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            _fail("too_long", "at most 16 pairs, keys up to 64 characters and values up to 512")
        return v

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- /tokenize and /detokenize (vLLM's)


class TokenizeCompletionRequest(Strict):
    """POST /tokenize with a prompt: its token ids, as /v1/completions encodes it."""

    model: StrictStr | None = Field(None, description="The served model's name; may be left out.")
    prompt: StrictStr
    add_special_tokens: StrictBool = Field(True, description=_ignored("this tokenizer adds no BOS or EOS"))
    return_token_strs: StrictBool | None = Field(False, description="Also return each token as a string.")


class TokenizeChatRequest(Strict):
    """POST /tokenize with messages: the ids of the rendered chat template, as /v1/chat/completions
    encodes it."""

    model: StrictStr | None = Field(None, description="The served model's name; may be left out.")
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = Field(False, description=_ignored("this tokenizer adds no BOS or EOS"))
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool | None = Field(False, description="Also return each token as a string.")


class DetokenizeRequest(Strict):
    """POST /detokenize: token ids back to text (special tokens included)."""

    model: StrictStr | None = Field(None, description="The served model's name; may be left out.")
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
