"""Training's loss weights (model/training.py): assistant turns weigh 1 as targets, the rest less."""

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

