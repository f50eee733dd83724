"""Chat templates: the built-in K2-Instruct and DeepSeek-V3-style templates, and a sandboxed
Jinja renderer that behaves like Hugging Face's ``apply_chat_template``.

Both templates were written for moeray from the format described in MODEL_SPEC §1.11 (K2)
and DeepSeek-V3's public prompt layout; they are not copies of the checkpoints' files.
Owns message validation; never tokenizes (the caller encodes the rendered string).
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

K2_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Text content may be a string or OpenAI-style parts ([{"type": "text", "text": ...}]).
_RENDER_CONTENT = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable -%}
{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
"""

K2_CHAT_TEMPLATE = _RENDER_CONTENT + """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- if messages[0].role != 'system' -%}
<|im_system|>system<|im_middle|>""" + K2_DEFAULT_SYSTEM_PROMPT + """<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>
{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>
{%- elif message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
{%- elif message.role == 'tool' -%}<|im_system|>tool<|im_middle|>
{%- else -%}{{ raise_exception('unsupported role ' ~ message.role) }}
{%- endif -%}
{{- render_content(message.content) -}}
{%- if message.role == 'assistant' and message.tool_calls -%}
<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}
{%- set fn = call.function -%}
<|tool_call_begin|>{{ call.id if call.id else 'functions.' ~ fn.name ~ ':' ~ loop.index0 }}<|tool_call_argument_begin|>
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
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
    assistant turn that only calls tools."""
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


def render(template: jinja2.Template, messages: list[dict], *, add_generation_prompt: bool,
           tools: list[dict] | None, bos_token: str | None, eos_token: str | None) -> str:
    validate_messages(messages)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of dicts, got {tools!r:.80}")
    try:
        return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "")
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed to render: {e}") from None
