"""Chat templates: the built-in K2-Instruct, K2-Thinking and DeepSeek-V3-style templates, and a
sandboxed Jinja renderer that behaves like Hugging Face's ``apply_chat_template``.

The templates were written for moeray from the format described in MODEL_SPEC §1.11 (K2,
K2-Thinking) and DeepSeek-V3's public prompt layout; they are not copies of the checkpoints' files.
Owns message validation; never tokenizes (the caller encodes the rendered string).
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

K2_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Variables the renderer sets itself; a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")

# Text content may be a string or OpenAI-style parts ([{"type": "text", "text": ...}]).
_RENDER_CONTENT = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable -%}
{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
"""

# K2's pieces (MODEL_SPEC §1.11): the role header shows `name` when a message has one; tool
# results start "## Return of {id}"; a call without an id gets `functions.{name}:{idx}`, idx
# counting calls over the whole conversation (``ns.calls``), the form K2 was trained on.
_K2_MACROS = _RENDER_CONTENT + """\
{%- macro render_header(message) -%}
{%- set role_name = message.name or message.role -%}
{%- if message.role == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message.role == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>
{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(message, ns) -%}
<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}
{%- set fn = call.function -%}
<|tool_call_begin|>{{ call.id if call.id else 'functions.' ~ fn.name ~ ':' ~ ns.calls }}<|tool_call_argument_begin|>
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}<|tool_call_end|>
{%- set ns.calls = ns.calls + 1 -%}
{%- endfor -%}
<|tool_calls_section_end|>
{%- endmacro -%}
{%- macro render_body(message, ns) -%}
{%- if message.role == 'tool' -%}## Return of {{ message.tool_call_id }}{{ '\\n' }}
{%- endif -%}
{{- render_content(message.content) -}}
{%- if message.role == 'assistant' and message.tool_calls -%}{{ render_tool_calls(message, ns) }}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- if messages[0].role != 'system' -%}
<|im_system|>system<|im_middle|>""" + K2_DEFAULT_SYSTEM_PROMPT + """<|im_end|>
{%- endif -%}
"""

K2_CHAT_TEMPLATE = _K2_MACROS + """\
{%- set ns = namespace(calls=0) -%}
{%- for message in messages -%}
{{- render_header(message) -}}{{- render_body(message, ns) -}}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""

# K2-Thinking: every assistant turn starts with a think block. Reasoning is kept only after the
# last assistant answer that made no tool calls (the agent loop still in progress); turns up to
# and including it render an empty <think></think>. `thinking=false` (a template kwarg) drops all
# reasoning and ends the generation prompt with an empty think block, so the model answers at once;
# otherwise the model opens <think> itself.
K2_THINKING_CHAT_TEMPLATE = _K2_MACROS + """\
{%- set no_thinking = thinking is defined and thinking is false -%}
{%- set ns = namespace(calls=0, last_answer=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and not message.tool_calls -%}{%- set ns.last_answer = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{{- render_header(message) -}}
{%- if message.role == 'assistant' -%}
{%- if loop.index0 > ns.last_answer and not no_thinking -%}<think>{{ message.reasoning_content or '' }}</think>
{%- else -%}<think></think>
{%- endif -%}
{%- endif -%}
{{- render_body(message, ns) -}}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>
{%- if no_thinking -%}<think></think>{%- endif -%}
{%- endif -%}
"""

DEEPSEEK_CHAT_TEMPLATE = _RENDER_CONTENT + """\
{{- bos_token -}}
{%- for message in messages if message.role == 'system' -%}
{%- if not loop.first -%}{{ '\\n\\n' }}{%- endif -%}{{ render_content(message.content) }}
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}<｜User｜>{{ render_content(message.content) }}
{%- elif message.role == 'assistant' -%}
{%- if message.tool_calls -%}{{ raise_exception('this template does not render tool calls') }}{%- endif -%}
<｜Assistant｜>{{ render_content(message.content) }}<｜end▁of▁sentence｜>
{%- elif message.role != 'system' -%}{{ raise_exception('unsupported role ' ~ message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}
"""

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "reasoning")  # "reasoning" is vLLM's newer name


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """Compile with HF's settings: sandboxed, trim_blocks/lstrip_blocks, loop controls."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e.message} (line {e.lineno})") from None


def validate_messages(messages: Any) -> None:
    """OpenAI-style messages: role in ROLES; content a string, a list of parts, or None for an
    assistant turn that only calls tools; optional string ``name`` and ``tool_call_id`` (K2 renders
    a tool result as "## Return of {tool_call_id}"); ``reasoning_content`` or its alias
    ``reasoning`` only on an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {ROLES}, got {role!r}")
        content = msg.get("content")
        tool_calls = msg.get("tool_calls")
        if content is None:
            if role != "assistant" or not tool_calls:
                raise ValueError(f"{where}.content is missing (only an assistant turn with tool_calls may omit it)")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ValueError(f"{where}.content[{j}] must be a dict with a 'type', got {part!r:.80}")
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
        if tool_calls is not None:
            _validate_tool_calls(where, role, tool_calls)
        _validate_extra_fields(where, role, msg)


def _validate_extra_fields(where: str, role: str, msg: dict) -> None:
    for key in ("name", "tool_call_id", *REASONING_FIELDS):
        value = msg.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{key} must be a string, got {type(value).__name__}")
    if role != "assistant":
        for key in REASONING_FIELDS:
            if msg.get(key) is not None:
                raise ValueError(f"{where}.{key} is only allowed on assistant messages, got role {role!r}")
    given = {msg[k] for k in REASONING_FIELDS if msg.get(k) is not None}
    if len(given) > 1:
        raise ValueError(f"{where} has both reasoning_content and reasoning, and they differ; send one")


def _validate_tool_calls(where: str, role: str, tool_calls: Any) -> None:
    if role != "assistant":
        raise ValueError(f"{where}.tool_calls is only allowed on assistant messages, got role {role!r}")
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list, got {type(tool_calls).__name__}")
    for k, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{k}] must be {{'function': {{'name': str, 'arguments': ...}}}}")
        if not isinstance(fn.get("arguments", ""), (str, dict)):
            raise ValueError(f"{where}.tool_calls[{k}].function.arguments must be a JSON string or a dict")


def _with_reasoning_content(messages: list[dict]) -> list[dict]:
    """Templates read ``reasoning_content`` (K2-Thinking's field); copy the ``reasoning`` alias
    there, leaving the caller's dicts untouched."""
    out = []
    for msg in messages:
        if msg.get("reasoning") is not None and msg.get("reasoning_content") is None:
            msg = {**msg, "reasoning_content": msg["reasoning"]}
        out.append(msg)
    return out


def check_template_kwargs(template_kwargs: Any) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` as a new dict: string keys, none of
    RESERVED_TEMPLATE_KWARGS (check before splatting them into ``apply_chat_template``, where a
    ``tools`` key would clash with the real argument)."""
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise ValueError(f"chat_template_kwargs must be an object with string keys, got {template_kwargs!r:.80}")
    reserved = sorted(set(template_kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets those itself")
    return dict(template_kwargs)


def render(template: jinja2.Template, messages: list[dict], *, add_generation_prompt: bool,
           tools: list[dict] | None, bos_token: str | None, eos_token: str | None,
           template_kwargs: dict[str, Any] | None = None) -> str:
    """``template_kwargs`` (a request's ``chat_template_kwargs``, e.g. ``thinking``) become
    template variables; the names in RESERVED_TEMPLATE_KWARGS are a ValueError."""
    validate_messages(messages)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of dicts, got {tools!r:.80}")
    template_kwargs = check_template_kwargs(template_kwargs or {})
    try:
        return template.render(**template_kwargs, messages=_with_reasoning_content(messages), tools=tools,
                               add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "")
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed to render: {e}") from None
