"""Training's loss weights (model/training.py): assistant turns weigh 1 as targets, the rest less."""

import json

from model.corpus import documents
from model.tokenizer import SHIPPED_DIR, Tokenizer
from model.training import assistant_weights, windows


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

    from model.training import copy_accuracy, induction_rows

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
    from model.training import padded_rows

    ids, w = padded_rows([[5, 6, 7], [1, 2, 3, 4, 5, 6]], 4, [[1.0, 2.0, 3.0], [1.0] * 6], pad_id=99)
    assert ids.tolist() == [[5, 6, 7, 99], [1, 2, 3, 4]]
    assert w.tolist() == [[1.0, 2.0, 3.0, 0.0], [1.0] * 4]  # padding is never a target


def test_single_requests_name_one_city_and_call_for_it():
    from model.corpus import CITIES, call_rows

    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi-mini")
    rows = call_rows(1, 40, tok)
    assert rows == call_rows(1, 40, tok)  # seeded
    texts = [tok.decode(r) for r in rows]
    assert all(t.count("<|tool_call_begin|>") == 1 and "## Return of functions." in t for t in texts)
    weather = [t for t in texts if "functions.get_weather:0" in t]
    assert weather and all(any(f'"city": "{c}"' in t and f" {c}" in t.split("<|im_assistant|>")[0] for c in CITIES)
                           for t in weather)
