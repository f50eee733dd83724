"""One chat request's assistant turn, planned: the prompt through the chat template, the grammar its
tokens must follow, and how its output is to be read (plain text, or K2's markers parsed into
content, reasoning and tool calls by the output processor, :mod:`deploy.output`).

Owns: the choice between plain text and K2's parsed output (:mod:`deploy.tool_parser`) and the
grammar for ``tools`` / ``tool_choice`` and ``response_format`` (:mod:`deploy.structured`).
Never: talks to the engine, reads the output or builds HTTP responses (deploy/output.py,
deploy/ingress.py and deploy/openai_api.py do).

Policies (docs/operations.md, "Tool calls and structured output"):
- ``tool_choice`` "none" (or no tools): tools are still declared to the model, nothing is parsed
  and no grammar applies; "auto": the model may answer or call, and once it opens the tool-call
  section the grammar holds it to the declared functions and their schemas; "required" or a named
  function: the answer is a call, constrained from its first token.
- A call cut off by ``max_tokens`` is reported with the arguments it has (``finish_reason``
  "length", streamed and not); arguments that are not JSON cannot come from a constrained call.
- ``response_format`` with tools is refused (400) unless ``tool_choice`` is "none".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from deploy.openai_api import APIError, chat_prompt_ids
from deploy.structured import SchemaError, response_format_grammar, tool_call_grammar
from deploy.tool_parser import K2Markers
from model.grammar import check as check_grammar
from model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPlan:
    prompt_ids: list[int]
    grammar: str | None  # every generated token follows it (llguidance, deploy/structured.py)
    markers: K2Markers | None  # parse K2's output (tool calls and/or reasoning); None: plain text
    tools_enabled: bool
    think: bool  # the template lets the model reason first (<think> … </think>)


@functools.lru_cache(maxsize=256)
def _check_grammar(grammar: str) -> None:
    """model.grammar.check, once per grammar text (an agent resends the same tools every turn)."""
    check_grammar(grammar)


def _dump(x):
    return x.model_dump(exclude_none=True, by_alias=True) if hasattr(x, "model_dump") else x


def plan_chat(req, tok: Tokenizer, whitespace: str = "none") -> ChatPlan:
    """The request's prompt ids, grammar and output parsing; a 400 naming the field for what the
    request gets wrong (an unknown named function, a schema the grammar library refuses, …)."""
    prompt_ids = chat_prompt_ids(req, tok)  # 400s for the messages and chat_template_kwargs come first
    kwargs = req.chat_template_kwargs or {}
    tools = [_dump(t) for t in req.tools] if req.tools else None
    choice = _dump(req.tool_choice) if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice: no tool is named {name!r}", param="tool_choice")
    tools_enabled = choice != "none"
    think = tok.thinking and kwargs.get("thinking") is not False
    markers = None
    if tools_enabled or think:
        try:
            markers = K2Markers.from_tokenizer(tok)
        except ValueError as e:
            if tools_enabled:
                raise APIError(400, f"tools: this model cannot call tools ({e})", param="tools") from None
    rf = _dump(req.response_format) if req.response_format is not None else None
    grammar = None
    try:
        if rf is not None and rf.get("type") != "text":
            if tools_enabled:
                raise APIError(400, "response_format: cannot be combined with tools unless tool_choice is 'none'",
                               param="response_format")
            grammar = response_format_grammar(rf, markers=markers, think=think, whitespace=whitespace)
        elif tools_enabled:
            first = sum(len(m.tool_calls or ()) for m in req.messages if m.role == "assistant")
            grammar = tool_call_grammar(tools, choice, req.parallel_tool_calls is not False, first, markers,
                                        think=think, whitespace=whitespace)
        if grammar is not None:
            _check_grammar(grammar)  # what the attention actors will compile: refused here, not there
    except ValueError as e:  # SchemaError included: the message names the path and the keyword
        raise APIError(400, str(e), param="response_format" if rf is not None else "tools",
                       code="invalid_schema" if isinstance(e, SchemaError) else None) from None
    return ChatPlan(prompt_ids, grammar, markers, tools_enabled, think)
