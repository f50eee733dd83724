"""deploy/structured.py's grammars, compiled by model/grammar.py for kimi-k2-tiny's tokenizer (1024
ids, K2's tool markers at 779-783, <think> </think> at 790/791) and driven by random logits: each
step masks seeded random logits, samples (argmax or multinomial), and feeds the id back, until an
end-of-turn id. Every output must then hold what the request asked: JSON that parses and validates
against its schema (``jsonschema``), or K2 tool calls that :func:`deploy.tool_parser.parse` reads
back with allowed names, valid arguments and ids counted from ``first_index``."""

import json

import jsonschema
import pytest
import torch

from deploy.structured import (MAX_PARALLEL_CALLS, SchemaError, response_format_grammar, tool_call_grammar)
from deploy.tool_parser import K2Markers, parse
from model.grammar import Grammars, lltokenizer
from model.tokenizer import SHIPPED_DIR, SHIPPED_VOCAB_SIZE, Tokenizer

V = SHIPPED_VOCAB_SIZE
SEEDS = range(20)
MAX_STEPS = 4000

PERSON = {
    "type": "object",
    "description": "text the %json embedding must carry through: } { // # \" \n ünï",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
            },
            "required": ["city", "geo"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "nickname": {"type": ["string", "null"], "maxLength": 8},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search-web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 5},
                                         "sites": {"type": "array", "items": {"enum": ["a.com", "b.org"]},
                                                   "maxItems": 2}},
        "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments are {}
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


@pytest.fixture(scope="module")
def markers(tok) -> K2Markers:
    m = K2Markers.from_tokenizer(tok)
    assert (m.section_begin, m.call_end, m.think_begin, m.think_end) == (779, 783, 790, 791)
    return m


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    g = Grammars(lltokenizer(tok, V))
    yield g
    g.close()


def generate(grammars: Grammars, grammar: str, seed: int, *, multinomial: bool = False,
             bias: dict[int, float] | None = None) -> list[int]:
    """The ids a model with random logits writes under ``grammar``, the end-of-turn id excluded.
    ``bias`` is added to the random logits (a model that likes some ids), before the mask."""
    matcher, gen = grammars.matcher(grammar), torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(MAX_STEPS):
        logits = 3 * torch.randn(1, V, generator=gen)
        for token_id, value in (bias or {}).items():
            logits[0, token_id] += value
        assert grammars.mask_logits([matcher], logits) == [], matcher.get_error()
        if multinomial:
            token_id = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        else:
            token_id = int(logits.argmax())
        assert grammars.consume([matcher], [token_id]) == [], matcher.get_error()
        if token_id in grammars.stop_ids:
            assert matcher.is_stopped()
            return out
        out.append(token_id)
    pytest.fail(f"seed {seed}: no end of turn after {MAX_STEPS} ids")


def allowed_ids(matcher) -> set[int]:
    return {i for i, b in enumerate(matcher.compute_logit_bias()) if b}


# ---- response_format ------------------------------------------------------------------------------

@pytest.mark.parametrize("multinomial", [False, True])
def test_json_schema_outputs_parse_and_validate(tok, grammars, multinomial):
    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    validator = jsonschema.Draft202012Validator(PERSON)
    outputs = set()
    for seed in SEEDS:
        text = tok.decode(generate(grammars, grammar, seed, multinomial=multinomial))
        value = json.loads(text)
        validator.validate(value)
        outputs.add(json.dumps(value, sort_keys=True))
    assert len(outputs) == len(SEEDS)  # random logits explore the schema rather than repeat one answer


def test_json_object_outputs_are_objects(tok, grammars):
    grammar = response_format_grammar({"type": "json_object"})
    for seed in SEEDS:
        ids = generate(grammars, grammar, seed, multinomial=True)
        assert isinstance(json.loads(tok.decode(ids)), dict), tok.decode(ids)


def test_text_is_unconstrained():
    assert response_format_grammar({"type": "text"}) is None
    with pytest.raises(ValueError, match="response_format.type"):
        response_format_grammar({"type": "yaml"})


def test_json_schema_after_reasoning(tok, grammars, markers):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
                                      markers=markers, think=True)
    start = allowed_ids(grammars.matcher(grammar))
    assert {markers.think_begin, markers.think_end} <= start and not start & set(grammars.stop_ids)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    for seed in range(5):
        ids = generate(grammars, grammar, seed, bias={markers.think_end: 8.0})
        result = parse(ids, decode, markers, tools_enabled=False, think=True)
        assert json.loads(result.content) == json.loads(tok.decode(ids[ids.index(markers.think_end) + 1:]))
        jsonschema.validate(json.loads(result.content), schema)


# ---- tool calls -----------------------------------------------------------------------------------

def check_calls(tok, markers, ids, first_index, allowed_names, *, think=False):
    """The calls as the parser reads them; each must be allowed, valid, and numbered in order."""
    result = parse(ids, lambda x: tok.decode(x, skip_special_tokens=True), markers, think=think)
    assert not result.finish.cut_off and result.finish.invalid_arguments == ()
    for k, call in enumerate(result.tool_calls):
        assert call.name in allowed_names
        assert call.id == f"functions.{call.name}:{first_index + k}"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return result


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_are_valid_and_numbered(tok, grammars, markers, parallel):
    grammar = tool_call_grammar(TOOLS, "required", parallel, 4, markers)
    assert allowed_ids(grammars.matcher(grammar)) == {markers.section_begin}  # no text before the section
    counts, names = set(), set()
    for seed in SEEDS:
        ids = generate(grammars, grammar, seed, multinomial=seed % 2 == 1)
        assert ids[0] == markers.section_begin and ids[-1] == markers.section_end
        result = check_calls(tok, markers, ids, 4, SCHEMAS)
        assert result.content is None and result.reasoning is None
        counts.add(len(result.tool_calls))
        names |= {c.name for c in result.tool_calls}
    assert names == set(SCHEMAS)
    assert counts == {1} if not parallel else min(counts) == 1 and max(counts) > 1


def test_named_tool_choice_calls_exactly_that_function(tok, grammars, markers):
    choice = {"type": "function", "function": {"name": "search-web"}}
    grammar = tool_call_grammar(TOOLS, choice, True, 0, markers)
    for seed in SEEDS:
        result = check_calls(tok, markers, generate(grammars, grammar, seed), 0, {"search-web"})
        assert len(result.tool_calls) == 1


def test_a_function_may_be_named_like_a_tool_choice_keyword(tok, grammars, markers):
    tools = [*TOOLS, {"type": "function", "function": {"name": "auto"}}]
    grammar = tool_call_grammar(tools, {"type": "function", "function": {"name": "auto"}}, True, 0, markers)
    result = parse(generate(grammars, grammar, 0), tok.decode, markers)
    (call,) = result.tool_calls
    assert call.id == "functions.auto:0" and json.loads(call.arguments) == {}


def test_auto_allows_text_then_the_section(tok, grammars, markers):
    grammar = tool_call_grammar(TOOLS, "auto", True, 2, markers)
    specials = allowed_ids(grammars.matcher(grammar)) & tok.special_token_ids
    assert specials == {markers.section_begin, *grammars.stop_ids}  # free text fakes no marker
    bias = {markers.section_begin: 6.0, **{i: 4.0 for i in grammars.stop_ids}}
    with_calls = with_text = 0
    for seed in SEEDS:
        ids = generate(grammars, grammar, seed, multinomial=True, bias=bias)
        result = check_calls(tok, markers, ids, 2, SCHEMAS)
        with_calls += bool(result.tool_calls)
        with_text += bool(result.content)
    assert with_calls and with_calls < len(SEEDS) and with_text


def test_thinking_then_tool_calls(tok, grammars, markers):
    grammar = tool_call_grammar(TOOLS, "required", True, 0, markers, think=True)
    for seed in range(8):
        ids = generate(grammars, grammar, seed, bias={markers.think_end: 8.0})
        result = check_calls(tok, markers, ids, 0, SCHEMAS, think=True)
        assert result.tool_calls and result.content is None
        assert ids.count(markers.think_end) == 1 and markers.think_begin not in ids[1:]


def test_unconstrained_cases_return_none(markers):
    non_strict = [t for t in TOOLS if not t["function"].get("strict")]
    assert tool_call_grammar(TOOLS, "none", True, 0, markers) is None
    assert tool_call_grammar([], "auto", True, 0, markers) is None
    assert tool_call_grammar(None, None, True, 0, markers) is None
    # "auto" without strict functions is constrained too, once the section opens
    assert tool_call_grammar(non_strict, "auto", True, 0, markers) == tool_call_grammar(non_strict, None, True, 0, markers)
    assert "TEXT? section?" in tool_call_grammar(non_strict, "auto", True, 0, markers)
    assert tool_call_grammar(non_strict, "required", True, 0, markers) is not None


def test_a_section_holds_at_most_max_parallel_calls(tok, grammars, markers):
    m = grammars.matcher(tool_call_grammar(TOOLS, "required", True, 7, markers))
    assert m.consume_token(markers.section_begin)
    for k in range(MAX_PARALLEL_CALLS):
        assert m.consume_token(markers.call_begin)
        wrong = tok.encode(f"functions.now:{7 + k + 1}")
        assert m.validate_tokens(wrong) < len(wrong)  # the IDX is exact
        assert m.consume_tokens(tok.encode(f"functions.now:{7 + k}")), m.get_error()
        assert m.consume_tokens([markers.argument_begin, *tok.encode("{}"), markers.call_end]), m.get_error()
    assert allowed_ids(m) == {markers.section_end}


def test_equal_requests_give_equal_grammars_compiled_once(grammars, markers):
    before = grammars.num_compiles
    texts = [tool_call_grammar(json.loads(json.dumps(TOOLS)), "required", True, 11, markers) for _ in range(3)]
    assert texts[0] == texts[1] == texts[2]
    for text in texts:
        grammars.matcher(text)
    assert grammars.num_compiles == before + 1


# ---- errors ---------------------------------------------------------------------------------------

def strict_tool(name: str, parameters: dict, strict: bool = True) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters, "strict": strict}}


def test_unsupported_keywords_name_the_keyword_and_the_path(markers):
    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(SchemaError) as e:
        tool_call_grammar([TOOLS[0], strict_tool("tagger", tags)], "required", True, 0, markers)
    assert str(e.value) == ("tools[1].function.parameters.properties.tags: unsupported keyword 'uniqueItems' "
                            "(llguidance cannot enforce it)")
    assert e.value.path == "tools[1].function.parameters.properties.tags"

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"not": {"type": "null"}}}}}}
    with pytest.raises(SchemaError, match=r"^response_format\.json_schema\.schema\.properties\.a\.properties\.b: "
                                          r"unsupported keyword 'not'"):
        response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    with pytest.raises(SchemaError, match=r"^response_format\.json_schema\.schema: unsupported keywords 'if', 'then'"):
        response_format_grammar({"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "if": {}, "then": {}}}})


def test_without_strict_unsupported_keywords_are_ignored_and_the_rest_holds(tok, grammars):
    n = {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}
    schema = {"type": "object", "properties": {"n": n},
              "required": ["n"], "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for seed in range(5):
        value = json.loads(tok.decode(generate(grammars, grammar, seed)))
        assert set(value) == {"n"} and 0 <= value["n"] <= 9


@pytest.mark.parametrize("parameters, path, message", [
    ({"type": "object", "properties": {"x": {"type": "strin"}}}, ".properties.x", "Invalid type: strin"),
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}, ".properties.x", "look-around"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, ".properties.x", "does not exist"),
    ({"type": "array", "items": {"type": "string"}}, ".type", "must describe a JSON object"),
    ([1, 2], "", "must be a JSON Schema object"),
])
@pytest.mark.parametrize("strict", [True, False])
def test_invalid_schemas_are_errors_either_way(markers, parameters, path, message, strict):
    with pytest.raises(SchemaError) as e:
        tool_call_grammar([TOOLS[2], strict_tool("f", parameters, strict)], "auto", True, 0, markers)
    assert e.value.path == "tools[1].function.parameters" + path and message in e.value.message


@pytest.mark.parametrize("tools, choice, error", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope' is not among the tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    ([], "required", "needs tools"),
    ([TOOLS[0], TOOLS[0]], "required", r"tools\[1\].function.name 'get_weather' appears twice"),
    ([strict_tool("bad name", {})], "required", r"tools\[0\].function.name must be"),
    ([{"type": "retrieval"}], "required", r"tools\[0\] must be"),
])
def test_bad_tool_requests_are_value_errors(markers, tools, choice, error):
    with pytest.raises(ValueError, match=error):
        tool_call_grammar(tools, choice, True, 0, markers)


def test_think_needs_think_markers_and_first_index_is_checked(markers):
    no_think = K2Markers(779, 780, 781, 782, 783)
    with pytest.raises(ValueError, match="think=True needs"):
        tool_call_grammar(TOOLS, "required", True, 0, no_think, think=True)
    with pytest.raises(ValueError, match="first_index"):
        tool_call_grammar(TOOLS, "required", True, -1, markers)
