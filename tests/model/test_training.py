"""Training's loss weights (training/train.py): assistant turns weigh 1 as targets, the rest less."""

import json
import re

from training.corpus import documents
from model.tokenizer import SHIPPED_DIR, Tokenizer
from training.train import assistant_weights, windows


def test_assistant_turns_weigh_one_and_the_rest_other():
    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi")
    marks = [tok.token_to_id(t) for t in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>")]
    text = ("<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>Hello there<|im_end|>"
            "<|im_user|>user<|im_middle|>Bye<|im_end|>")
    ids = tok.encode(text)
    w = assistant_weights(ids, *marks, other=0.2)
    heavy = tok.decode([t for t, x in zip(ids, w) if x == 1.0])
    assert heavy == "Hello there<|im_end|>"
    assert set(w) == {1.0, 0.2}


def test_windows_cut_ids_and_weights_alike():
    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi")
    docs = documents(3, 8, tok)
    marks = [tok.token_to_id(t) for t in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>")]
    ids, w = windows(docs, 64, [assistant_weights(d, *marks, other=0.0) for d in docs])
    assert ids.shape == w.shape and ids.shape[1] == 64
    flat = [t for d in docs for t in d]
    assert ids.flatten().tolist() == flat[: ids.numel()]
    assert 0 < w.mean() < 1


def test_a_calls_arguments_weigh_their_own():
    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi")
    marks = [tok.token_to_id(t) for t in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>")]
    arguments = (tok.token_to_id("<|tool_call_argument_begin|>"), tok.token_to_id("<|tool_call_end|>"))
    text = ("<|im_user|>user<|im_middle|>weather in Oslo?<|im_end|><|im_assistant|>assistant<|im_middle|>"
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    ids = tok.encode(text)
    w = assistant_weights(ids, *marks, other=0.2, arguments=arguments, argument_weight=5.0)
    by = {x: tok.decode([t for t, y in zip(ids, w) if y == x]) for x in (5.0, 1.0)}
    assert by[5.0] == '{"city": "Oslo"}<|tool_call_end|>'
    assert by[1.0] == ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                       "<|tool_call_argument_begin|><|tool_calls_section_end|><|im_end|>")
    assert assistant_weights(ids, *marks, other=0.2) == [1.0 if x == 5.0 else x for x in w]  # without: 1 alike


def test_induction_rows_mark_exactly_the_copied_ids_and_vary_their_period():
    import torch

    from training.train import copy_accuracy, induction_rows

    ids, mask = induction_rows(200, 80, 768, torch.Generator().manual_seed(0))
    assert ids.shape == mask.shape == (200, 80) and int(ids.max()) < 768
    periods = set()
    for row, m in zip(ids.tolist(), mask.tolist()):
        p = next(d for d in range(8, 27) if all(row[i] == row[i - d] for i in range(d, 80)))
        periods.add(p)
        # marked: every repeat's id after its first; unmarked: the first span and each repeat's first id
        assert m == [i >= p and i % p != 0 for i in range(80)]
    assert len(periods) >= 15  # no one distance back solves the task
    # a model that copies scores 1 on the marked targets; one that does not, about 1/768
    perfect = torch.full((200, 80, 768), -1.0)
    perfect[:, :-1].scatter_(2, ids[:, 1:, None], 1.0)
    assert copy_accuracy(perfect, ids, mask) == 1.0
    assert copy_accuracy(torch.zeros(200, 80, 768).normal_(generator=torch.Generator().manual_seed(1)), ids, mask) < 0.01


def test_the_induction_probe_runs_on_both_models(capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("probe_induction",
                                                  Path(__file__).parents[2] / "scripts" / "probe_induction.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    for extra in (["--model", "smoke"], ["--reference", "--width", "32", "--layers", "2"]):
        assert probe.main(extra + ["--steps", "4", "--eval-every", "2", "--rows", "2", "--length", "40",
                                   "--threads", "1"]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["step"] for r in rows] == [0, 2, 4] and all(0 <= r["copy_accuracy"] <= 1 for r in rows)


def test_padded_rows_keeps_each_document_a_row_of_its_own():
    from training.train import padded_rows

    ids, w = padded_rows([[5, 6, 7], [1, 2, 3, 4, 5, 6]], 4, [[1.0, 2.0, 3.0], [1.0] * 6], pad_id=99)
    assert ids.tolist() == [[5, 6, 7, 99], [1, 2, 3, 4]]
    assert w.tolist() == [[1.0, 2.0, 3.0, 0.0], [1.0] * 4]  # padding is never a target


def test_single_requests_name_one_city_and_call_for_it():
    from training.corpus import CITIES, call_rows

    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi-mini")
    rows = call_rows(1, 40, tok)
    assert rows == call_rows(1, 40, tok)  # seeded
    texts = [tok.decode(r) for r in rows]
    calls = [t for t in texts if "<|tool_call_begin|>" in t]
    talk = [t for t in texts if t not in calls]  # small talk, answered in words with no tools declared
    assert all(t.count("<|tool_call_begin|>") == 1 and "## Return of functions." in t for t in calls)
    assert talk and len(calls) >= 0.7 * len(texts) and not any("tool" in t for t in talk), talk
    weather = [t for t in texts if "functions.get_weather:0" in t]
    assert weather and all(any(f'"city": "{c}"' in t and re.search(rf"\b{c}\b", t.split("<|im_assistant|>")[0])
                               for c in CITIES) for t in weather)  # the user named it, anywhere in the turn


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def _skeleton(x):
    """A tool result's shape: its keys, nesting and lists, the values left out."""
    if isinstance(x, dict):
        return tuple((k, _skeleton(v)) for k, v in x.items())
    if isinstance(x, list):
        return ("list", _skeleton(x[0]) if x else None)
    return None


def test_the_corpus_varies_every_tools_result_and_phrasing_and_its_answers_quote_the_result():
    """training/corpus.py's training corpus asks for each tool in many phrasings and gets its result in
    many shapes (key names, nesting, lists, extra fields, key orders); each answer still quotes a value
    of the result. Without ``vary`` a transcript is the corpus's first version (one shape a tool: what
    the tokenizer kimi-mini learned from, tests/model/test_tokenizer.py rebuilds it)."""
    import random
    from collections import defaultdict

    from training.corpus import conversations, transcript

    def turns(convs):
        for messages, _tools, _think in convs:
            for i, m in enumerate(messages):
                if m["role"] == "tool":
                    call = messages[i - 1]["tool_calls"][0]["function"]
                    yield messages[i - 2]["content"], call["name"], json.loads(call["arguments"]), \
                        json.loads(m["content"]), messages[i + 1]["content"]

    shapes, asks, temperature_keys = defaultdict(set), defaultdict(set), set()
    for user, tool, args, result, answer in turns(conversations(3, 600)):
        shapes[tool].add(_skeleton(result))
        ask = user
        for value in args.values():
            ask = ask.replace(str(value), "{}")
        asks[tool].add(ask)
        if tool != "send_email":  # its answer names the recipient, not the result's id
            quoted = [x for x in _leaves(result) if str(x) not in map(str, args.values()) and str(x) in answer]
            assert quoted, (user, result, answer)
        if tool == "get_weather":
            (t,) = [int(n) for n in re.findall(r"(-?\d+)°[CF]", answer)]
            flat = result[0] if isinstance(result, list) else result
            inner = [flat] + [x for x in flat.values() if isinstance(x, dict)] + \
                [x[0] for x in flat.values() if isinstance(x, list) and x and isinstance(x[0], dict)]
            temperature_keys |= {k for d in inner for k, x in d.items() if x == t and not isinstance(x, bool)}
    assert len(shapes) == len(asks) == 13, sorted(shapes)  # every tool but set_reminder, declared and never called
    for tool in shapes:
        assert len(shapes[tool]) >= 3 and len(asks[tool]) >= 3, (tool, shapes[tool], asks[tool])
    assert len(shapes["get_weather"]) >= 100 and len(asks["get_weather"]) >= 30
    assert len(temperature_keys) >= 10, temperature_keys
    assert any(isinstance(s, tuple) and s and s[0] == "list" for s in shapes["get_weather"])  # a list at the top
    r = random.Random(3)
    first = [t[1:4] for t in turns(transcript(r) for _ in range(300))]
    assert {tuple(result) for tool, _args, result in first if tool == "get_weather"} == \
        {("city", "temperature", "unit", "condition")}


def test_an_answers_number_from_the_tools_result_weighs_the_quote_weight():
    """training.train.assistant_weights: a quotable id (a number, a city) the answer writes that the
    request or the tool's result gave since the last answer weighs ``quote_weight``; one they did not
    give weighs 1, and after an answer what came before no longer counts."""
    from training.train import assistant_weights

    B, M, E, TOOL, ARG, ARG_END = 1, 2, 3, 9, 10, 11  # assistant begin, middle, end; a tool marker; a call's arguments
    n19, n20, city, word = 19, 20, 30, 7
    ids = [city, B, M, ARG, city, ARG_END, E,  # the user names the city; the assistant calls for it
           TOOL, n19, B, M, city, n19, n20, E,  # the result holds 19; the answer quotes the city and 19, writes 20
           TOOL, word, B, M, n19, city, E]     # after that answer, a result without 19: nothing is a quote
    w = assistant_weights(ids, B, M, E, other=0.2, arguments=(ARG, ARG_END), argument_weight=3.0,
                          quotes=frozenset({n19, n20, city}), quote_weight=4.0)
    assert w == [0.2, 0.2, 0.2, 1.0, 3.0, 3.0, 1.0,
                 0.2, 0.2, 0.2, 0.2, 4.0, 4.0, 1.0, 1.0,
                 0.2, 0.2, 0.2, 0.2, 1.0, 1.0, 1.0]
    plain = assistant_weights(ids, B, M, E, other=0.2, arguments=(ARG, ARG_END), argument_weight=3.0)
    assert plain == [x if x != 4.0 else 1.0 for x in w]  # off by default
