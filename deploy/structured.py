"""Grammars for structured outputs and K2 tool calls, built from OpenAI request fields.

Pure functions from a request's ``response_format`` or ``tools``/``tool_choice`` to grammar text in
llguidance's Lark dialect, which :class:`model.grammar.Grammars` compiles on the attention actor and
applies to every sampled token. A JSON Schema is embedded as ``%json {...}``; K2's tool markers are
special tokens, written by id (``<[163597]>``) from :class:`deploy.tool_parser.K2Markers`, so the
text is exact for the checkpoint the markers came from.

Owns: nothing (pure). Never: compiles a grammar for a tokenizer, holds llguidance objects (schemas
are only *validated* with ``llguidance.LLMatcher``, which needs no tokenizer), or decides stop
conditions (a finished grammar allows only the end-of-turn ids; see :mod:`model.grammar`).

Policies:

- ``strict``: a schema marked ``strict: true`` (the ``json_schema`` object or a tool's ``function``)
  is enforced exactly; a keyword llguidance cannot enforce is a :class:`SchemaError`. Without it the
  schema is enforced leniently: keywords llguidance does not implement (``not``, ``uniqueItems``,
  ``if``/``then``, ...) are ignored, everything else holds. A schema that is wrong in itself (an
  unknown type, a bad regex, a dangling ``$ref``) is a :class:`SchemaError` either way. A schema's
  own ``x-guidance`` options are replaced by ours (:data:`JSON_OPTIONS`).
- JSON whitespace (the serving config's ``json_whitespace``): ``"none"`` (the default) — exactly
  ``json.dumps``'s separators, ``", "`` and ``": "``, so a weak model cannot spend its ``max_tokens`` on
  blanks; ``"flexible"`` — at most :data:`JSON_WHITESPACE` (12 characters) per gap, so a model cannot
  loop on whitespace inside a forced structure.
- Closed objects: an object schema with ``properties`` and no ``additionalProperties`` (nor
  ``patternProperties`` / ``unevaluatedProperties``) gets ``additionalProperties: false``, in tool
  arguments and ``response_format`` alike, so an agent's ``fn(**args)`` never meets a key its tool
  does not take; a schema that says ``additionalProperties`` keeps what it says. Members of an
  ``allOf`` are left open (closing each would refuse the others' keys).
- Tool choice: ``"required"`` — the tool-call section is the whole answer; a named function —
  exactly one call to it; ``"auto"`` — any text, then optionally the section, and once the model
  opens the section the grammar holds it to well-formed calls of the declared functions, each with its
  own schema (strict or lenient as above: the issue's "the grammar takes over once the model opens a
  tool-call section", so even a non-strict call's arguments parse); ``"none"`` or no tools: None.
  The section holds one call, or with ``parallel_tool_calls`` one to :data:`MAX_PARALLEL_CALLS`;
  after it the turn ends.
- Call ids: ``functions.NAME:IDX`` with IDX counted exactly, from ``first_index`` (the tool calls
  already in the conversation) up, as K2 was trained and as the chat template renders them back.
- Thinking (``think=True``, K2-Thinking's template; :mod:`deploy.tool_parser`'s policy): the output
  starts with reasoning, optionally opened by ``<think>`` (the generation prompt may or may not
  include it), closed by ``</think>``; the constrained answer follows. Reasoning is any text
  without special tokens. With ``think=False`` no think marker is allowed.
- Free text (reasoning, ``"auto"``'s content) is any text without special tokens, so it cannot
  fake a marker; the end-of-turn ids end the output wherever the grammar may end.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from deploy.tool_parser import K2Markers

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,12}"  # a newline and 3 levels of 2-space, or 2 of 4-space, indent + 3
JSON_OPTIONS = {"none": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
                "flexible": {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}}
MAX_PARALLEL_CALLS = 16
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_FREE_TEXT = r"/(?s:.)+/"  # any UTF-8 text; special tokens never match a regex
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # "parameters" omitted
_MAX_LOCATE_CHECKS = 256  # validations spent on finding where in a schema an error is


class SchemaError(ValueError):
    """A JSON Schema llguidance cannot enforce or that is invalid. ``path`` says where, in the
    request (``tools[1].function.parameters.properties.when``); ``message`` says what."""

    def __init__(self, message: str, path: str):
        super().__init__(f"{path}: {message}")
        self.message, self.path = message, path


# ---- JSON Schema → %json -------------------------------------------------------------------------

def _with_options(schema: dict, strict: bool, whitespace: str = "none") -> dict:
    return {**schema, "x-guidance": {**JSON_OPTIONS[whitespace], "lenient": not strict}}


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any, *, close: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists ``properties`` and says
    nothing of other keys (module docstring); ``close=False`` leaves this level open (an ``allOf``
    member). A new value, the argument untouched."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties") and isinstance(value, dict):
            out[key] = {k: close_objects(v) for k, v in value.items()}
        elif key == "allOf" and isinstance(value, list):  # each member's keys are the others' too
            out[key] = [close_objects(m, close=False) for m in value]
        elif key in ("items", "additionalItems", "contains", "anyOf", "oneOf", "prefixItems", "then", "else",
                     "additionalProperties", "unevaluatedItems"):
            out[key] = close_objects(value)
        else:
            out[key] = value
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS) \
            and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _schema_problem(schema: dict, strict: bool) -> str:
    """llguidance's error for ``schema`` alone ("" when it compiles); no tokenizer needed."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema, strict))
    except ValueError as e:  # not serialisable as JSON
        return str(e)
    return llguidance.LLMatcher.validate_grammar(grammar)


def _subschemas(schema: dict) -> list[tuple[str, Any]]:
    """(path suffix, subschema) for every place a JSON Schema nests schemas."""
    out: list[tuple[str, Any]] = []
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            out += [(f".{key}.{name}", sub) for name, sub in schema[key].items()]
    for key in ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if",
                "then", "else", "unevaluatedProperties", "unevaluatedItems"):
        if isinstance(schema.get(key), dict):
            out.append((f".{key}", schema[key]))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
        if isinstance(schema.get(key), list):
            out += [(f".{key}[{i}]", sub) for i, sub in enumerate(schema[key])]
    return out


def _unimplemented(message: str) -> list[str] | None:
    head, sep, keys = message.partition("Unimplemented keys: ")
    if not sep or head:
        return None
    try:
        names = json.loads(keys)
    except ValueError:
        return None
    return [str(k) for k in names] if isinstance(names, list) else None


def _same_problem(parent: str, child: str) -> bool:
    if not child:
        return False
    if child == parent:
        return True
    keys, child_keys = _unimplemented(parent), _unimplemented(child)
    return keys is not None and child_keys is not None and set(child_keys) <= set(keys)


def _locate(schema: dict, message: str, path: str, strict: bool, budget: list[int]) -> tuple[str, str]:
    """Descend to the deepest subschema that fails alone with the same problem. A subschema that
    fails only because it was cut from its root (a ``$ref`` to the root's ``$defs``) fails
    differently and is not followed, so the path may stop at its parent."""
    for suffix, sub in _subschemas(schema):
        if not isinstance(sub, dict) or budget[0] <= 0:
            continue
        budget[0] -= 1
        problem = _schema_problem(sub, strict)
        if _same_problem(message, problem):
            return _locate(sub, problem, path + suffix, strict, budget)
    return message, path


def _readable(message: str) -> str:
    keys = _unimplemented(message)
    if keys is None:
        return message
    listed = ", ".join(repr(k) for k in keys)
    return f"unsupported keyword{'s' if len(keys) > 1 else ''} {listed} (llguidance cannot enforce it)"


def check_schema(schema: Any, path: str, *, strict: bool, whitespace: str = "none") -> dict:
    """The schema as it will be embedded (its objects closed, our ``x-guidance`` options set), or a
    :class:`SchemaError` naming the deepest subschema at fault and the keyword."""
    if not isinstance(schema, dict):
        raise SchemaError(f"must be a JSON Schema object, got {type(schema).__name__}", path)
    problem = _schema_problem(schema, strict)
    if problem:
        message, where = _locate(schema, problem, path, strict, [_MAX_LOCATE_CHECKS])
        raise SchemaError(_readable(message), where)
    return _with_options(close_objects(schema), strict, whitespace)


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps(schema, separators=(",", ":"))


# ---- thinking ------------------------------------------------------------------------------------

def _think_rules(markers: K2Markers | None, think: bool) -> list[str]:
    """The rules of ``think`` (reasoning then ``</think>``), empty when ``think`` is False."""
    if not think:
        return []
    if markers is None or not markers.has_think:
        raise ValueError("think=True needs the tokenizer's <think> and </think> special tokens; these markers "
                         "have none")
    return [f"think: <[{markers.think_begin}]>? REASONING? <[{markers.think_end}]>",
            f"REASONING: {_FREE_TEXT}"]


def _grammar(start: str, rules: list[str], think_rules: list[str]) -> str:
    if think_rules:
        start = f"think {start}"
    return "\n".join(["%llguidance {}", f"start: {start}", *think_rules, *rules]) + "\n"


# ---- response_format -----------------------------------------------------------------------------

def response_format_grammar(response_format: dict, *, markers: K2Markers | None = None,
                            think: bool = False, whitespace: str = "none") -> str | None:
    """The grammar for OpenAI's ``response_format``: ``{"type": "text"}`` → None (unconstrained);
    ``{"type": "json_object"}`` → any JSON object; ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}`` → JSON following the schema (no ``schema``: any JSON value). ``think``
    (with ``markers`` carrying the think ids): reasoning first, the JSON after ``</think>``."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = check_schema({"type": "object"}, "response_format", strict=True, whitespace=whitespace)
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
        strict = spec.get("strict") is True
        schema = check_schema(spec.get("schema", {}), "response_format.json_schema.schema", strict=strict,
                              whitespace=whitespace)
    else:
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    return _grammar("answer", [f"answer: {_json_rule(schema)}"], _think_rules(markers, think))


# ---- tool calls ----------------------------------------------------------------------------------

def _functions(tools: list[dict], whitespace: str = "none") -> list[tuple[str, dict, bool]]:
    """(name, checked parameters schema, strict) per tool; ValueError names the tool and field."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    out: list[tuple[str, dict, bool]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.200}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, '_', '-', got {name!r}")
        if any(name == seen for seen, _, _ in out):
            raise ValueError(f"{where}.function.name {name!r} appears twice in tools")
        strict = fn.get("strict") is True
        params = _NO_ARGUMENTS if fn.get("parameters") is None else fn["parameters"]
        path = f"{where}.function.parameters"
        if isinstance(params, dict) and "type" not in params:
            params = {**params, "type": "object"}  # arguments are always a JSON object
        if isinstance(params, dict) and params["type"] != "object":
            raise SchemaError(f"must describe a JSON object (type 'object'), got type {params['type']!r}",
                              path + ".type")
        out.append((name, check_schema(params, path, strict=strict, whitespace=whitespace), strict))
    return out


def _chosen(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    """("auto" | "required" | "none", None) or ("function", the named function's name)."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "required", "none"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r:.200}")
    if fn["name"] not in names:
        raise ValueError(f"tool_choice.function.name {fn['name']!r} is not among the tools {names}")
    return "function", fn["name"]


def _section_rules(functions: list[tuple[str, dict, bool]], max_calls: int, first_index: int,
                   markers: K2Markers) -> list[str]:
    """``section``: the section markers around 1..max_calls calls; call k has id ``:first_index+k``.
    Each function's arguments rule is shared by every call position."""
    m = markers
    rules = [f"section: <[{m.section_begin}]> calls_0 <[{m.section_end}]>"]
    for k in range(max_calls):
        more = f" calls_{k + 1}?" if k + 1 < max_calls else ""
        rules.append(f"calls_{k}: call_{k}{more}")
        heads = " | ".join(f"{json.dumps(f'functions.{name}:{first_index + k}')} <[{m.argument_begin}]> args_{j}"
                           for j, (name, _, _) in enumerate(functions))
        rules.append(f"call_{k}: <[{m.call_begin}]> ({heads}) <[{m.call_end}]>")
    rules += [f"args_{j}: {_json_rule(schema)}" for j, (_, schema, _) in enumerate(functions)]
    return rules


def tool_call_grammar(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool, first_index: int,
                      markers: K2Markers, *, think: bool = False, whitespace: str = "none") -> str | None:
    """The grammar for a chat turn with ``tools``, in K2's wire format (module docstring for the
    policies); None when the output is not constrained. ``first_index``: the number of tool calls
    already in the conversation (the first new call's IDX)."""
    if not isinstance(first_index, int) or isinstance(first_index, bool) or first_index < 0:
        raise ValueError(f"first_index must be an integer >= 0, got {first_index!r}")
    if tool_choice == "none":
        return None
    if not tools:
        if _chosen(tool_choice, [])[0] != "auto":
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return None
    functions = _functions(tools, whitespace)
    kind, name = _chosen(tool_choice, [f[0] for f in functions])
    if kind == "function":
        functions = [f for f in functions if f[0] == name]
    max_calls = MAX_PARALLEL_CALLS if parallel_tool_calls and kind != "function" else 1
    rules = _section_rules(functions, max_calls, first_index, markers)
    if kind == "auto":
        return _grammar("TEXT? section?", [f"TEXT: {_FREE_TEXT}", *rules], _think_rules(markers, think))
    return _grammar("section", rules, _think_rules(markers, think))
