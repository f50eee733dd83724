"""deploy/tool_parser.py on token-id vectors with K2's real marker ids (MODEL_SPEC §1.11) and a
byte-level stub decode (id b < 256 is the byte b), so no K2 tokenizer is needed; then once through
the shipped tiny Kimi tokenizer. Every case is also streamed, one id at a time, all at once and in
random chunks, and the assembled deltas must equal the non-streamed parse."""

import random
from itertools import chain

import pytest

from deploy.tool_parser import (K2_MARKERS, K2_THINKING_MARKERS, K2Markers, ParseFinish, ToolCall, ToolCallStream,
                                parse, split_call_id)
from model.tokenizer import SHIPPED_DIR, SHIPPED_RANKS, Tokenizer

SB, SE, CB, AB, CE = 163595, 163596, 163597, 163598, 163599  # section begin/end, call begin, argument begin, call end
TB, TE = 163606, 163607  # <think>, </think> (K2-Thinking, K2.5)
IM_END, K2_FIRST_SPECIAL = 163586, 163584
MARKER_IDS = {SB, SE, CB, AB, CE, TB, TE}


def t(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Byte-level stub that skips special ids; a marker reaching it is a bug of the parser."""
    ids = list(ids)
    assert not MARKER_IDS & set(ids), f"a marker id reached decode: {ids}"
    for i in ids:
        assert 0 <= i < 256 or K2_FIRST_SPECIAL <= i < K2_FIRST_SPECIAL + 256, f"unknown id {i}"
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def call(call_id: str, arguments: str) -> list[int]:
    return [CB, *t(call_id), AB, *t(arguments), CE]


def section(*calls: list[int]) -> list[int]:
    return [SB, *chain.from_iterable(calls), SE]


def assemble(deltas: list[dict]) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, calls) from OpenAI deltas, checking each delta's shape as a client would."""
    content, reasoning, calls = "", "", []
    for d in deltas:
        assert len(d) == 1, d
        if "content" in d:
            assert d["content"], d
            content += d["content"]
        elif "reasoning_content" in d:
            assert d["reasoning_content"], d
            reasoning += d["reasoning_content"]
        else:
            (tc,) = d["tool_calls"]
            if "id" in tc:  # the first delta of a call
                assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function", tc
                assert tc["index"] == len(calls) and tc["function"]["arguments"] == "", tc
                calls.append([tc["id"], tc["function"]["name"], ""])
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                assert tc["index"] == len(calls) - 1 and tc["function"]["arguments"], tc
                calls[-1][2] += tc["function"]["arguments"]
    return reasoning or None, content or (None if calls else ""), [ToolCall(*c) for c in calls]


def chunkings(ids: list[int]):
    yield "one at a time", [[i] for i in ids]
    yield "all at once", [ids]
    for seed in range(6):
        rng, rest, chunks = random.Random(seed), list(ids), []
        while rest:
            n = rng.randint(1, 6)
            chunks.append(rest[:n])
            rest = rest[n:]
        yield f"random chunks (seed {seed})", chunks


def check(ids: list[int], markers: K2Markers = K2_THINKING_MARKERS, dec=decode, **kw):
    """parse(ids), after checking that every streaming of ids assembles to exactly it."""
    want = parse(ids, dec, markers, **kw)
    for how, chunks in chunkings(ids):
        stream = ToolCallStream(dec, markers, **kw)
        deltas = [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()
        assert assemble(deltas) == (want.reasoning, want.content, list(want.tool_calls)), how
        assert stream.result == want, how
        if "\ufffd" not in f"{want}":
            assert "\ufffd" not in f"{deltas}", f"{how}: a split UTF-8 character was streamed as U+FFFD"
    return want


def test_one_call():
    r = check(section(call("functions.get_weather:0", '{"city": "Paris"}')) + [IM_END])
    assert r.tool_calls == (ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),)
    assert (r.reasoning, r.content, r.finish) == (None, None, ParseFinish())
    assert r.finish_reason("stop") == "tool_calls"


def test_two_calls_keep_the_models_ids_and_multibyte_arguments():
    r = check(section(call("functions.get_weather:3", '{"city": "北京"}'),
                      call(" functions.send_message:4 ", '{"text": "ok 🙂"}')) + [IM_END])
    assert r.tool_calls == (ToolCall("functions.get_weather:3", "get_weather", '{"city": "北京"}'),
                            ToolCall("functions.send_message:4", "send_message", '{"text": "ok 🙂"}'))
    assert r.content is None and r.finish == ParseFinish()


def test_content_then_calls():
    r = check(t("Let me check — ça marche. ") + section(call("functions.lookup:0", '{"q": "x"}')) + [IM_END])
    assert r.content == "Let me check — ça marche. "
    assert [c.name for c in r.tool_calls] == ["lookup"]


def test_plain_content_without_calls():
    r = check(t("Hello, wörld!") + [IM_END])
    assert (r.reasoning, r.content, r.tool_calls, r.finish) == (None, "Hello, wörld!", (), ParseFinish())
    assert r.finish_reason("stop") == "stop"


def test_reasoning_then_calls():
    ids = t("I need the weather.") + [TE] + t("Checking.") + section(call("functions.get_weather:0", "{}"))
    r = check(ids, think=True)  # the K2-Thinking prompt ended with <think>
    assert (r.reasoning, r.content) == ("I need the weather.", "Checking.")
    assert r.tool_calls == (ToolCall("functions.get_weather:0", "get_weather", "{}"),)
    assert check([TB] + ids) == r  # the model opened <think> itself
    # the section begins inside the reasoning: it closes the reasoning
    r = check(t("thinking") + section(t("\n"), call("functions.f:0", "{}")), think=True)
    assert (r.reasoning, r.content, len(r.tool_calls)) == ("thinking", None, 1)
    # a <think> before any section opens reasoning once; later think markers are dropped, their text stays content
    r = check(t("a") + [TB] + t("b") + [TE] + t("c") + [TB] + t("d") + [TE] + t("e"))
    assert (r.reasoning, r.content) == ("b", "acde")
    r = check(section(call("functions.f:0", "{}")) + [TB] + t("x") + [TE])
    assert (r.reasoning, r.content, len(r.tool_calls)) == (None, "x", 1)


def test_think_needs_think_markers():
    with pytest.raises(ValueError, match="think"):
        parse(t("x"), decode, K2_MARKERS, think=True)
    with pytest.raises(ValueError, match="think"):
        ToolCallStream(decode, K2_MARKERS, think=True)


def test_a_call_cut_off_in_its_arguments_is_reported_with_what_arrived():
    ids = [SB, *call("functions.a:0", '{"x": 1}'), CB, *t("functions.b:1"), AB, *t('{"city": "Ber')]
    r = check(ids)
    assert r.tool_calls == (ToolCall("functions.a:0", "a", '{"x": 1}'), ToolCall("functions.b:1", "b", '{"city": "Ber'))
    assert r.finish == ParseFinish(cut_off=True, invalid_arguments=(1,))
    assert r.finish_reason("length") == "length"


def test_a_call_cut_off_in_its_id_is_not_reported():
    r = check([SB, *call("functions.a:0", "{}"), CB, *t("functions.get_we")])
    assert r.tool_calls == (ToolCall("functions.a:0", "a", "{}"),) and r.finish == ParseFinish(cut_off=True)
    # every call closed but not the section: still cut off
    assert check([SB, *call("functions.a:0", "{}")]).finish == ParseFinish(cut_off=True)


def test_malformed_arguments_pass_through_as_text():
    r = check(section(call("functions.f:0", "{city: Paris"), call("functions.g:1", "[1, 2]"),
                      call("functions.h:2", '{"ok": true}')))
    assert [c.arguments for c in r.tool_calls] == ["{city: Paris", "[1, 2]", '{"ok": true}']
    assert r.finish == ParseFinish(cut_off=False, invalid_arguments=(0, 1))
    assert r.finish_reason("stop") == "tool_calls"


def test_tools_disabled_drops_the_markers_and_keeps_their_text_as_content():
    ids = t("Sure. ") + section(call("functions.f:0", '{"a": 1}')) + t(" done") + [IM_END]
    r = check(ids, tools_enabled=False)
    assert r.content == 'Sure. functions.f:0{"a": 1} done'
    assert (r.reasoning, r.tool_calls, r.finish) == (None, (), ParseFinish())
    assert r.finish_reason("stop") == "stop"
    assert check(t("hm") + [TE] + ids, think=True, tools_enabled=False).reasoning == "hm"  # reasoning still parsed


def test_stray_markers_and_text_around_calls():
    ids = [CE, AB, *t("a"), SB, *t("\n"), AB, *call("functions.f:0", "{}"), *t(" x "), CB, *t("functions.g:1"), CE,
           CB, *t("functions.h:2"), AB, *t("{}"), SE, SE, *t("b")]
    r = check(ids)
    assert r.content == "ab"  # stray markers dropped; text between calls dropped; text after the section kept
    assert r.tool_calls == (ToolCall("functions.f:0", "f", "{}"), ToolCall("functions.g:1", "g", ""),
                            ToolCall("functions.h:2", "h", "{}"))  # a call closed by the section's end
    assert r.finish == ParseFinish(cut_off=False, invalid_arguments=(1,))
    # a call begin without a section opens one; a new call begin closes the open call
    r = check([CB, *t("functions.f:0"), AB, *t("{}"), CB, *t("functions.g:1"), AB, *t("{}"), SE])
    assert [c.name for c in r.tool_calls] == ["f", "g"] and r.finish == ParseFinish()


def test_split_call_id():
    assert split_call_id(" functions.get_weather:12\n") == ("functions.get_weather:12", "get_weather")
    assert split_call_id("get_weather") == ("get_weather", "get_weather")
    assert split_call_id("functions.a:b") == ("functions.a:b", "a:b")


def test_the_stream_sends_text_as_it_comes_and_each_call_header_once_its_id_is_complete():
    stream = ToolCallStream(decode, K2_MARKERS)
    assert stream.feed(t("Hi")) == [{"content": "Hi"}]
    assert stream.feed([0xC3]) == []  # the first byte of "é" is held back
    assert stream.feed([0xA9]) == [{"content": "é"}]
    assert stream.feed([SB, CB, *t("functions.f:7")]) == []
    assert stream.feed([AB]) == [{"tool_calls": [{"index": 0, "id": "functions.f:7", "type": "function",
                                                  "function": {"name": "f", "arguments": ""}}]}]
    assert stream.feed(t('{"a"')) == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}]
    assert stream.feed([0xE2, 0x82]) == []  # "€" split over three ids
    assert stream.feed([0xAC, CE, SE]) == [{"tool_calls": [{"index": 0, "function": {"arguments": "€"}}]}]
    assert stream.finish() == []
    assert stream.result.tool_calls == (ToolCall("functions.f:7", "f", '{"a"€'),)
    with pytest.raises(ValueError, match="after finish"):
        stream.feed([1])


def test_markers_constants_are_k2s_ids():
    assert (K2_MARKERS.section_begin, K2_MARKERS.section_end, K2_MARKERS.call_begin, K2_MARKERS.argument_begin,
            K2_MARKERS.call_end, K2_MARKERS.think_begin) == (163595, 163596, 163597, 163598, 163599, None)
    assert (K2_THINKING_MARKERS.think_begin, K2_THINKING_MARKERS.think_end) == (163606, 163607)
    with pytest.raises(ValueError, match="distinct"):
        K2Markers(1, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="both"):
        K2Markers(1, 2, 3, 4, 5, think_begin=6)


def test_from_tokenizer_names_a_missing_marker():
    with pytest.raises(ValueError, match=r"<\|tool_calls_section_begin\|>"):
        K2Markers.from_tokenizer(Tokenizer.from_dir(SHIPPED_DIR / "deepseek"))


def test_from_tokenizer_finds_think_tokens_only_as_specials():
    class FakeTokenizer:
        def __init__(self, vocab, special):
            self._vocab, self.special_token_ids = vocab, frozenset(special)

        def token_to_id(self, token):
            return self._vocab.get(token)

    names = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
    vocab = {name: 100 + k for k, name in enumerate(names)}
    want = K2Markers(100, 101, 102, 103, 104, think_begin=105, think_end=106)
    assert K2Markers.from_tokenizer(FakeTokenizer(vocab, vocab.values())) == want
    assert K2Markers.from_tokenizer(FakeTokenizer(vocab, range(100, 105))).think_begin is None


def test_through_the_shipped_kimi_tokenizer():
    tok = Tokenizer.from_dir(SHIPPED_DIR / "kimi")
    markers = K2Markers.from_tokenizer(tok)
    # the same offsets from the first special id as K2's real ids, K2-Thinking's <think> </think> too
    assert markers == K2Markers(*(SHIPPED_RANKS + i - K2_FIRST_SPECIAL for i in (SB, SE, CB, AB, CE, 163606, 163607)))

    def tok_decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    text = ('Sure — 北京 first.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city": "北京"}<|tool_call_end|><|tool_call_begin|>functions.ping:1'
            '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    ids = tok.encode(text)
    assert any(tok_decode([i]).endswith("\ufffd") for i in ids), "no character split over ids: the test is weak"
    r = check(ids, markers, tok_decode)
    assert r.content == "Sure — 北京 first."
    assert r.tool_calls == (ToolCall("functions.get_weather:0", "get_weather", '{"city": "北京"}'),
                            ToolCall("functions.ping:1", "ping", "{}"))
    assert r.finish == ParseFinish()
    r = check(ids, markers, tok_decode, tools_enabled=False)
    assert r.content == 'Sure — 北京 first.functions.get_weather:0{"city": "北京"}functions.ping:1{}'
