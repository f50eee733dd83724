"""The output processor over real HTTP, in one process (no Ray): a choice's text is its token ids
decoded (special tokens left out), stop strings cut it, and a stream assembles into the whole answer
— checked against the ids the server returns (``return_token_ids``) and the tokenizer, the oracle.
And the checks can fail: with the output processor broken three ways (stop strings ignored,
special tokens decoded, streamed pieces apart from the whole answer), each check catches its break."""

import json

import httpx
import pytest

from deploy.output import ChoiceOutput
from inproc import preset, serve
from model.tokenizer import Tokenizer

NAME = "k2"
PROMPT = [5, 77, 300, 12, 9, 41]


@pytest.fixture(scope="module")
def app():
    path = preset("kimi-k2-tiny", seed=4)
    with serve(path, served_model_name=NAME, max_num_seqs=8, max_tokens_per_step=64) as server:
        yield server.url, Tokenizer.from_dir(path)


def _complete(url: str, **extra) -> dict:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def check_text_is_the_ids_decoded(url: str, tok: Tokenizer) -> None:
    choice = _complete(url)
    assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert any(t in tok.special_token_ids for t in choice["token_ids"]), "no special token: the check tests nothing"


def check_a_stop_string_cuts_the_text(url: str, tok: Tokenizer) -> None:
    whole = _complete(url)["text"]
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert stop.strip(), whole
    cut = _complete(url, stop=[stop])
    assert cut["text"] == whole[:whole.find(stop)] and cut["finish_reason"] == "stop", (cut["text"], stop)


def check_the_stream_assembles_into_the_whole(url: str, tok: Tokenizer) -> None:
    whole = _complete(url)["text"]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    pieces = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == whole and len(pieces) > 1


CHECKS = [check_text_is_the_ids_decoded, check_a_stop_string_cuts_the_text, check_the_stream_assembles_into_the_whole]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_served_text_is_right(app, check):
    check(*app)


def _ignore_stops(push):
    def broken(self, chunk):
        self.stops.stops = []  # stop strings no longer seen
        return push(self, chunk)
    return broken


def _decode_specials(push):
    def broken(self, chunk):
        self.decoder._skip = frozenset()  # special tokens decoded into the text
        return push(self, chunk)
    return broken


def _stream_apart(push):
    def broken(self, chunk):
        piece, stopped = push(self, chunk)
        if piece.text:  # the streamed piece loses its first character; the whole answer keeps it
            piece = type(piece)(piece.text[1:], piece.deltas, piece.logprobs, piece.finish_reason)
        return piece, stopped
    return broken


@pytest.mark.parametrize("break_it,check", [(_ignore_stops, check_a_stop_string_cuts_the_text),
                                            (_decode_specials, check_text_is_the_ids_decoded),
                                            (_stream_apart, check_the_stream_assembles_into_the_whole)],
                         ids=lambda v: v.__name__)
def test_a_broken_output_processor_fails_the_check(app, monkeypatch, break_it, check):
    monkeypatch.setattr(ChoiceOutput, "push", break_it(ChoiceOutput.push))
    with pytest.raises(AssertionError):
        check(*app)
