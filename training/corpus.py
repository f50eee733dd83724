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

from model.chat_template import K2_THINKING_CHAT_TEMPLATE, compile_template, render
from model.tokenizer import Tokenizer


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


# ---------------------------------------------------------------- variety
#
# The requests above are the corpus as it first was (one result shape per tool, a few phrasings); the
# tokenizer kimi-mini learned its ranks from transcripts of exactly that (scripts/build_tokenizer.py calls
# :func:`transcript` without ``vary``), so it stays as it is. :func:`vary` rewrites a request with an RNG
# of its own: the same entities, arguments and quantities, asked in other words, the tool's result in
# another shape (other key names for the same quantity, a wrapper or a list around it, fields added or
# left out, keys in another order) and the answer in other words, still quoting the result. A model
# trained on one shape per tool quotes a result only when it looks like that shape.

_WRAPPERS = ("data", "result", "response", "report", "payload", "info", "details")
_MORE_CONDITIONS = ("misty", "mild", "showery", "breezy", "icy", "warm", "freezing", "bright", "grey", "wet")
_CELSIUS_KEYS = ("temperature_c", "celsius", "temp_celsius", "tempC", "air_temp_c")
_FAHRENHEIT_KEYS = ("temperature_f", "fahrenheit", "temp_fahrenheit", "tempF", "air_temp_f")
_NEUTRAL_TEMP_KEYS = ("temperature", "temperature", "temp", "air_temp", "t", "value", "temp_now", "air_temperature")
_UNIT_WORDS = {"celsius": ("celsius", "C", "°C", "metric"), "fahrenheit": ("fahrenheit", "F", "°F", "imperial")}
_CITY_KEYS = ("city", "city", "name", "city_name", "town", "where")
_CONDITION_KEYS = ("condition", "conditions", "summary", "description", "weather", "status_text", "state")
_WEATHER_EXTRAS = (
    ("humidity", lambda v: v.randint(20, 99)), ("humidity_pct", lambda v: f"{v.randint(20, 99)}%"),
    ("wind_kph", lambda v: v.randint(0, 60)), ("wind_speed", lambda v: f"{v.randint(0, 40)} km/h"),
    ("pressure_hpa", lambda v: v.randint(980, 1040)), ("updated", lambda v: f"{v.randint(0, 23):02d}:{v.randint(0, 59):02d}"),
    ("source", lambda v: v.choice(("met service", "local sensor", "national agency"))), ("ok", lambda v: True),
    ("precipitation_mm", lambda v: v.randint(0, 30)), ("uv_index", lambda v: v.randint(0, 11)),
)

_WEATHER_ASKS = (
    "What's the weather like in {city}?", "What is the weather in {city} right now?", "How is the weather in {city} today?",
    "Is it cold in {city}?", "Tell me the current weather in {city}.", "weather in {city}?",
    "Do I need an umbrella in {city} today?", "What's the temperature in {city}?", "How warm is it in {city} today?",
    "Is it raining in {city}?", "Is it sunny in {city} right now?", "How cold is {city} today?", "{city} weather?",
    "{city}: what's the weather?", "Weather for {city}, please.", "Can you get me the weather for {city}?",
    "Please look up the weather in {city}.", "I'm in {city}. What's the weather doing?",
    "I'm flying to {city} tonight. What's the weather there?", "My sister lives in {city}. Is it nice there today?",
    "Is it hot in {city} today?", "How many degrees is it in {city}?", "Temperature in {city} now?",
    "Do I need a coat in {city} today?", "Will I need sunglasses in {city} today?", "Check the weather in {city}.",
    "Give me the current weather for {city}.", "How's {city} looking weather-wise today?",
    "What's the weather in {city}? I'm about to go for a run.", "Is the weather good in {city} today?",
    "Current weather, {city}?", "Hey, what's the weather in {city}?", "Can you tell me how the weather is in {city}?",
    "Any rain in {city} today?", "What's the temperature like in {city} now?", "Is it freezing in {city}?",
    "Look up {city}'s weather for me.", "how's the weather in {city}", "Weather report for {city}?",
    "In {city}, is it warm or cold today?", "What temperature is it in {city} today?", "{city} - rain or sun today?",
    "I have a meeting in {city}. Tell me the weather there.", "What's the weather doing in {city}?",
    # the weather now, asked with words a forecast's asks never use (conditions, a time later today)
    "What are the current conditions in {city}?", "Conditions in {city} right now?", "How are conditions in {city} today?",
    "I'm going to {city} later today. Is it warm there?", "Later today I'll be in {city}; how cold is it there now?",
    "Is it sunny in {city} this afternoon?", "Going out in {city} this evening. What's the temperature?",
    "Tell me the conditions in {city} now.", "Current conditions, {city}?", "What's it like in {city} today, weather-wise?",
    "I land in {city} in an hour. How warm is it?", "Is it cold outside in {city} tonight?",
)
_WEATHER_OPENERS = ("Hi! ", "Hello. ", "Hey there! ", "Good morning! ", "Quick question. ", "One more thing. ", "Thanks. ")
_UNIT_CLAUSES = {"celsius": (" in Celsius?", " (in Celsius, please)", ", in °C please.", " Answer in Celsius."),
                 "fahrenheit": (" in Fahrenheit?", " (in Fahrenheit, please)", ", in °F please.", " Answer in Fahrenheit.")}
_WEATHER_ANSWERS = (
    "It is {t}{sym} and {cond} in {city}.", "In {city} it is currently {t}{sym}, {cond}.",
    "The weather in {city}: {t}{sym} and {cond}.", "It's {cond} in {city} right now, at {t}{sym}.",
    "{city} is at {t}{sym} and {cond}.", "Currently {t}{sym} in {city} ({cond}).",
    "The temperature in {city} is {t}{sym}; it is {cond}.", "{city}: {t}{sym}, {cond}.",
    "It's {t}{sym} in {city}, and {cond}.", "Right now {city} has {t}{sym} and it is {cond}.",
    "{cond} and {t}{sym} in {city} now.", "The current temperature in {city} is {t}{sym}, {cond}.",
)
_WEATHER_ANSWERS_BARE = (
    "It is {t}{sym} in {city}.", "In {city} it is currently {t}{sym}.", "The temperature in {city} is {t}{sym}.",
    "{city}: {t}{sym}.", "It's {t}{sym} in {city} right now.", "Currently {t}{sym} in {city}.",
    "{city} is at {t}{sym}.", "The current temperature in {city} is {t}{sym}.",
)


def _shape(v: random.Random, fields: list[tuple[str, object]], extras=(), *, drop: tuple[str, ...] = (),
           extra_counts=(0, 0, 1, 1, 2)) -> object:
    """A tool's result from its ``fields`` ((key, value), in their usual order): a field whose key is in
    ``drop`` left out now and then, 0-2 of ``extras`` ((key, make(v))) added, the keys shuffled half
    the time, and the whole wrapped under a key, beside a status, in a list, or not at all."""
    items = [(k, x) for k, x in fields if k not in drop or v.random() < 0.7]
    used = {k for k, _ in items}
    pool = [(k, make) for k, make in extras if k not in used]
    for k, make in v.sample(pool, min(len(pool), v.choice(extra_counts))):
        items.append((k, make(v)))
    if v.random() < 0.5:
        v.shuffle(items)
    inner = dict(items)
    x = v.random()
    if x < 0.6:
        return inner
    if x < 0.75:
        return {v.choice(_WRAPPERS): inner}
    if x < 0.85:
        return {"status": v.choice(("ok", "success")), v.choice(_WRAPPERS): inner}
    if x < 0.95:
        return {v.choice(("results", "items", "records")): [inner]}
    return [inner]


def _ask(v: random.Random, asks: tuple[str, ...], **names) -> str:
    q = v.choice(asks).format(**names)
    return v.choice(_WEATHER_OPENERS) + q if v.random() < 0.12 else q


def _vary_weather(call: Call, v: random.Random) -> Call:
    city, res = call.args["city"], call.result
    t, unit, cond = res["temperature"], res["unit"], res["condition"]
    if v.random() < 0.3:
        cond = v.choice(_MORE_CONDITIONS)
    if v.random() < 0.25:
        user = call.user
    else:
        user = _ask(v, _WEATHER_ASKS, city=city)
        if "unit" in call.args:
            user = user.rstrip("?.") + v.choice(_UNIT_CLAUSES[call.args["unit"]])
    if v.random() < 0.2:
        result: object = dict(res, condition=cond)
    else:
        own = v.random() < 0.35  # a key that names its unit
        temp_key = v.choice(_CELSIUS_KEYS if unit == "celsius" else _FAHRENHEIT_KEYS) if own else v.choice(_NEUTRAL_TEMP_KEYS)
        fields = [(v.choice(_CITY_KEYS), city), (temp_key, t)]
        if not own or v.random() < 0.3:
            fields.append((v.choice(("unit", "unit", "temp_unit")), v.choice(_UNIT_WORDS[unit])))
        fields.append((v.choice(_CONDITION_KEYS), cond))
        result = _shape(v, fields, _WEATHER_EXTRAS, drop=(fields[0][0], fields[-1][0]), extra_counts=(0, 0, 0, 1, 1, 2))
    sym = "°C" if unit == "celsius" else "°F"
    # an answer names the condition only where the result gives it (no invented weather)
    answers = _WEATHER_ANSWERS if json.dumps(cond) in json.dumps(result) else _WEATHER_ANSWERS_BARE
    return Call(call.tool, user, call.args, result, v.choice(answers).format(city=city, t=t, sym=sym, cond=cond))


_FORECAST_ASKS = (
    "What's the forecast for {city} for the next {days} days?", "Give me a {days}-day forecast for {city}.",
    "Will it rain in {city} in the next {days} days?", "Forecast for {city}, {days} days?",
    "How will the weather be in {city} over the next {days} days?", "{city}: {days}-day forecast please.",
    "What will the weather be like in {city} for the next {days} days?",
    "I'm visiting {city} for {days} days. What's the forecast?", "Next {days} days in {city}, what does the forecast say?",
    "Show me the {days}-day outlook for {city}.",
    # the days ahead: a forecast asks for days, a week, the coming days
    "What will the weather do in {city} over the coming {days} days?", "Plan my week: {days} days of weather in {city}?",
    "Is {city} getting warmer over the next {days} days?",
)
_FORECAST_ANSWERS = (
    "The forecast for {city}: highs of {highs}.", "Highs in {city} over the next {days} days: {highs}.",
    "{city}, next {days} days: {highs}.", "Expect highs of {highs} in {city}.",
    "Over the next {days} days {city} will see highs of {highs}.",
)


def _vary_forecast(call: Call, v: random.Random) -> Call:
    city, days, highs = call.args["city"], call.args["days"], call.result["highs_c"]
    user = call.user if v.random() < 0.25 else _ask(v, _FORECAST_ASKS, city=city, days=days)
    x = v.random()
    if x < 0.2:
        result: object = call.result
    elif x < 0.45 and days <= 3:
        key = v.choice(("day", "day_index", "d"))
        high = v.choice(("high", "high_c", "max", "max_temp"))
        result = _shape(v, [(v.choice(_CITY_KEYS), city), (v.choice(("daily", "days", "forecast")),
                                                          [{key: i + 1, high: h} for i, h in enumerate(highs)])],
                        drop=("city", "name", "city_name", "town", "where"))
    else:
        fields = [(v.choice(_CITY_KEYS), city), (v.choice(("highs", "highs_c", "max_temps", "daily_highs", "high_c")), highs)]
        if v.random() < 0.4:
            fields.append(("unit", v.choice(_UNIT_WORDS["celsius"])))
        result = _shape(v, fields, (("days", lambda v: days), ("updated", _WEATHER_EXTRAS[5][1])))
    return Call(call.tool, user, call.args, result, v.choice(_FORECAST_ANSWERS).format(
        city=city, days=days, highs=", ".join(f"{h}°C" for h in highs)))


def _vary_simple(asks: tuple[str, ...], quantity: str, keys: tuple[str, ...], answers: tuple[str, ...],
                 entity: tuple[str, ...] = (), extras=()) -> Callable[[Call, random.Random], Call]:
    """A variation for a tool of one entity (its argument, also the result's entity field ``entity[0]``
    where there is one) and one quantity (the result's field ``quantity``, quoted by the answer)."""
    def vary_(call: Call, v: random.Random) -> Call:
        (e,) = call.args.values()
        value = call.result[quantity]
        user = v.choice(asks).format(v=e) if v.random() < 0.75 else call.user
        if v.random() < 0.2:
            result: object = call.result
        else:
            fields = [(k if k != quantity else v.choice(keys), x) for k, x in call.result.items()]
            if entity:
                fields = [(v.choice(entity) if k == entity[0] else k, x) for k, x in fields]
            result = _shape(v, fields, extras, drop=entity[:1] and tuple(entity))
        return Call(call.tool, user, call.args, result, v.choice(answers).format(v=e, q=value, **call.result))
    return vary_


def _clock(v: random.Random) -> str:
    return f"{v.randint(0, 23):02d}:{v.randint(0, 59):02d}"


_VARIANTS: dict[str, Callable[[Call, random.Random], Call]] = {
    "get_weather": _vary_weather,
    "get_forecast": _vary_forecast,
    "get_time": _vary_simple(
        ("What time is it in {v}?", "Tell me the local time in {v}.", "time in {v}?", "What's the local time in {v}?",
         "{v} time now?", "Current time in {v}?", "Is it late in {v} right now?", "What hour is it in {v}?",
         "Can you tell me the time in {v}?", "I need to call a friend in {v}. What time is it there?",
         "{v}: what time is it?", "Clock check for {v}, please."),
        "time", ("time", "local_time", "clock", "time_now", "hh_mm"),
        ("It is {q} in {v}.", "The local time in {v} is {q}.", "In {v} it's {q} right now.", "{v}: {q}.",
         "It's {q} in {v} at the moment.", "The time in {v} is {q}."),
        _CITY_KEYS, (("timezone", lambda v: f"UTC{v.choice('+-')}{v.randint(0, 11)}"), ("dst", lambda v: v.random() < 0.5),
                     ("date", _date))),
    "get_population": _vary_simple(
        ("How many people live in {v}?", "What is the population of {v}?", "Population of {v}?", "How big is {v}?",
         "How many residents does {v} have?", "{v} population?", "Tell me how many people live in {v}.",
         "What's the number of inhabitants of {v}?"),
        "population", ("population", "inhabitants", "residents", "people", "count", "total"),
        ("{v} has about {q} inhabitants.", "About {q} people live in {v}.", "The population of {v} is {q}.",
         "{v}: roughly {q} people.", "{v} is home to about {q} people."),
        _CITY_KEYS, (("year", lambda v: v.randint(2015, 2024)), ("source", lambda v: v.choice(("census", "estimate"))),
                     ("country_rank", lambda v: v.randint(1, 20)))),
    "search_files": _vary_simple(
        ("Find files matching {v}.", "Search for {v} in my files.", "Which files match {v}?", "List files like {v}.",
         "Do I have any files matching {v}?", "Look for {v} on my drive.", "glob {v}"),
        "matches", ("matches", "files", "paths", "found", "hits"),
        ("I found {matches[0]} and {matches[1]}.", "Two files match {v}: {matches[0]} and {matches[1]}.",
         "{matches[0]} and {matches[1]} match {v}.", "Matches: {matches[0]}, {matches[1]}."),
        (), (("count", lambda v: 2), ("truncated", lambda v: False), ("took_ms", lambda v: v.randint(1, 90)))),
    "read_file": _vary_simple(
        ("Open {v} and show me what it says.", "Read the file {v}.", "What is in {v}?", "Show me {v}.",
         "cat {v}", "What does {v} contain?", "Print the contents of {v}, please."),
        "content", ("content", "text", "body", "contents", "data_text"),
        ("{v} says: {q}.", "The file {v} contains: {q}.", "{v}: {q}.", "Here is {v}: {q}."),
        ("path", "file", "filename", "name"), (("lines", lambda v: 1), ("bytes", lambda v: v.randint(5, 900)),
                                               ("encoding", lambda v: "utf-8"))),
    "get_stock_price": _vary_simple(
        ("What is {v} trading at?", "Price of {v} stock?", "How much is one {v} share?", "{v} quote?",
         "What's the latest price of {v}?", "Check {v} for me.", "How is {v} priced right now?"),
        "price", ("price", "last", "last_price", "quote_usd", "close", "value"),
        ("{v} trades at {q} USD.", "One {v} share costs {q} USD.", "{v} is at {q} USD.", "The latest {v} price is {q} USD.",
         "{v}: {q} USD."),
        ("symbol", "ticker", "code"), (("currency", lambda v: "USD"), ("change_pct", lambda v: f"{v.choice('+-')}{v.randint(0, 9)}.{v.randint(0, 9)}"),
                                       ("exchange", lambda v: v.choice(("NASDAQ", "NYSE", "XETRA"))))),
    "calculate": _vary_simple(
        ("What is {v}?", "Compute {v}.", "Calculate {v} for me.", "{v} = ?", "How much is {v}?", "Work out {v}, please.",
         "Can you multiply {v}?"),
        "value", ("value", "result", "answer", "output", "product"),
        ("{v} = {q}.", "The answer is {q}.", "{v} equals {q}.", "That comes to {q}.", "It is {q}."),
        ("expression", "expr", "input"), (("ok", lambda v: True), ("type", lambda v: "integer"))),
    "lookup_user": _vary_simple(
        ("Who is the user {v}?", "Look up {v}'s profile.", "Find the account {v}.", "Which team is {v} on?",
         "Tell me about user {v}.", "Whose account is {v}?"),
        "name", ("name", "full_name", "display_name", "real_name"),
        ("{v} is {q}, on the {team} team.", "{v} belongs to {q} ({team} team).", "That is {q}, who works on {team}.",
         "{q} uses the account {v}; team: {team}."),
        ("username", "user", "login", "handle"), (("active", lambda v: v.random() < 0.8), ("joined", lambda v: v.randint(2012, 2024)))),
}


def _vary_two(call: Call, v: random.Random) -> Call:
    a, res = call.args, call.result
    if call.tool == "convert_currency":
        amt, src, dst, val = a["amount"], a["from"], a["to"], res["amount"]
        user = v.choice(("Convert {amt} {a} to {b}.", "How much is {amt} {a} in {b}?", "{amt} {a} to {b}?",
                         "What do {amt} {a} come to in {b}?", "Change {amt} {a} into {b}, please.")).format(amt=amt, a=src, b=dst)
        fields = [(v.choice(("amount", "converted", "result", "value", "total")), val), (v.choice(("currency", "to", "code")), dst)]
        result = _shape(v, fields, (("rate", lambda v: round(v.uniform(0.2, 3.0), 4)), ("from", lambda v: src)))
        answer = v.choice(("{amt} {a} is {val} {b}.", "That comes to {val} {b}.", "{amt} {a} = {val} {b}.",
                           "You would get {val} {b} for {amt} {a}.")).format(amt=amt, a=src, b=dst, val=val)
    elif call.tool == "send_email":
        to = a["to"]
        user = v.choice((call.user, f"Send an email to {to} about the {a['subject'].lower()}.",
                         f"Write to {to}: subject {a['subject']}.", f"Mail {to} about the {a['subject'].lower()}, please."))
        result = _shape(v, [(v.choice(("status", "state", "result")), v.choice(("sent", "queued", "delivered"))),
                            (v.choice(("id", "message_id", "ref")), v.randint(100, 999))])
        answer = v.choice((f"Sent to {to}.", f"The email to {to} is on its way.", f"Done: your email to {to} was sent.",
                           f"I emailed {to}."))
    elif call.tool == "translate":
        word, lang, out = a["text"], a["target_language"], res["translation"]
        user = v.choice((call.user, f"How do you say '{word}' in {lang}?", f"'{word}' in {lang}, please.",
                         f"Translate this into {lang}: '{word}'", f"What is '{word}' in {lang}?"))
        result = _shape(v, [(v.choice(("translation", "translated", "output", "translated_text")), out)],
                        (("source_language", lambda v: "English"), ("target", lambda v: lang)))
        answer = v.choice((f"In {lang}: {out}.", f"'{word}' in {lang} is {out}.", f"That is {out} in {lang}.",
                           f"{lang}: {out}."))
    else:  # book_flight
        src, dst, d, code = a["from_city"], a["to_city"], a["date"], res["confirmation"]
        user = v.choice((call.user, f"I need a flight from {src} to {dst} on {d}.", f"Fly me {src} to {dst}, {d}.",
                         f"Please book {src} to {dst} for {d}.", f"Can you book a flight {src} - {dst} on {d}?"))
        result = _shape(v, [(v.choice(("confirmation", "booking_ref", "code", "pnr", "reference")), code)],
                        (("seat", lambda v: f"{v.randint(1, 40)}{v.choice('ABCDEF')}"), ("date", lambda v: d),
                         ("booked", lambda v: True)))
        answer = v.choice((f"Your flight from {src} to {dst} on {d} is booked: {code}.", f"Booked. Confirmation {code}.",
                           f"Done: {src} to {dst} on {d}, reference {code}.", f"You're booked to {dst} on {d} ({code})."))
    return Call(call.tool, user, a, result, answer)


for _name in ("convert_currency", "send_email", "translate", "book_flight"):
    _VARIANTS[_name] = _vary_two


def vary(call: Call, v: random.Random) -> Call:
    """``call`` asked, answered and its result shaped another way, by ``v`` alone (the entities, the
    arguments and the quantity quoted stay)."""
    return _VARIANTS[call.tool](call, v)


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
# Small talk asked with no tools declared (the README's "Hi!"): answered in words. Only the varied corpus
# has these (the first version's draws stay as the tokenizer learned them).
_SMALL_TALK = _CHAT + (
    ("Hello!", "Hello! How can I help you today?"), ("Hey!", "Hi! What can I do for you?"),
    ("Hi there!", "Hello! How can I help you today?"), ("Good morning!", "Good morning! How can I help you today?"),
    ("Hello, how are you?", "I'm well, thank you. How can I help you today?"), ("hi", "Hello! How can I help you today?"),
    ("Thank you!", "You're welcome!"), ("Good night!", "Good night! Sleep well."),
    ("What can you do?", "I can answer questions, write and explain things, and call tools when you give me some."),
)
CHAT_ROW_SHARE = 0.12  # of the varied single requests: small talk with no tools declared
NO_TOOLS_SHARE = 0.06  # of the varied transcripts: small talk with no tools declared


def small_talk(v: random.Random, turns: int | None = None) -> list[dict]:
    """``turns`` (or 1-3) turns of small talk, answered in words (what a request with no tools declared gets)."""
    messages = []
    for _ in range(turns or v.choice((1, 1, 2, 3))):
        q, a = v.choice(_SMALL_TALK)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


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


def drill(r: random.Random, v: random.Random | None = None) -> tuple[list[dict], list[dict], bool]:
    """A drill: 3-6 requests in a row, each naming a city, declaring only the README's weather pair and
    the tools called. Finding the entity the user has just named is a lookup that a small model forms
    only after many examples of it; a drill packs one into every few dozen tokens. With ``v``, each
    request :func:`vary`'d by it."""
    messages: list[dict] = []
    called: list[str] = []
    for _ in range(r.randint(3, 6)):
        call = r.choice(_DRILL_MAKERS)(r)
        if v is not None:
            call = vary(call, v)
        messages += _call_turns(r, call, len(called), False)
        called.append(call.tool)
    tools = list(WEATHER_TOOLS) + [_BY_NAME[n] for n in dict.fromkeys(called) if _BY_NAME[n] not in WEATHER_TOOLS]
    return messages, tools, False


def transcript(r: random.Random, v: random.Random | None = None) -> tuple[list[dict], list[dict], bool]:
    """One conversation of 1-4 user turns: (messages, tools, thinking). Most turns call a tool
    (copying the request's entities into the arguments, then quoting the result); some are answered
    directly though tools are declared. A share of them (:data:`DRILL_SHARE`) are drills. With ``v``
    (what the training corpus has), each request is :func:`vary`'d by it; without, the conversation is
    the corpus's first version, draw for draw (what the tokenizer learned from)."""
    if v is not None and v.random() < NO_TOOLS_SHARE:
        return small_talk(v), [], False
    if r.random() < DRILL_SHARE:
        return drill(r, v)
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
        if v is not None:
            call = vary(call, v)
        messages += _call_turns(r, call, len(called), think)
        called.append(call.tool)
    return messages, _tools_for(r, called), think


def call_rows(seed: int, n: int, tokenizer: Tokenizer, max_len: int | None = None, *,
              varied: bool = True) -> list[list[int]]:
    """``n`` single requests, each rendered alone through K2's template (a user turn, the call, the
    tool's result, the answer; no tools declared) and encoded: short rows in which the entity to copy
    is the one token of its kind, trained as rows of their own rather than packed (the
    lookup a small model forms first where little else competes for its attention). With
    ``max_len``, requests of more ids are passed over (a row cut short would lose its answer); with
    ``varied`` False, they are the corpus's first version (each tool's one result shape, its few
    phrasings). The varied rows are small talk answered in words one time in :data:`CHAT_ROW_SHARE`
    (with no tools declared, a greeting is not a request for a tool)."""
    rows = []
    for messages in single_requests(seed, varied=varied):
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
        if max_len is None or len(ids) <= max_len:
            rows.append(ids)
            if len(rows) == n:
                return rows
    raise AssertionError("unreachable")


def single_requests(seed: int, n: int | None = None, *, varied: bool = True) -> Iterator[list[dict]]:
    """The messages of :func:`call_rows`' seeded single requests, before rendering (``n`` of them, or
    without end)."""
    r, v = random.Random(seed), _vary_rng(seed)
    i = 0
    while n is None or i < n:
        if varied and v.random() < CHAT_ROW_SHARE:
            yield small_talk(v, 1)
        else:
            call = _request(r)
            yield _call_turns(r, vary(call, v) if varied else call, 0, False)
        i += 1


def conversations(seed: int, n: int) -> Iterator[tuple[list[dict], list[dict], bool]]:
    """:func:`documents`' ``n`` seeded transcripts, before rendering: (messages, tools, thinking)."""
    r, v = random.Random(seed), _vary_rng(seed)
    for _ in range(n):
        yield transcript(r, v)


def _vary_rng(seed: int) -> random.Random:
    """The RNG of :func:`vary` for the corpus of ``seed``: its own, so that the first version's draws
    (``random.Random(seed)``) stay as they were."""
    return random.Random(f"vary:{seed}")


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
    r, v = random.Random(seed), _vary_rng(seed)
    thinking = compile_template(K2_THINKING_CHAT_TEMPLATE)
    docs = []
    for _ in range(n):
        messages, tools, think = transcript(r, v)
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
