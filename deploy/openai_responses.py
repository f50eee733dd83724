"""Response bodies of every route as pydantic models, for the OpenAPI document.

The builders in :mod:`deploy.openai_api` produce these shapes (a test validates their output
against these models); OpenAI's field names throughout. Documentation only: no route
serialises through them, so they must never be handed to FastAPI as ``response_model`` (it
would re-validate every response and turn a drift into a 500).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ErrorDetail(_Out):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "service_unavailable or server_error.")
    param: str | None = Field(description="The top-level request field at fault, if any.")
    code: str | None


class ErrorResponse(_Out):
    """Every error of every route but /health: OpenAI's envelope."""

    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="Prompt tokens found in the prefix cache (not computed again).")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None
    token_ids: list[int] | None = Field(None, description="With return_token_ids: the generated token ids.")
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids: the prompt's token ids.")


class CompletionResponse(_Out):
    """POST /v1/completions without ``stream``; with it, ``text/event-stream`` chunks of this shape
    (one choice each, ``finish_reason`` null until its last), then ``data: [DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChatLogprobs | None
    token_ids: list[int] | None = Field(None, description="With return_token_ids: the generated token ids.")


class ChatCompletionResponse(_Out):
    """POST /v1/chat/completions without ``stream``; with it, ``chat.completion.chunk`` events."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="With return_token_ids: the prompt's token ids "
                                                                 "(after the chat template).")


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="The context this server serves the model with, in "
                                                        "tokens (prompt and output together).")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    """POST /tokenize (vLLM's)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Out):
    """POST /detokenize (vLLM's)."""

    prompt: str


class Health(_Out):
    """GET /health: 200 ``{"status": "ok"}``; 503 with the reason while the engine cannot serve."""

    status: Literal["ok", "degraded", "unavailable"]
    error: str | None = None
    server: str | None = Field(None, description="host:port of the HTTP server that answered: behind Serve's direct "
                                                 "ingress, the ingress replica's own (`moeray up` relays to it while "
                                                 "the head node is away).")


class ClusterStatus(BaseModel):
    """GET /status: the engine's shape, queue, epoch and per-actor placement (see ``moeray status``)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    model: str
    healthy: bool
    running: int
    waiting: int
    steps: int
    epoch: int
    attention: list[dict[str, Any]]
    experts: list[dict[str, Any]]
    layout: str = "disaggregated"  # or "colocated"
    workers: list[dict[str, Any]] = []  # colocated: each worker's attention replica and expert shard


class EpochChangeReport(BaseModel):
    """POST /admin/*: the committed epoch change (kind, epochs, pause, imbalance before and after)."""

    model_config = ConfigDict(extra="allow")


# ---- the other front doors (deploy/anthropic_api.py, deploy/responses_api.py) ------------------------

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class AnthropicErrorDetail(_Out):
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, not_found_error, "
                                  "request_too_large, overloaded_error or api_error.")
    message: str


class AnthropicError(_Out):
    """Every error of /v1/messages*: Anthropic's envelope."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicMessage(_Open):
    """POST /v1/messages: Anthropic's message (content blocks text, thinking, tool_use)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, Any]


class AnthropicTokenCount(_Out):
    input_tokens: int


class ResponseObject(_Open):
    """POST /v1/responses: OpenAI's response object (output items reasoning, message, function_call)."""

    id: str
    object: Literal["response"]
    status: str
    output: list[dict[str, Any]]
