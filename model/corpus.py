"""The training corpus of the trained preset (scripts/train_preset.py): agent transcripts, generated
offline from a seed and rendered through K2's chat template, plus free text from Python's standard
library. Nothing is downloaded; the same seed gives the same documents.

A transcript declares a few tools (JSON schemas), a user names an entity (a city, a file, a number, a
date); the assistant calls the tool that fits in K2's format (``functions.NAME:IDX``, JSON arguments
copying the user's entity), the tool's result comes back (``## Return of …``) and the answer quotes
it. Some requests need no tool and are answered at once though tools are declared (so that
``tool_choice: "auto"`` has something to choose); some run through the thinking template with a
``<think>`` block first. :data:`WEATHER_TOOLS` are the README's example tools.
"""

from __future__ import annotations

import inspect
import json
import math
import random
from dataclasses import dataclass
from typing import Callable, Iterator

from .chat_template import K2_THINKING_CHAT_TEMPLATE, compile_template, render
from .tokenizer import Tokenizer


def _tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required if required is not None else list(properties)}}}


S = {"type": "string"}
WEATHER_TOOLS = [
    _tool("get_weather", "Get the current weather in a city",
          {"city": {"type": "string", "description": "The city, e.g. Paris"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("get_forecast", "Get the weather forecast for the next days in a city",
          {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, ["city", "days"]),
]

CITIES = (
    "Paris London Berlin Madrid Rome Lisbon Vienna Prague Warsaw Budapest Athens Oslo Stockholm Helsinki "
    "Copenhagen Dublin Amsterdam Brussels Zurich Geneva Munich Hamburg Milan Naples Seville Porto Krakow "
    "Tallinn Riga Vilnius Reykjavik Edinburgh Manchester Lyon Marseille Istanbul Ankara Cairo Nairobi Lagos "
    "Accra Dakar Casablanca Tunis Johannesburg Tokyo Osaka Kyoto Seoul Busan Beijing Shanghai Shenzhen "
    "Chengdu Hangzhou Taipei Manila Jakarta Bangkok Hanoi Singapore Mumbai Delhi Chennai Kolkata Karachi "
    "Lahore Dhaka Kathmandu Tehran Dubai Doha Riyadh Baghdad Amman Beirut Sydney Melbourne Perth Brisbane "
    "Auckland Wellington Toronto Montreal Vancouver Calgary Ottawa Chicago Boston Seattle Denver Austin "
    "Houston Dallas Miami Atlanta Phoenix Portland Detroit Lima Quito Bogota Caracas Santiago Montevideo "
    "Havana Kingston Anchorage Honolulu Mexico Guadalajara Monterrey Tunis Algiers Tripoli Khartoum Kampala "
    "Kigali Lusaka Harare Maputo Luanda Windhoek Gaborone Antananarivo Colombo Yangon Almaty Tashkent Baku "
    "Tbilisi Yerevan Minsk Kyiv Odesa Sofia Bucharest Belgrade Zagreb Sarajevo Skopje Tirana Valletta Nicosia"
).split()
CITIES = tuple(dict.fromkeys(CITIES))  # in order, once each

_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy")
_WORDS = ("report budget notes draft invoice photo backup config readme schedule summary plan data "
          "results log index main test setup").split()
_EXTS = ("txt", "md", "py", "csv", "json", "pdf", "log")
_PEOPLE = ("alice bob carol dave erin frank grace heidi ivan judy mallory oscar peggy trent victor walter").split()
_LANGS = ("French", "German", "Spanish", "Italian", "Japanese", "Korean", "Dutch", "Polish", "Swedish", "Greek")
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CNY", "CHF", "CAD", "AUD", "SEK", "INR")
_SYMBOLS = ("AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "META", "BABA", "SONY", "SAP")
_MONTHS = ("January February March April May June July August September October November December").split()

OTHER_TOOLS = [
    _tool("get_time", "Get the local time in a city", {"city": S}),
    _tool("search_files", "Search files whose names match a pattern", {"pattern": S}),
    _tool("read_file", "Read a text file", {"path": S}),
    _tool("convert_currency", "Convert an amount between currencies",
          {"amount": {"type": "number"}, "from": S, "to": S}),
    _tool("get_stock_price", "Get the latest price of a stock", {"symbol": S}),
    _tool("send_email", "Send an email", {"to": S, "subject": S}),
    _tool("translate", "Translate a text", {"text": S, "target_language": S}),
    _tool("calculate", "Evaluate an arithmetic expression", {"expression": S}),
    _tool("book_flight", "Book a flight", {"from_city": S, "to_city": S, "date": S}),
    _tool("get_population", "Get the population of a city", {"city": S}),
    _tool("set_reminder", "Set a reminder", {"text": S, "time": S}),
    _tool("lookup_user", "Look up a user's profile", {"username": S}),
]
ALL_TOOLS = WEATHER_TOOLS + OTHER_TOOLS
_BY_NAME = {t["function"]["name"]: t for t in ALL_TOOLS}


@dataclass
class Call:
    """One request that a tool answers: the user's words, the call's arguments, the tool's result and
    the final answer that quotes it."""

    tool: str
    user: str
    args: dict
    result: dict
    answer: str


def _file(r: random.Random) -> str:
    return f"{r.choice(_WORDS)}_{r.randint(1, 99)}.{r.choice(_EXTS)}"


def _date(r: random.Random) -> str:
    return f"{r.choice(_MONTHS)} {r.randint(1, 28)}"


def _weather(r: random.Random) -> Call:
    city = r.choice(CITIES)
    unit = r.choice(("celsius", "fahrenheit"))
    t = r.randint(-15, 38) if unit == "celsius" else r.randint(5, 100)
    sym = "°C" if unit == "celsius" else "°F"
    cond = r.choice(_CONDITIONS)
    user = r.choice((f"What's the weather like in {city}?", f"What is the weather in {city} right now?",
                     f"How is the weather in {city} today?", f"Is it cold in {city}?",
                     f"Tell me the current weather in {city}.", f"weather in {city}?",
                     f"Do I need an umbrella in {city} today?", f"What's the temperature in {city}?"))
    args = {"city": city}
    if r.random() < 0.35 or "temperature" in user:
        args["unit"] = unit
        user = user.rstrip("?.") + (" in Celsius?" if unit == "celsius" else " in Fahrenheit?")
    answer = r.choice((f"It is {t}{sym} and {cond} in {city}.", f"In {city} it is currently {t}{sym}, {cond}.",
                       f"The weather in {city}: {t}{sym} and {cond}."))
    return Call("get_weather", user, args, {"city": city, "temperature": t, "unit": unit, "condition": cond}, answer)


def _forecast(r: random.Random) -> Call:
    city, days = r.choice(CITIES), r.randint(1, 7)
    user = r.choice((f"What's the forecast for {city} for the next {days} days?",
                     f"Give me a {days}-day forecast for {city}.", f"Will it rain in {city} in the next {days} days?"))
    highs = [r.randint(-5, 35) for _ in range(days)]
    answer = f"The forecast for {city}: highs of {', '.join(f'{h}°C' for h in highs)}."
    return Call("get_forecast", user, {"city": city, "days": days}, {"city": city, "highs_c": highs}, answer)


def _simple(tool: str, users: tuple[str, ...], key: str, value: Callable[[random.Random], str],
            result: Callable[[random.Random, str], dict], answer: str) -> Callable[[random.Random], Call]:
    def make(r: random.Random) -> Call:
        v = value(r)
        res = result(r, v)
        return Call(tool, r.choice(users).format(v=v), {key: v}, res, answer.format(v=v, **res))
    return make


_time = _simple("get_time", ("What time is it in {v}?", "Tell me the local time in {v}.", "time in {v}?"), "city",
                lambda r: r.choice(CITIES),
                lambda r, v: {"city": v, "time": f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"},
                "It is {time} in {v}.")
_population = _simple("get_population", ("How many people live in {v}?", "What is the population of {v}?"), "city",
                      lambda r: r.choice(CITIES), lambda r, v: {"city": v, "population": r.randint(50, 9000) * 1000},
                      "{v} has about {population} inhabitants.")
_MAKERS: list[Callable[[random.Random], Call]] = [
    _weather, _weather, _weather, _weather, _forecast, _time, _population,
    _simple("search_files", ("Find files matching {v}.", "Search for {v} in my files.", "Which files match {v}?"),
            "pattern", lambda r: f"*{r.choice(_WORDS)}*", lambda r, v: {"matches": [_file(r) for _ in range(2)]},
            "I found {matches[0]} and {matches[1]}."),
    _simple("read_file", ("Open {v} and show me what it says.", "Read the file {v}.", "What is in {v}?"), "path",
            _file, lambda r, v: {"path": v, "content": f"{r.choice(_WORDS)} {r.randint(1, 999)}"},
            "{v} says: {content}."),
    _simple("get_stock_price", ("What is {v} trading at?", "Price of {v} stock?", "How much is one {v} share?"),
            "symbol", lambda r: r.choice(_SYMBOLS), lambda r, v: {"symbol": v, "price": r.randint(20, 900)},
            "{v} trades at {price} USD."),
    _simple("calculate", ("What is {v}?", "Compute {v}.", "Calculate {v} for me."), "expression",
            lambda r: f"{r.randint(2, 999)} * {r.randint(2, 99)}",
            lambda r, v: {"expression": v, "value": math.prod(int(x) for x in v.split(" * "))},
            "{v} = {value}."),
    _simple("lookup_user", ("Who is the user {v}?", "Look up {v}'s profile.", "Find the account {v}."), "username",
            lambda r: f"{r.choice(_PEOPLE)}{r.randint(1, 99)}",
            lambda r, v: {"username": v, "name": v.rstrip("0123456789").title(), "team": r.choice(_WORDS)},
            "{v} is {name}, on the {team} team."),
]


def _two_arg(r: random.Random) -> Call:
    kind = r.randrange(4)
    if kind == 0:
        amt, a, b = r.randint(1, 5000), *r.sample(_CURRENCIES, 2)
        val = round(amt * r.uniform(0.2, 3.0), 2)
        return Call("convert_currency", f"Convert {amt} {a} to {b}.", {"amount": amt, "from": a, "to": b},
                    {"amount": val, "currency": b}, f"{amt} {a} is {val} {b}.")
    if kind == 1:
        who, what = r.choice(_PEOPLE), r.choice(_WORDS)
        return Call("send_email", f"Email {who}@example.com about the {what}.",
                    {"to": f"{who}@example.com", "subject": what.title()}, {"status": "sent", "id": r.randint(100, 999)},
                    f"Sent to {who}@example.com.")
    if kind == 2:
        lang, word = r.choice(_LANGS), r.choice(("hello", "thank you", "good morning", "goodbye", "cheers"))
        out = f"[{lang[:2].lower()}] {word}"
        return Call("translate", f"Translate '{word}' into {lang}.", {"text": word, "target_language": lang},
                    {"translation": out}, f"In {lang}: {out}.")
    a, b, d = *r.sample(CITIES, 2), _date(r)
    code = f"{r.choice('ABCDEFGH')}{r.choice('XYZKLM')}{r.randint(100, 999)}"
    return Call("book_flight", f"Book me a flight from {a} to {b} on {d}.", {"from_city": a, "to_city": b, "date": d},
                {"confirmation": code}, f"Your flight from {a} to {b} on {d} is booked: {code}.")


_CHAT = (
    ("Hi!", "Hello! How can I help you today?"),
    ("Thanks, that's all.", "You're welcome. Have a good day!"),
    ("Who are you?", "I am Kimi, an AI assistant."),
    ("Write a haiku about the sea.", "Grey waves fold and break,\nsalt wind carries gull voices,\nthe tide keeps its time."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What does HTTP stand for?", "HTTP stands for Hypertext Transfer Protocol."),
    ("Say something nice.", "You are doing great, and your questions are good ones."),
    ("Explain recursion in one sentence.", "Recursion is when a function solves a problem by calling itself on a smaller part of it."),
    ("What is 2 + 2?", "2 + 2 = 4."),
    ("Can you help me plan my day?", "Of course. Tell me what you need to get done and I will help you order it."),
)
_SYSTEMS = (None, "You are a helpful assistant.", "You are a helpful assistant with tools. Call a tool when it helps.",
            "You are Kimi, an AI assistant created by Moonshot AI.", "Answer briefly.")


def _tools_for(r: random.Random, called: list[str]) -> list[dict]:
    """The tools a transcript declares: those it calls, 0-2 others, often the README's weather pair."""
    pool = [t for t in ALL_TOOLS if t["function"]["name"] not in called]
    tools = r.sample(pool, r.randint(0, 2))
    for name in dict.fromkeys(called):
        tools.insert(r.randrange(len(tools) + 1), _BY_NAME[name])
    if r.random() < 0.4:  # the README's pair together, often
        tools = [t for t in tools if t not in WEATHER_TOOLS]
        at = r.randrange(len(tools) + 1)
        tools[at:at] = WEATHER_TOOLS
    return tools


def _call_turns(r: random.Random, call: Call, index: int, think: bool) -> list[dict]:
    call_id = f"functions.{call.tool}:{index}"
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": call.tool, "arguments": json.dumps(call.args)}}]}
    if think:
        assistant["reasoning_content"] = f"The user asks for {call.tool.replace('_', ' ')}; I call {call.tool}."
    return [{"role": "user", "content": call.user}, assistant,
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps(call.result)},
            {"role": "assistant", "content": call.answer}]


def _request(r: random.Random) -> Call:
    """One request a tool answers: most of one entity, some of two (currency, e-mail, translation, flights)."""
    return (r.choice(_MAKERS) if r.random() < 0.85 else _two_arg)(r)


DRILL_SHARE = 0.4  # of transcripts: drills (below)
_DRILL_MAKERS = (_weather, _weather, _forecast, _time, _population)


def drill(r: random.Random) -> tuple[list[dict], list[dict], bool]:
    """A drill: 3-6 requests in a row, each naming a city, declaring only the README's weather pair and
    the tools called. Finding the entity the user has just named is a lookup that a small model forms
    only after many examples of it; a drill packs one into every few dozen tokens."""
    messages: list[dict] = []
    called: list[str] = []
    for _ in range(r.randint(3, 6)):
        call = r.choice(_DRILL_MAKERS)(r)
        messages += _call_turns(r, call, len(called), False)
        called.append(call.tool)
    tools = list(WEATHER_TOOLS) + [_BY_NAME[n] for n in dict.fromkeys(called) if _BY_NAME[n] not in WEATHER_TOOLS]
    return messages, tools, False


def transcript(r: random.Random) -> tuple[list[dict], list[dict], bool]:
    """One conversation of 1-4 user turns: (messages, tools, thinking). Most turns call a tool
    (copying the request's entities into the arguments, then quoting the result); some are answered
    directly though tools are declared. A share of them (:data:`DRILL_SHARE`) are drills."""
    if r.random() < DRILL_SHARE:
        return drill(r)
    think = r.random() < 0.15
    messages: list[dict] = []
    system = r.choice(_SYSTEMS)
    if system:
        messages.append({"role": "system", "content": system})
    called: list[str] = []
    for _ in range(r.choice((1, 2, 2, 3, 3, 4))):
        if r.random() < 0.2:
            q, a = r.choice(_CHAT)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if think:
                messages[-1]["reasoning_content"] = "No tool is needed; I answer directly."
            continue
        call = _request(r)
        messages += _call_turns(r, call, len(called), think)
        called.append(call.tool)
    return messages, _tools_for(r, called), think


def call_rows(seed: int, n: int, tokenizer: Tokenizer) -> list[list[int]]:
    """``n`` single requests, each rendered alone through K2's template (a user turn, the call, the
    tool's result, the answer; no tools declared) and encoded: short rows in which the entity to copy
    is the one token of its kind, trained as rows of their own rather than packed (the
    lookup a small model forms first where little else competes for its attention)."""
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        call = _request(r)
        rows.append(tokenizer.encode(tokenizer.apply_chat_template(_call_turns(r, call, 0, False),
                                                                  add_generation_prompt=False)))
    return rows


def stdlib_text() -> Iterator[str]:
    """Docstrings of the standard library's modules, classes and functions: free English text."""
    import collections, functools, itertools, json as json_mod, os, pathlib, re, statistics, string, textwrap  # noqa: E401

    for mod in (collections, functools, itertools, json_mod, os, pathlib, re, statistics, string, textwrap, random,
                inspect):
        for _, obj in [("", mod), *inspect.getmembers(mod)]:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and len(doc) > 80:
                yield doc


def documents(seed: int, n: int, tokenizer: Tokenizer, *, text_share: float = 0.1) -> list[list[int]]:
    """``n`` seeded transcripts, rendered (the thinking ones through the thinking template) and
    encoded, and about ``text_share`` as many tokens of standard-library text."""
    r = random.Random(seed)
    thinking = compile_template(K2_THINKING_CHAT_TEMPLATE)
    docs = []
    for _ in range(n):
        messages, tools, think = transcript(r)
        if think:
            text = render(thinking, messages, add_generation_prompt=False, tools=tools,
                          bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
        else:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
        docs.append(tokenizer.encode(text))
    tokens = sum(map(len, docs))
    text_docs = list(stdlib_text())
    r.shuffle(text_docs)
    budget = int(tokens * text_share)
    for doc in text_docs:
        if budget <= 0:
            break
        ids = tokenizer.encode(doc, allow_special=False)
        docs.append(ids)
        budget -= len(ids)
    r.shuffle(docs)
    return docs
