"""The serving-config reference, docs/configuration.md, generated from :class:`~deploy.config.ServeConfig`.

    python -m deploy.config_doc           # print the markdown
    python -m deploy.config_doc --write   # write docs/configuration.md

Owns: turning a pydantic model's fields (name, type, default, constraints, description, and nested
models, each in a table of its own) into markdown, and which ``moeray up`` flag sets each key (read
from the command's signature). Never: describes a key by hand (edit the model's fields, then
regenerate), or documents a type or constraint it does not know (it raises rather than leave one out).
``tests/test_docs.py`` fails when docs/configuration.md differs from :func:`render`'s text.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel

from .config import ServeConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "python -m deploy.config_doc --write"

INTRO = """\
# Serving configuration

<!-- Generated from deploy/config.py (ServeConfig) by `{regenerate}`.
Edit the model, not this file: tests/test_docs.py fails when the two differ. -->

Every setting of a deployment is a key of one pydantic model, `ServeConfig`
([deploy/config.py](../deploy/config.py)), read once at the edge and handed down as frozen
dataclasses (`EngineConfig` in [cluster/config.py](../cluster/config.py), `ClusterSpec` in
[cluster/spec.py](../cluster/spec.py)). The deployment's own keys (model, shape, HTTP, keys) are
declared in `ServeConfig`; each engine knob is declared once, in the group of the part of the
engine that reads it (scheduler, cache, faults, elastic, data plane: the "read by" column), and
the serving config takes its key, bound and description from there. The keys stay flat in the
YAML. It arrives by one of three doors:

- `moeray up --config FILE.yaml`: a YAML mapping of these keys; the flags in the `moeray up` flag
  column override the file, and with no file they are the whole config;
- `serve deploy` / `serve run` of a Serve config such as
  [deploy/serve_config.yaml](../deploy/serve_config.yaml) or
  [deploy/serve_config.gpu.yaml](../deploy/serve_config.gpu.yaml): the keys are the application's
  `args` (`import_path: deploy.app:build_app`), as in the KubeRay
  [RayService](../deploy/kuberay-rayservice.yaml);
- Python: `ServeConfig.parse({{...}})` or `ServeConfig.from_yaml(path, **overrides)`.

{strict}A value outside its type or constraints is refused before anything starts, with a message
that names the key.
"""


def render(model: type[BaseModel] = ServeConfig) -> str:
    """The whole of docs/configuration.md: the introduction, then one table per model, ``model``
    first and every nested model after it (keys of a nested model as ``parent.child``)."""
    strict = "Unknown keys are an error (`extra=\"forbid\"`).\n" if model.model_config.get("extra") == "forbid" else ""
    parts = [INTRO.format(regenerate=REGENERATE, strict=strict)]
    tables = {model: ""}  # model → the key it is first found under, in reading order
    for prefix, m in _nested(model):
        tables.setdefault(m, prefix)
    anchors = {m: _slug(_title(prefix, m)) for m, prefix in tables.items()}
    for m, prefix in tables.items():
        parts.append(_table(prefix, m, anchors, _up_flags() if m is ServeConfig else {}))
    return "\n".join(parts)


def _table(prefix: str, model: type[BaseModel], anchors: dict, flags: dict[str, str]) -> str:
    rows = ["## " + _title(prefix, model), ""]
    if model.__doc__:
        rows += [inspect.cleandoc(model.__doc__), ""]
    rows += ["| key | type | default | allowed | `moeray up` flag | read by | description |",
             "|---|---|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        default = "(required)" if field.is_required() else f"`{_value(field.get_default(call_default_factory=True))}`"
        flag = f"`{flags[name]}`" if name in flags else ""
        part = (field.json_schema_extra or {}).get("engine") if isinstance(field.json_schema_extra, dict) else None
        cells = [f"`{key}`", _type(field.annotation, anchors), default, _constraints(key, field.metadata), flag,
                 f"engine: {part}" if part else "deployment", _text(field.description or "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _text(text: str) -> str:
    """Prose for a table cell: outside code spans, a ``<`` that would open an HTML tag is escaped
    (``'Bearer <key>'`` must not vanish as an unknown tag)."""
    parts = text.split("`")
    return "`".join(re.sub(r"<(?=[A-Za-z/])", "&lt;", p) if i % 2 == 0 else p for i, p in enumerate(parts))


def _type(tp, anchors: dict) -> str:
    """A type as a YAML user reads it: ``int``, ``list of str``, ``int or null``, ``one of `a`, `b```."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{_value(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a, anchors) for a in args)
    if origin in (list, tuple, set, frozenset):
        return f"list of {_type(args[0], anchors)}" if args else "list"
    if origin is dict:
        return f"mapping of {_type(args[0], anchors)} to {_type(args[1], anchors)}" if args else "mapping"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"[{tp.__name__}](#{anchors[tp]})"
    if isinstance(tp, type):
        return tp.__name__
    raise ValueError(f"config_doc: cannot document the type {tp!r}")


def _models_in(tp) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models_in(a)]


def _nested(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(key, model) of every model nested in ``model``, depth first, in field order."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        for m in _models_in(field.annotation):
            out += [(key, m)] + _nested(m, key)
    return out


def _title(prefix: str, model: type[BaseModel]) -> str:
    return "Keys" if not prefix else f"`{prefix}`: {model.__name__}"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


CONSTRAINTS = {at.Ge: ("ge", ">= {}"), at.Gt: ("gt", "> {}"), at.Le: ("le", "<= {}"), at.Lt: ("lt", "< {}"),
               at.MultipleOf: ("multiple_of", "multiple of {}"), at.MinLen: ("min_length", "at least {} items"),
               at.MaxLen: ("max_length", "at most {} items")}


def _constraints(key: str, metadata: list) -> str:
    out = []
    for m in metadata:
        kind = CONSTRAINTS.get(type(m))
        if kind is None:
            raise ValueError(f"config_doc: {key} has a constraint this generator cannot document: {m!r}")
        attr, text = kind
        out.append(text.format(_value(getattr(m, attr))))
    return ", ".join(out)


def _value(v) -> str:
    """A value as YAML writes it (``null``, ``true``, ``kimi-k2-tiny``, ``[a, b]``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, BaseModel):
        return _value(v.model_dump())
    return str(v)


def _up_flags() -> dict[str, str]:
    """Config key → the ``moeray up`` option that sets it (an option named like a key sets that key)."""
    from .cli_serving import up

    fields = ServeConfig.model_fields
    out = {}
    for name, param in inspect.signature(up).parameters.items():
        if name in fields:
            decls = [d for d in getattr(param.default, "param_decls", ()) or () if d.startswith("--")]
            out[name] = decls[0] if decls else "--" + name.replace("_", "-")
    return out


def main(argv: list[str]) -> int:
    if argv not in ([], ["--write"]):
        print("usage: python -m deploy.config_doc [--write]  (prints docs/configuration.md, or writes it)",
              file=sys.stderr)
        return 2
    text = render()
    if argv == ["--write"]:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
        print(f"wrote {DOC}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
