"""The trained preset kimi-k2-mini calls tools (issue 35 Must show 1), through the served app (in one
process, tests/deploy/inproc.py) with the real ``openai`` client: the README's weather tools,
``tool_choice: "auto"``, temperature 0.7, 20 seeded requests naming a city. At least 15 must come
back as a parsed ``tool_calls`` entry for ``get_weather`` whose arguments are valid under the tool's
JSON schema and name the user's city; then, with the tool's result sent back (a temperature the
model cannot know), at least 15 answers must quote that temperature.

The same again held out (test_held_out_tool_results_and_phrasings_are_quoted): questions phrased as
the corpus never phrases them and results in shapes it never writes (other key names for the
temperature, nesting, other fields and key orders, other condition words, Fahrenheit); at least 15
call get_weather for the user's city, and at least 15 answers quote the result's number and name the
user's city. A greeting with no tools declared is answered in words. That the corpus
never has them is checked here too, on the training corpus as scripts/train_preset.py generates it.

Nothing here is constrained: ``tool_choice: "auto"`` lets the model answer in words, and the app
parses what it writes. A model that names a city from memory (what every earlier run of the
training did, docs/trained_preset.md) scores about 1 in 143 on the first count."""

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from inproc import serve
from training.corpus import CITIES, WEATHER_TOOLS, conversations, single_requests
from model.presets import build_preset

N, NEEDED = 20, 15
SCHEMA = WEATHER_TOOLS[0]["function"]["parameters"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = build_preset("kimi-k2-mini", tmp_path_factory.mktemp("mini") / "kimi-k2-mini", progress=False)
    with serve(path, served_model_name="kimi-k2-mini") as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _request(i: int) -> tuple[str, int]:
    """The i-th seeded request: the city the user names, the temperature the tool will report."""
    r = random.Random(i)
    return r.choice(CITIES), r.randint(-10, 35)


def _one(client: openai.OpenAI, i: int) -> dict:
    city, temperature = _request(i)
    messages = [{"role": "user", "content": f"What's the weather like in {city}?"}]
    common = dict(model="kimi-k2-mini", tools=WEATHER_TOOLS, tool_choice="auto", temperature=0.7, seed=i,
                  max_tokens=64)
    first = client.chat.completions.create(messages=messages, **common).choices[0]
    out = {"i": i, "city": city, "temperature": temperature, "finish": first.finish_reason,
           "content": first.message.content, "call": None, "args": None, "valid": False}
    calls = first.message.tool_calls or []
    if calls:
        out["call"] = calls[0].function.name
        try:
            out["args"] = json.loads(calls[0].function.arguments)
            jsonschema.validate(out["args"], SCHEMA)
            out["valid"] = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    # The agent runs the tool for the city the user named and sends its result back.
    call_id = calls[0].id if calls else "functions.get_weather:0"
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(
            {"city": city, "temperature": temperature, "unit": "celsius", "condition": "sunny"})},
    ]
    out["answer"] = client.chat.completions.create(messages=messages, **common).choices[0].message.content or ""
    return out


def test_tool_choice_auto_calls_the_weather_tool_for_the_users_city_and_quotes_its_result(client):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _one(client, i), range(N)))
    for r in results:
        print(json.dumps(r))
    right = [r for r in results if r["call"] == "get_weather" and r["valid"] and r["args"]["city"] == r["city"]]
    quoted = [r for r in results if str(r["temperature"]) in r["answer"]]
    named = [r for r in results if r["city"] in r["answer"]]  # not another city, from memory
    print(f"right tool, schema-valid, the user's city: {len(right)}/{N}; answers quoting the result: {len(quoted)}/{N}; "
          f"answers naming the user's city: {len(named)}/{N}")
    assert len(right) >= NEEDED, results
    assert len(quoted) >= NEEDED, results
    assert len(named) >= NEEDED, results


GREETINGS = ("Hi!", "Hello!", "Good morning!", "Hey there, how are you doing?")  # the last one the corpus never has


@pytest.mark.parametrize("greeting", GREETINGS)
def test_a_greeting_with_no_tools_declared_is_answered_in_words(client, greeting):
    """The README's first request ("Hi!", no tools, greedy) is answered in words: no call parsed, none
    written out as text (an earlier retraining, whose single requests all called a tool with no tools
    declared, answered "Hi!" with `functions.get_weather:0{"city": "Lusaka"}`)."""
    reply = client.chat.completions.create(model="kimi-k2-mini", messages=[{"role": "user", "content": greeting}],
                                           max_tokens=32, temperature=0).choices[0]
    text = reply.message.content or ""
    print(f"{greeting!r} -> {text!r}")
    assert not reply.message.tool_calls and reply.finish_reason == "stop", reply
    assert "functions." not in text and "{" not in text and re.search(r"[A-Za-z]{2,}", text), text


# ---------------------------------------------------------------- held out: shapes and phrasings the corpus never has
#
# The weather tool's result in shapes the training corpus (training/corpus.py) never writes (key names for the
# temperature it never uses, nesting, extra fields, other key orders, condition words and units of its
# own), asked for in phrasings the corpus never uses. They live here only;
# test_the_corpus_never_has_the_held_out_shapes_or_phrasings checks that the generator never produces them.
# Each builder takes (city, temperature in °C, rng) and returns (the result, the number an answer must quote).

HELD_OUT_QUESTIONS = (
    "I'm heading to {city} later. How warm is it there?",
    "Could you check the conditions in {city} for me?",
    "Any idea what it's like outside in {city} at the moment?",
    "Should I bring a jacket in {city}?",
    "Quick check: {city}, how hot or cold?",
    "What are the conditions like in {city} this morning?",
)
HELD_OUT_CONDITIONS = ("overcast", "drizzle", "hazy", "sleet", "partly cloudy", "humid")
HELD_OUT_KEYS = ("temp_c", "degrees", "reading", "current", "degrees_f", "sky", "outlook", "station", "observed", "location",
                 "place", "scale", "units", "wind")


def _fahrenheit(c: int) -> int:
    return round(c * 9 / 5 + 32)


HELD_OUT_SHAPES = (
    lambda city, t, r: ({"location": city, "temp_c": t, "sky": r.choice(HELD_OUT_CONDITIONS)}, t),
    lambda city, t, r: ({"current": {"temperature": t, "condition": r.choice(HELD_OUT_CONDITIONS)}, "city": city}, t),
    lambda city, t, r: ({"degrees": t, "scale": "C", "place": city, "outlook": r.choice(HELD_OUT_CONDITIONS)}, t),
    lambda city, t, r: ({"station": f"{city} airport", "reading": t, "units": "celsius"}, t),
    lambda city, t, r: ({"sky": r.choice(HELD_OUT_CONDITIONS), "wind": "light", "city": city, "temp_c": t}, t),
    lambda city, t, r: ({"observed": {"city": city, "degrees_f": _fahrenheit(t)}}, _fahrenheit(t)),
)


def _held_out(i: int) -> tuple[str, str, str, int]:
    """The i-th seeded held-out request: (city, question, the tool's result as JSON, the number to quote)."""
    r = random.Random(1_000 + i)
    city, t = r.choice(CITIES), r.randint(-10, 35)
    question = HELD_OUT_QUESTIONS[i % len(HELD_OUT_QUESTIONS)].format(city=city)
    result, number = HELD_OUT_SHAPES[i % len(HELD_OUT_SHAPES)](city, t, r)
    return city, question, json.dumps(result), number


def _quotes(answer: str, number: int) -> bool:
    """Whether ``answer`` writes ``number`` as a number of its own (not inside another, not with a sign it lacks)."""
    return re.search(rf"(?<![\d.\-−]){re.escape(str(number))}(?![\d])", answer) is not None


def _one_held_out(client: openai.OpenAI, i: int) -> dict:
    city, question, result, number = _held_out(i)
    messages = [{"role": "user", "content": question}]
    common = dict(model="kimi-k2-mini", tools=WEATHER_TOOLS, tool_choice="auto", temperature=0.7, seed=i,
                  max_tokens=64)
    first = client.chat.completions.create(messages=messages, **common).choices[0]
    calls = first.message.tool_calls or []
    out = {"i": i, "city": city, "question": question, "result": result, "number": number,
           "content": first.message.content, "call": calls[0].function.name if calls else None, "args": None}
    if calls:
        try:
            out["args"] = json.loads(calls[0].function.arguments)
        except json.JSONDecodeError:
            pass
    call_id = calls[0].id if calls else "functions.get_weather:0"
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]
    out["answer"] = client.chat.completions.create(messages=messages, **common).choices[0].message.content or ""
    return out


def _corpus_texts():
    """Every message of the training corpus as scripts/train_preset.py generates it at its default
    sizes: transcripts of seed 0, single requests of seed 20 000 (the first stage's in the corpus's
    first version, the second stage's varied, of which it keeps those that fit a row: more than drawn here)."""
    for messages, _tools, _think in conversations(0, 8000):
        yield from messages
    for messages in single_requests(20_000, 20_000, varied=False):
        yield from messages
    for messages in single_requests(20_000, 30_000):
        yield from messages


def test_the_corpus_never_has_the_held_out_shapes_or_phrasings():
    fragments = {part for q in HELD_OUT_QUESTIONS for part in q.split("{city}") if len(part.strip()) >= 6}
    conditions = {f'"{c}"' for c in HELD_OUT_CONDITIONS}
    keys = {f'"{k}":' for k in HELD_OUT_KEYS}
    seen_users = seen_results = 0
    for m in _corpus_texts():
        text = m["content"]
        if m["role"] == "user":
            seen_users += 1
            assert not [f for f in fragments if f in text], text
        elif m["role"] == "tool":
            seen_results += 1
            assert not [k for k in keys | conditions if k in text], text
    assert seen_users > 50_000 and seen_results > 50_000
    for i in range(N):  # every held-out result does hold a held-out key
        assert [k for k in keys if k in _held_out(i)[2]], _held_out(i)


def test_held_out_tool_results_and_phrasings_are_quoted(client):
    """The held-out phrasings call get_weather for the user's city, and the answers quote the held-out
    result's number and name the user's city (the weights before the corpus's weather-now asks called
    get_weather 14 times in 20: six went to get_forecast, for "the conditions ... this morning" and
    "heading to Boston later")."""
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: _one_held_out(client, i), range(N)))
    for r in results:
        print(json.dumps(r))
    right = [r for r in results if r["call"] == "get_weather" and (r["args"] or {}).get("city") == r["city"]]
    for_city = [r for r in results if r["call"] and (r["args"] or {}).get("city") == r["city"]]
    quoted = [r for r in results if _quotes(r["answer"], r["number"])]
    named = [r for r in results if r["city"] in r["answer"]]
    print(f"held out: get_weather for the user's city {len(right)}/{N} (a tool for the user's city {len(for_city)}/{N}); "
          f"answers quoting the result's number {len(quoted)}/{N}; answers naming the user's city {len(named)}/{N}")
    assert len(right) >= NEEDED, results
    assert len(quoted) >= NEEDED, results
    assert len(named) >= NEEDED, results
