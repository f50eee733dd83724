"""K2 as an agent's endpoint through the serving app and the official `openai` client (issue 24,
Must show 2, 3 and 5): tool calls in K2's wire format with `tool_choice` named and required, the
arguments enforced by the grammar, streamed and not, and a second turn with the results; structured
output (`response_format`); reasoning on the thinking preset. The weights are random, so every
check is one a nonsense-writing model can only pass through the grammar and the parser.

In one process, no Ray (tests/deploy/inproc.py): two in-process apps, kimi-k2-tiny and
kimi-k2-thinking-tiny (K2-Thinking's template), both seed 6 as on Serve before, the same Ingress and
engine server over the in-process executor (the real attention worker, every routed expert here).
Nothing here needs the cluster: these are the Ingress's and the output processor's semantics; that
the served app on Ray answers as the model does in one process is checked on Ray (test_live.py's
greedy completion against `moeray generate`, test_cli.py's three-node cluster against one process).
"""

import asyncio
import json

import jsonschema
import openai
import pytest

from inproc import post, preset, serve

KEY = "agent-key"
THINK_END = 791  # </think> in the presets' tokenizer (K2-Thinking's 163607)
SEEDS = range(20)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["query"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 16},
    "attendees": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                              "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
             "required": ["day", "hour"], "additionalProperties": False}},
    "required": ["title", "attendees", "when"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "create_event": EVENT}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
         for n, s in SCHEMAS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris, and book lunch with Ana."}]
REPORT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 20},
    "status": {"enum": ["ok", "degraded", "down"]},
    "checks": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "passed": {"type": "boolean"}},
        "required": ["name", "passed"], "additionalProperties": False}},
    "owner": {"type": "object", "properties": {"team": {"type": "string", "maxLength": 10},
                                               "pager": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["team"], "additionalProperties": False}},
    "required": ["title", "status", "checks", "owner"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers():
    """Two in-process apps: kimi-k2-tiny and kimi-k2-thinking-tiny (K2-Thinking's template), on
    the settings the Serve apps had."""
    settings = dict(attention=1, experts=1, api_key=KEY, max_num_seqs=32, max_tokens_per_step=512, num_blocks=1024)
    with serve(preset("kimi-k2-tiny", seed=6), served_model_name="k2", **settings) as k2, \
            serve(preset("kimi-k2-thinking-tiny", seed=6), served_model_name="k2t", **settings) as k2t:
        yield {"k2": k2, "k2t": k2t}


def _client(server, cls=openai.OpenAI):
    return cls(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _gather(server, kwargs_list, stream):
    """Every request at once (one batch in the engine); the assembled messages and finish reasons."""
    async def one(client, kw):
        if not stream:
            r = await client.chat.completions.create(**kw)
            c = r.choices[0]
            return c.message.model_dump(), c.finish_reason
        return _assemble([chunk async for chunk in await client.chat.completions.create(**kw, stream=True)])

    async def run():
        async with _client(server, openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(one(client, kw) for kw in kwargs_list))

    return asyncio.run(run())


def _assemble(chunks):
    """A streamed answer, assembled as an OpenAI client does: per call, the first delta carries its
    id, type and name; later ones append argument fragments."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or ():
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "type": "function",
                                       "function": {"name": tc.function.name, "arguments": ""}}
                else:
                    assert tc.function.name is None
                calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    msg = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)] or None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg, finish


def _check_calls(msg, finish, allowed, first_index=0):
    assert finish == "tool_calls", (finish, msg)
    calls = msg["tool_calls"]
    assert calls and msg.get("content") in (None, "")
    for k, call in enumerate(calls):
        name = call["function"]["name"]
        assert name in allowed and call["type"] == "function"
        assert call["id"] == f"functions.{name}:{first_index + k}"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_are_valid_for_every_seed(servers, choice, stream):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "create_event"}}
    kws = [dict(model="k2", messages=USER, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=s,
                parallel_tool_calls=False, max_tokens=600) for s in SEEDS]  # parallel calls: the test below
    names = set()
    for msg, finish in _gather(servers["k2"], kws, stream):
        calls = _check_calls(msg, finish, {"create_event"} if choice == "named" else set(SCHEMAS))
        names |= {c["function"]["name"] for c in calls}
        assert len(calls) == 1
    if choice == "required":
        assert len(names) > 1  # the grammar allows every tool, the seeds pick different ones


def test_streamed_calls_equal_the_whole_answer(servers):
    kws = [dict(model="k2", messages=USER, tools=TOOLS, tool_choice="required", temperature=1.0, seed=s,
                max_tokens=1500) for s in range(4)]
    whole = _gather(servers["k2"], kws, False)
    streamed = _gather(servers["k2"], kws, True)
    for (w, wf), (s, sf) in zip(whole, streamed):
        assert wf == sf and w["tool_calls"] == s["tool_calls"] and (w["content"] or None) == s["content"]
        _check_calls(w, wf, set(SCHEMAS))
    assert max(len(w["tool_calls"]) for w, _ in whole) > 1  # parallel calls, each with its own id


def test_a_second_turn_with_the_results_is_answered(servers):
    client = _client(servers["k2"])
    first = client.chat.completions.create(model="k2", messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=3, max_tokens=1500)
    msg = first.choices[0].message
    history = [*USER, msg.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "n": i})}
                for i, c in enumerate(msg.tool_calls)]
    second = client.chat.completions.create(model="k2", messages=history, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=4, max_tokens=1500)
    _check_calls(second.choices[0].message.model_dump(), second.choices[0].finish_reason, set(SCHEMAS),
                 first_index=len(msg.tool_calls))  # ids go on counting over the conversation
    free = client.chat.completions.create(model="k2", messages=history, tools=TOOLS, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert free.choices[0].finish_reason in ("length", "tool_calls")
    assert "<|" not in (free.choices[0].message.content or "")  # no marker or special token in content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_validates_for_every_seed(servers, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    kws = [dict(model="k2", messages=USER, response_format=rf, temperature=1.0, seed=s, max_tokens=800)
           for s in SEEDS]
    texts = set()
    for msg, finish in _gather(servers["k2"], kws, stream):
        assert finish == "stop", msg
        jsonschema.validate(json.loads(msg["content"]), REPORT)
        texts.add(msg["content"])
    assert len(texts) > 10


def test_json_object_always_parses(servers):
    # any object: a random model's strings have no bound, so a few seeds run to max_tokens (OpenAI: a JSON
    # answer cut off by the length limit is incomplete); every answer that ends parses
    kws = [dict(model="k2", messages=USER, response_format={"type": "json_object"}, temperature=1.0, seed=s,
                max_tokens=600) for s in SEEDS]
    parsed = 0
    for msg, finish in _gather(servers["k2"], kws, False):
        if finish == "stop":
            assert isinstance(json.loads(msg["content"]), dict)
            parsed += 1
        else:  # cut off by max_tokens: still the start of an object
            assert finish == "length" and msg["content"].lstrip().startswith("{")
    assert parsed >= len(SEEDS) * 2 // 3


@pytest.mark.parametrize("rf,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "strng"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}, "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}, "nope"),
])
def test_a_bad_schema_is_a_400_naming_it(servers, rf, needle):
    r = post(servers["k2"], "/v1/chat/completions", {"model": "k2", "messages": USER, "response_format": rf}, KEY,
             timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_split_from_the_answer_on_the_thinking_preset(servers, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    # a random model rarely writes </think> by itself: a bias makes it close within a few tokens
    kws = [dict(model="k2t", messages=USER, response_format=rf, temperature=1.0, seed=s, max_tokens=400,
                logit_bias={str(THINK_END): 3.5}) for s in range(8)]
    reasoned = 0
    for msg, finish in _gather(servers["k2t"], kws, stream):
        # the grammar lets the model think, close </think>, then answer: the answer alone is content
        assert finish == "stop", msg
        jsonschema.validate(json.loads(msg["content"]), WEATHER)
        reasoned += bool(msg.get("reasoning_content"))
        assert "think>" not in (msg.get("reasoning_content") or "") + msg["content"]
    assert reasoned >= 2  # and what came before </think> is reasoning
    plain = _gather(servers["k2t"], [dict(model="k2t", messages=USER, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})], stream)
    msg, _ = plain[0]
    assert msg.get("reasoning_content") and not msg.get("content")  # never closed: all of it is reasoning
    off = _gather(servers["k2t"], [dict(model="k2t", messages=USER, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})],
                  stream)
    msg, _ = off[0]
    assert msg["content"] and not msg.get("reasoning_content")  # thinking off: the template closed it


def test_reasoning_in_history_is_rendered(servers):
    """A reasoning_content sent back in an unfinished turn reaches the prompt (the thinking template
    keeps it); /tokenize shows the prompt the chat route would use."""
    history = [*USER, {"role": "assistant", "content": None, "reasoning_content": "look up the weather",
                       "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                       "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    r = post(servers["k2t"], "/tokenize", {"model": "k2t", "messages": history}, KEY, timeout=60)
    assert r.status_code == 200, r.text
    detok = post(servers["k2t"], "/detokenize", {"model": "k2t", "tokens": r.json()["tokens"]}, KEY,
                 timeout=60).json()["prompt"]
    assert "look up the weather" in detok and "## Return of functions.get_weather:0" in detok
