"""The output processor (deploy/output.py), the one place token ids become text: special tokens left
out unless asked, the stop token's text apart (in the output only with include_stop_str_in_output),
stop strings over the decoded text, and streamed pieces that assemble into the whole answer. No
engine: chunks as the engine streams them."""

import pytest

from actors.messages import SampledToken
from cluster.stream import StreamChunk
from deploy.chat_turn import ChatPlan
from deploy.output import ChoiceOutput, OutputOptions
from model.tokenizer import SHIPPED_DIR, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


def _run(tok, ids, finish, options=OutputOptions(), chat=False, split=1):
    """Feed ``ids`` as the engine streams them (``split`` per chunk, ``finish`` on the last)."""
    out = ChoiceOutput(tok, 0, options, chat=chat, plan=ChatPlan([1], None, None, False, False) if chat else None)
    pieces = []
    for i in range(0, len(ids), split):
        last = i + split >= len(ids)
        piece, stopped = out.push(StreamChunk(tuple(ids[i:i + split]), finish if last else None,
                                              tuple(SampledToken(0, t, -0.5) for t in ids[i:i + split])))
        pieces.append(piece)
        if stopped or piece.finish_reason:
            break
    return out, pieces


def test_special_tokens_are_left_out_unless_asked_and_the_stop_token_apart(tok):
    special, end = 876, tok.token_to_id("<|im_end|>")
    hi = tok.encode("hi there")
    ids = [*hi[:1], special, *hi[1:], end]
    out, pieces = _run(tok, ids, "stop")
    assert out.text == "hi there" == "".join(p.text for p in pieces) and out.finish_reason == "stop"
    assert out.token_ids == ids  # the stop token is still the choice's (usage, return_token_ids)
    shown, _ = _run(tok, ids, "stop", OutputOptions(skip_special_tokens=False))
    assert shown.text == tok.decode(ids[:-1]) and tok.decode([special]) in shown.text and "<|im_end|>" not in shown.text
    kept, _ = _run(tok, ids, "stop", OutputOptions(skip_special_tokens=False, include_stop_str_in_output=True))
    assert kept.text.endswith("<|im_end|>")
    cut, _ = _run(tok, [*hi, special], "length")  # a length finish has no stop token to leave out
    assert cut.text == "hi there" and cut.finish_reason == "length"


def test_a_character_split_over_tokens_is_held_back_and_pieces_assemble_the_whole(tok):
    ids = tok.encode("naïve café → ok")
    whole, _ = _run(tok, ids, "length", split=len(ids))
    for split in (1, 2, 3):
        out, pieces = _run(tok, ids, "length", split=split)
        assert "".join(p.text for p in pieces) == whole.text == tok.decode(ids)
        assert all("\ufffd" not in p.text for p in pieces)


def test_stop_strings_cut_the_text_and_end_the_choice(tok):
    ids = tok.encode("one two three four")
    out, pieces = _run(tok, ids, None, OutputOptions(stop=("three",)))
    assert out.text == "one two " and pieces[-1].finish_reason == "stop"
    kept, _ = _run(tok, ids, None, OutputOptions(stop=("three",), include_stop_str_in_output=True))
    assert kept.text == "one two three"
    chat, pieces = _run(tok, ids, None, OutputOptions(stop=("three",)), chat=True)
    assert chat.result().message["content"] == "one two " == "".join(d["content"] for p in pieces for d in p.deltas)


def test_streamed_logprob_offsets_run_on_as_the_whole_answer_counts_them(tok):
    ids = tok.encode("a bc def")
    out, pieces = _run(tok, ids, "length", OutputOptions(logprobs=True))
    offsets = [o for p in pieces for o in p.logprobs["text_offset"]]
    whole, _ = _run(tok, ids, "length", OutputOptions(logprobs=True), split=len(ids))
    assert offsets == whole.result().logprobs["text_offset"]
    assert offsets[1:] != offsets[:-1]  # they do run on
