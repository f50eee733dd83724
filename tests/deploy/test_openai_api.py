"""The OpenAI protocol layer: request parsing and its 4xx errors, sampling parameters, prompts,
stop strings over streamed text, and response shapes checked against the `openai` package's own
types."""

import json

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from actors.messages import SampledToken
from deploy.openai_api import (SSE_DONE, APIError, ChatCompletionRequest, CompletionRequest, chat_chunk,
                               chat_prompt_ids, chat_response, choice_params, completion_chunk, completion_response,
                               error_body, models_response, parse_request, prompt_token_lists, resolve_model,
                               sampling_params, sse, usage, usage_chunk)
from deploy.output import ChoiceResult, StopStrings, chat_logprobs, completion_logprobs
from model.tokenizer import SHIPPED_DIR, Tokenizer

LIMIT = 1 << 16
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, body(**{"model": "m", "prompt": "hi", **fields}), LIMIT)


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, body(**{"model": "m", "messages": USER, **fields}), LIMIT)


def api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------- parsing


def test_parses_good_requests():
    req = completion(prompt=[[1, 2], [3]], max_tokens=5, temperature=0, top_p=0.5, top_k=-1, seed=7,
                     stop="\n", n=2, logprobs=3, stream=True, stream_options={"include_usage": True},
                     ignore_eos=True, min_tokens=2, user="u", presence_penalty=0, logit_bias={}, best_of=2)
    assert (req.prompt, req.max_tokens, req.n, req.stop_list, req.include_usage) == ([[1, 2], [3]], 5, 2, ["\n"], True)
    c = chat(messages=[{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": None, "refusal": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "content": "42", "tool_call_id": "c1"}],
             max_completion_tokens=9, logprobs=True, top_logprobs=2, stop=["x", "y"], tools=[{"type": "function", "function": {"name": "f"}}])
    assert (c.max_output_tokens, c.top_logprobs, c.stop_list, c.include_usage) == (9, 2, ["x", "y"], False)


@pytest.mark.parametrize("fields,param,needle", [
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"stream": 1}, "stream", "valid boolean"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": ["a", ""]}, "stop", "non-empty"),
    ({"stop": 3}, "stop", "string"),
    ({"prompt": 5}, "prompt", "token ids"),
    ({"prompt": [1, True]}, "prompt", "token ids"),
    ({"echo": True}, "echo", "not supported"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.1}, "frequency_penalty", "greater than or equal to -2"),
    ({"logit_bias": {"x": 10}}, "logit_bias", "token ids written in decimal"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options", "unknown field"),
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"model": None}, "model", "model"),
])
def test_completion_rejects(fields, param, needle):
    err = api_error(completion, **fields)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param), err.message
    assert needle in err.message, err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": param, "code": None}}


@pytest.mark.parametrize("fields,param,needle", [
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"logprobs": 1}, "logprobs", "valid boolean"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages", "only text"),
    ({"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, "messages", "messages[0].mood"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "conflicts"),
    ({"tools": "all"}, "tools", "tools"),
])
def test_chat_rejects(fields, param, needle):
    err = api_error(chat, **fields)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param), err.message
    assert needle in err.message, err.message


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "NaN is not valid JSON"),
    (b"\xff\xff\xff", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"just a string"', "must be a JSON object"),
    (b"[" * 100_000, "not valid JSON"),
])
def test_malformed_json_is_400(raw, needle):
    err = api_error(parse_request, CompletionRequest, raw, 1 << 20)
    assert (err.status, err.type) == (400, "invalid_request_error")
    assert needle in err.message, err.message


def test_oversized_body_is_413():
    raw = body(model="m", prompt="x" * 100)
    err = api_error(parse_request, CompletionRequest, raw, len(raw) - 1)
    assert (err.status, err.type, err.code) == (413, "invalid_request_error", "request_too_large")
    parse_request(CompletionRequest, raw, len(raw))  # exactly at the limit is fine


def test_error_envelope_and_retry_after():
    busy = APIError(503, "queue full", retry_after_s=2.2)
    assert busy.type == "service_unavailable" and busy.headers == {"Retry-After": "3"}
    assert APIError(400, "x").headers == {}
    assert error_body(401, "no key") == {"error": {"message": "no key", "type": "authentication_error",
                                                   "param": None, "code": None}}
    missing = api_error(resolve_model, "gpt-4", ["kimi-k2"])
    assert (missing.status, missing.type, missing.param, missing.code) == (404, "not_found_error", "model",
                                                                           "model_not_found")
    assert resolve_model("kimi-k2", ["kimi-k2"]) == "kimi-k2"


# ---------------------------------------------------------------- sampling parameters


def test_sampling_params_from_completion():
    p = sampling_params(completion(max_tokens=5, temperature=0.5, top_p=0.9, top_k=-1, seed=3, logprobs=2,
                                   ignore_eos=True, min_tokens=1), stop_token_ids=(7,))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.logprobs, p.ignore_eos, p.min_tokens,
            p.stop_token_ids) == (5, 0.5, 0.9, 0, 3, 2, True, 1, (7,))
    assert isinstance(p.temperature, float) and sampling_params(completion(temperature=1)).temperature == 1.0


def test_sampling_params_chat_logprobs_and_context():
    assert sampling_params(chat()).logprobs is None
    assert sampling_params(chat(logprobs=True)).logprobs == 0
    assert sampling_params(chat(logprobs=True, top_logprobs=4)).logprobs == 4
    assert sampling_params(chat(), prompt_len=30, max_model_len=100).max_tokens == 70  # unset: rest of context
    err = api_error(sampling_params, chat(max_completion_tokens=71), prompt_len=30, max_model_len=100)
    assert (err.status, err.param, err.code) == (400, "max_completion_tokens", "context_length_exceeded")
    err = api_error(sampling_params, completion(max_tokens=10), prompt_len=100, max_model_len=100)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")


def test_sampling_params_value_error_becomes_400():
    err = api_error(sampling_params, completion(max_tokens=4, min_tokens=5))
    assert (err.status, err.param) == (400, "min_tokens") and "min_tokens" in err.message


def test_choice_params_seeds():
    seeded = choice_params(sampling_params(completion(seed=10, n=3)), 3)
    assert [p.seed for p in seeded] == [10, 11, 12]
    assert all(p.temperature == 1.0 for p in seeded)
    assert choice_params(sampling_params(completion(seed=10, n=3)), 3) == seeded  # reproducible
    unseeded = choice_params(sampling_params(completion()), 2)
    assert [p.seed for p in unseeded] == [None, None]


# ---------------------------------------------------------------- prompts


def test_prompt_token_lists(tok):
    ids = tok.encode("hello world")
    assert prompt_token_lists(completion(prompt="hello world"), tok) == [ids]
    assert prompt_token_lists(completion(prompt=["hello world", "hi"]), tok) == [ids, tok.encode("hi")]
    assert prompt_token_lists(completion(prompt=[1, 2, 3]), tok) == [[1, 2, 3]]
    assert prompt_token_lists(completion(prompt=[[1], [2, 3]]), tok) == [[1], [2, 3]]


@pytest.mark.parametrize("prompt,needle", [
    ([5, 1024], "prompt[0][1]: token id 1024"),
    ([[5], [-1]], "prompt[1][0]: token id -1"),
    ([], "must not be empty"),
    ("", "must not be empty"),
    ([[1], []], "prompt[1]: must not be empty"),
])
def test_bad_prompts_are_400(tok, prompt, needle):
    err = api_error(prompt_token_lists, completion(prompt=prompt), tok)
    assert (err.status, err.param) == (400, "prompt") and needle in err.message, err.message


def test_chat_prompt_ids(tok):
    parts = chat(messages=[{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}])
    expected = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert chat_prompt_ids(parts, tok) == tok.encode(expected)
    assert tok.decode(chat_prompt_ids(parts, tok)).endswith("<|im_assistant|>assistant<|im_middle|>")
    err = api_error(chat_prompt_ids, chat(messages=[{"role": "user", "content": None}]), tok)
    assert (err.status, err.param) == (400, "messages") and "content" in err.message


# ---------------------------------------------------------------- stop strings


def run(stops, deltas):
    s, out, stopped = StopStrings(stops), [], False
    for d in deltas:
        emit, stopped = s.push(d)
        out.append(emit)
        if stopped:
            break
    return out, stopped, s.flush()


def test_stop_split_over_three_deltas():
    out, stopped, tail = run(["STOP"], ["abc S", "T", "OP then more"])
    assert out == ["abc ", "", ""] and stopped and tail == ""


def test_partial_prefix_that_does_not_match_is_released():
    out, stopped, tail = run(["STOP"], ["abc ST", "ART", " end S"])
    assert out == ["abc ", "START", " end "] and not stopped and tail == "S"
    assert "".join(out) + tail == "abc START end S"


def test_multiple_stop_strings_earliest_wins():
    out, stopped, _ = run(["world", "lo"], ["hel", "lo world"])
    assert "".join(out) == "hel" and stopped
    out, stopped, _ = run(["\n\n", "END"], ["a\n", "b END\n\nc"])
    assert "".join(out) == "a\nb " and stopped


def test_stop_at_the_very_start_and_after_stopping():
    s = StopStrings(["<"])
    assert s.push("<x") == ("", True)
    assert s.push("more") == ("", True) and s.flush() == ""


def test_no_stop_strings_passes_through():
    s = StopStrings([])
    assert s.push("abc") == ("abc", False) and s.flush() == ""
    with pytest.raises(ValueError):
        StopStrings([""])


def test_stop_strings_match_whole_text_oracle():
    text, stops = "the quick brown fox jumps over the lazy dog", ["fox j", "lazy", "quack"]
    for step in (1, 2, 3, 7):
        out, stopped, tail = run(stops, [text[i:i + step] for i in range(0, len(text), step)])
        assert "".join(out) + tail == "the quick brown " and stopped, step


# ---------------------------------------------------------------- responses


def sampled(tok, text):
    return [SampledToken(seq_id=0, token_id=i, logprob=-0.5, top_logprobs=((i, -0.5), (1, float("-inf"))))
            for i in tok.encode(text)]


def test_completion_response_shape(tok):
    lp = completion_logprobs(sampled(tok, "héllo"), tok)
    choices = [ChoiceResult(0, "héllo", tok.encode("héllo"), "length", lp), ChoiceResult(1, "hi", tok.encode("hi"), "stop")]
    resp = completion_response("kimi", choices, usage(3, 5))
    parsed = Completion.model_validate(json.loads(json.dumps(resp)))
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-") and parsed.usage.total_tokens == 8
    lp = parsed.choices[0].logprobs
    assert "".join(lp.tokens) == "héllo" and lp.text_offset == [0, 1, 2, 4]
    assert lp.top_logprobs[0]["h"] == -0.5 and min(lp.top_logprobs[0].values()) == -9999.0
    assert parsed.choices[1].logprobs is None


def test_chat_response_shape(tok):
    lp = chat_logprobs(sampled(tok, "é"), tok)
    resp = chat_response("kimi", [ChoiceResult(0, "héllo", tok.encode("héllo"), "stop", lp)],
                         usage(4, 1), request_id="chatcmpl-abc", created=123)
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(resp)))
    assert (parsed.id, parsed.object, parsed.created) == ("chatcmpl-abc", "chat.completion", 123)
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content == "héllo"
    tok_lp = parsed.choices[0].logprobs.content[0]
    assert tok_lp.token == "é" and bytes(tok_lp.bytes).decode() == "é" and len(tok_lp.top_logprobs) == 2


def test_chat_stream_chunks(tok):
    rid, created = "chatcmpl-1", 5
    first = chat_chunk(rid, "kimi", created, index=0, text="", first=True)
    mid = chat_chunk(rid, "kimi", created, index=0, text="hi", logprobs={"content": []})
    last = chat_chunk(rid, "kimi", created, index=0, finish_reason="stop")
    tail = usage_chunk(rid, "kimi", created, usage(2, 1), chat=True)
    for chunk in (first, mid, last, tail):
        ChatCompletionChunk.model_validate(json.loads(sse(chunk)[len("data: "):]))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert mid["choices"][0]["delta"] == {"content": "hi"} and last["choices"][0]["delta"] == {}
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 3
    assert sse(mid).startswith("data: {") and sse(mid).endswith("\n\n") and SSE_DONE == "data: [DONE]\n\n"


def test_completion_stream_chunks(tok):
    lp = completion_logprobs(sampled(tok, "lo"), tok, text_offset=3)
    final = completion_chunk("cmpl-1", "kimi", 5, index=1, text="lo", finish_reason="length", logprobs=lp)
    parsed = Completion.model_validate(final)  # openai's type requires a finish_reason, so validate the last
    assert parsed.choices[0].logprobs.text_offset[0] == 3
    mid = completion_chunk("cmpl-1", "kimi", 5, index=0, text="a")
    assert mid["choices"][0]["finish_reason"] is None and mid["object"] == "text_completion"
    tail = usage_chunk("cmpl-1", "kimi", 5, usage(1, 1), chat=False)
    assert tail["object"] == "text_completion" and tail["choices"] == []


def test_models_response():
    resp = models_response(["kimi-k2", "tiny"], created=42)
    assert resp["object"] == "list"
    assert [Model.model_validate(m).id for m in resp["data"]] == ["kimi-k2", "tiny"]
