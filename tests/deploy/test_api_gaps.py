"""The rest of what SDKs send: penalties, min_p and logit_bias mapped into the sampling parameters;
special tokens left out of the text (skip_special_tokens, include_stop_str_in_output, stop_token_ids);
every field of OpenAI's request bodies accepted; vLLM's /tokenize and /detokenize; a non-streamed
request whose client went away freed; running text offsets in streamed logprobs; a choice stopped by
its stop string stops decoding while the others run on.

The protocol tests need no Ray; the served ones share one app for the module (the session's Ray
cluster and Serve proxy, as tests/deploy/test_serve.py)."""

import asyncio
import json
import socket
import time
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from actors.messages import SampledToken
from deploy.app import build_app
from deploy.config import ServeConfig
from deploy.fanout import Fanout
from deploy.openai_api import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, StopStrings,
                               TokenizeChatRequest, TokenizeCompletionRequest, _template_message, chat_prompt_ids,
                               completion_logprobs, detokenize_text, models_response, parse_request, parse_tokenize,
                               sampling_params, tokenize_ids, tokenize_response)
from model.presets import build_preset
from model.tokenizer import SHIPPED_DIR, Tokenizer
from test_openai_api import LIMIT, USER, api_error, body, chat, completion

KEY = "gaps-key"
NAME = "k2"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


# ---------------------------------------------------------------- penalties, min_p, logit_bias (no Ray)


def test_penalties_min_p_and_logit_bias_map_into_the_sampling_params():
    p = sampling_params(completion(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3, min_p=0.05,
                                   logit_bias={"7": 100, "5": -100.0, "300": 2.5}), vocab_size=1024)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -1.0, 1.3, 0.05)
    assert p.logit_bias == ((5, -100.0), (7, 100.0), (300, 2.5)) and all(isinstance(b, float) for _, b in p.logit_bias)
    c = sampling_params(chat(presence_penalty=2, frequency_penalty=-2, logit_bias={"0": 1}), vocab_size=1024)
    assert (c.presence_penalty, c.frequency_penalty, c.logit_bias) == (2.0, -2.0, ((0, 1.0),))
    neutral = sampling_params(completion(presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                                         min_p=None, logit_bias=None))
    assert (neutral.presence_penalty, neutral.frequency_penalty, neutral.repetition_penalty, neutral.min_p,
            neutral.logit_bias) == (0.0, 0.0, 1.0, 0.0, ())


@pytest.mark.parametrize("fields,param,needle", [
    ({"logit_bias": {"1024": 5}}, "logit_bias", "token id 1024 is outside the vocabulary"),
    ({"stop_token_ids": [3, 1024]}, "stop_token_ids", "token id 1024 is outside the vocabulary"),
])
def test_token_ids_outside_the_vocabulary_are_400_naming_the_field(fields, param, needle):
    for req in (completion(**fields), chat(**fields)):
        err = api_error(sampling_params, req, vocab_size=1024)
        assert (err.status, err.param) == (400, param) and needle in err.message, err.message


@pytest.mark.parametrize("fields,param,needle", [
    ({"logit_bias": {"-1": 5}}, "logit_bias", "token ids written in decimal"),
    ({"logit_bias": {"007": 5}}, "logit_bias", "token ids written in decimal"),
    ({"logit_bias": {"5": -101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "high"}}, "logit_bias", "logit_bias.5"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": 10.5}, "repetition_penalty", "less than or equal to 10"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    ({"stop_token_ids": 5}, "stop_token_ids", "valid list"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "valid boolean"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "valid boolean"),
])
def test_out_of_bounds_sampling_fields_are_400(fields, param, needle):
    for make in (completion, chat):
        err = api_error(make, **fields)
        assert (err.status, err.param) == (400, param) and needle in err.message, err.message


def test_vllm_output_fields_map_and_default():
    """stop_token_ids reach the engine; the output options stay on the Ingress (never in the params)."""
    req = completion(stop_token_ids=[9, 4], skip_special_tokens=False)
    p = sampling_params(req, stop_token_ids=(4, 2))
    assert p.stop_token_ids == (4, 2, 9) and req.skip_special_tokens is False
    assert not hasattr(p, "skip_special_tokens") and not hasattr(p, "include_stop_str_in_output")
    default = completion()
    assert default.skip_special_tokens is True and default.include_stop_str_in_output is False


# ---------------------------------------------------------------- every documented field (no Ray)


def _documented(params_module) -> set[str]:
    return set(params_module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_every_field_of_openais_request_bodies_is_a_field_here():
    """The `openai` package's own request types list what an SDK may send; each is a field of ours."""
    assert _documented(completion_create_params) <= set(CompletionRequest.model_fields)
    assert _documented(chat_create_params) <= set(ChatCompletionRequest.model_fields)
    assert set(typing.get_type_hints(chat_create_params.ChatCompletionStreamOptionsParam)) <= {
        "include_usage", "include_obfuscation"}


SDK_CHAT = {  # every field, at values an SDK sends
    "user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
    "prediction": {"type": "content", "content": "guess"}, "modalities": ["text"],
    "audio": {"format": "wav", "voice": "alloy"}, "reasoning_effort": "low",
    "web_search_options": {"search_context_size": "low",
                           "user_location": {"type": "approximate", "approximate": {"country": "FR"}}},
    "parallel_tool_calls": True, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "safety_identifier": "s", "verbosity": "low",
    "function_call": {"name": "f"}, "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}},
    "logprobs": True, "top_logprobs": 1, "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": {"type": "object"}, "strict": True}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                               "strict": True, "description": "d"}},
    "chat_template_kwargs": {"thinking": False}, "presence_penalty": 0.1, "frequency_penalty": 0.1,
    "logit_bias": {"5": 1}, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
    "max_completion_tokens": 4, "n": 1, "seed": 1, "stop": ["x"], "temperature": 0.5, "top_p": 0.9,
}


def test_an_sdk_request_with_every_field_validates():
    req = chat(**SDK_CHAT)
    assert req.tool_choice.function.name == "get_weather" and req.response_format.json_schema.schema_ == {
        "type": "object"}
    for choice in ("none", "auto", "required"):
        assert chat(tool_choice=choice).tool_choice == choice
    for fmt in ({"type": "text"}, {"type": "json_object"}):
        assert chat(response_format=fmt).response_format.type == fmt["type"]
    full = completion(best_of=1, echo=False, suffix=None, logprobs=2, user="u", presence_penalty=0.2,
                      frequency_penalty=0.2, logit_bias={"3": -1}, stream=True, stream_options={"include_usage": True})
    assert full.logit_bias == {"3": -1}


@pytest.mark.parametrize("fields,param,needle", [
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required' or"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "'name': str"),
    ({"function_call": "always"}, "function_call", "must be 'none', 'auto' or"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function: field required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools", "unknown field"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs", "valid dictionary"),
    ({"modalities": ["text", "audio"]}, "modalities", "only text output"),
    ({"service_tier": "gold"}, "service_tier", "service_tier"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "512"),
    ({"store": "no"}, "store", "valid boolean"),
    ({"reasoning_effort": "huge"}, "reasoning_effort", "reasoning_effort"),
    ({"web_search_options": {"bogus": 1}}, "web_search_options", "unknown field"),
    ({"frobnicate": True}, "frobnicate", "unknown field 'frobnicate'"),
])
def test_malformed_sdk_fields_are_400_naming_them(fields, param, needle):
    err = api_error(chat, **fields)
    assert (err.status, err.param) == (400, param) and needle in err.message, err.message


def test_reasoning_name_and_tool_call_id_reach_the_template(tok):
    req = chat(messages=[{"role": "user", "content": "hi", "name": "ann"},
                         {"role": "assistant", "content": "yes", "reasoning_content": "thought"},
                         {"role": "assistant", "content": "more", "reasoning": "again"},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    rendered = [_template_message(m) for m in req.messages]
    assert rendered[0]["name"] == "ann" and rendered[1]["reasoning_content"] == "thought"
    assert rendered[2]["reasoning"] == "again" and rendered[3]["tool_call_id"] == "c1"
    assert "reasoning" not in rendered[1] and "reasoning_content" not in rendered[0]
    chat_prompt_ids(req, tok)  # the template takes them


# ---------------------------------------------------------------- output text (no Ray)


def test_stop_string_kept_with_include_stop_str_in_output():
    s = StopStrings(["STOP", "ST!"], include=True)
    assert s.push("abc S") == ("abc ", False) and s.push("TOP and more") == ("STOP", True)
    assert StopStrings(["lo"], include=True).push("hello world") == ("hello", True)
    assert StopStrings(["lo"]).push("hello world") == ("hel", True)


def test_logprob_offsets_count_the_text_and_continue_from_an_offset(tok):
    ids = [*tok.encode("ab"), 876, *tok.encode("c")]
    lp = [SampledToken(0, i, -0.1, ()) for i in ids]
    whole = completion_logprobs(lp, tok)
    assert whole["text_offset"] == [0, 1, 2, 2] and whole["tokens"][2] == tok.decode([876])  # skipped: 0 wide
    shown = completion_logprobs(lp, tok, skip_special_tokens=False)
    assert shown["text_offset"] == [0, 1, 2, 2 + len(tok.decode([876]))]
    first, rest = completion_logprobs(lp[:2], tok), completion_logprobs(lp[2:], tok, text_offset=2)
    assert first["text_offset"] + rest["text_offset"] == whole["text_offset"]


# ---------------------------------------------------------------- /tokenize, /detokenize, /v1/models (no Ray)


def test_tokenize_and_detokenize_bodies(tok):
    p = parse_tokenize(body(model="m", prompt="hello world"), LIMIT)
    assert isinstance(p, TokenizeCompletionRequest) and tokenize_ids(p, tok) == tok.encode("hello world")
    c = parse_tokenize(body(messages=USER, add_generation_prompt=True), LIMIT)
    assert isinstance(c, TokenizeChatRequest) and tokenize_ids(c, tok) == chat_prompt_ids(chat(), tok)
    assert tokenize_response([5, 6], tok, max_model_len=64, token_strs=True) == {
        "count": 2, "max_model_len": 64, "tokens": [5, 6], "token_strs": [tok.id_to_token(5), tok.id_to_token(6)]}
    d = parse_request(DetokenizeRequest, body(model="m", tokens=tok.encode("hi there")), LIMIT)
    assert detokenize_text(d, tok) == "hi there"
    err = api_error(detokenize_text, parse_request(DetokenizeRequest, body(tokens=[1, 1024]), LIMIT), tok)
    assert (err.status, err.param) == (400, "tokens") and "tokens[1]" in err.message
    for raw, param in ((body(prompt=5), "prompt"), (body(messages=[]), "messages"), (body(prompt="x", bogus=1), "bogus"),
                       (b"[1]", None)):
        err = api_error(parse_tokenize, raw, LIMIT)
        assert (err.status, err.param) == (400, param), err.message
    assert models_response(["m"], 1, max_model_len=64)["data"][0]["max_model_len"] == 64


# ---------------------------------------------------------------- one choice stopped alone (no Ray)


def test_a_choice_stopped_early_stops_alone_and_the_last_cancels_the_request():
    stopped, cancelled = [], []
    fan = Fanout(3, lambda: cancelled.append(True), stopped.append)
    fan.stream(1).cancel()
    assert stopped == [1] and not cancelled
    fan.stream(1).cancel()  # once
    fan.stream(0).cancel()
    assert stopped == [1, 0] and not cancelled
    fan.stream(2).cancel()  # the last open choice: the whole request goes, no single stop
    assert stopped == [1, 0] and cancelled == [True]


class _Call:
    """A handle method: ``.remote`` records the Serve request it was made under and answers ``value``."""

    def __init__(self, log: list, name: str, value=None):
        self.log, self.name, self.value = log, name, value

    def remote(self, *args):
        from ray.serve.context import _serve_request_context

        ctx = _serve_request_context.get()
        self.log.append((self.name, ctx._internal_request_id if ctx is not None else ""))
        if self.name == "subscribe":
            return _Subscription()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.value)
        return fut


class _Subscription:
    """A streaming response: ``[]`` (subscribed), then nothing until cancelled."""

    def __init__(self):
        self.sent = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.sent:
            self.sent = True
            return []
        await asyncio.Event().wait()

    def cancel(self):
        pass


class _FakeEngineHandle:
    def __init__(self):
        self.log: list = []
        self.submit, self.cancel = _Call(self.log, "submit"), _Call(self.log, "cancel")
        self.stop_choice, self.subscribe = _Call(self.log, "stop_choice"), _Call(self.log, "subscribe")

    def options(self, **_):
        return self


def test_engine_calls_are_not_children_of_the_request_that_made_them():
    """Serve cancels a request's child calls when its client goes away. The subscription opened during
    one request carries every request of the replica, and a leaving request's cancel must still
    arrive: none of the mux's calls may be a child of the request that made it."""
    from ray.serve.context import _RequestContext, _serve_request_context

    from deploy.mux import StreamMux

    engine = _FakeEngineHandle()

    async def run():
        _serve_request_context.set(_RequestContext(_internal_request_id="client-request"))
        mux = StreamMux(engine, 5)
        fan, refusal = await mux.open([([1], None), ([2], None)])
        fan.stream(0).cancel()  # one choice stopped alone
        fan.close()  # the request leaves
        await asyncio.sleep(0.05)
        mux.close()
        return refusal

    assert asyncio.run(run()) is None
    assert [name for name, _ in engine.log] == ["subscribe", "submit", "stop_choice", "cancel"], engine.log
    assert all(parent == "" for _, parent in engine.log), engine.log


# ---------------------------------------------------------------- the queue's room (no Ray)


class _QueueingEngine:
    """What EngineStreams uses of the async engine: a request's sequences are queued when its stream
    first runs (as AsyncEngine.generate_many queues them), then nothing comes."""

    def __init__(self):
        self.queued = 0

    def check(self, requests):
        pass

    async def generate_many(self, requests):
        self.queued += len(requests)
        await asyncio.Event().wait()
        yield


def test_a_burst_of_submits_counts_against_the_queue_before_their_tasks_run():
    """Several submits can come before any of their forwarding tasks has run (one event-loop turn
    takes a burst of requests): their sequences, not yet in the engine's queue, still count against
    its room (EngineServer.submit adds num_starting to the engine's waiting count)."""
    from cluster.engine import EngineRequest
    from deploy.mux import EngineStreams
    from model.sampling import SamplingParams

    engine = _QueueingEngine()
    req = EngineRequest((1, 2), SamplingParams(max_tokens=2))

    async def run():
        streams = EngineStreams(engine)
        sub = streams.subscribe("s")
        assert await sub.__anext__() == []
        streams.submit("s", 0, [req, req])
        streams.submit("s", 1, [req])
        streams.submit("s", 2, [req])
        streams.cancel("s", [2])  # cancelled before its task ran: it never queues
        assert (streams.num_starting, engine.queued) == (3, 0)
        await asyncio.sleep(0)  # the tasks run: their sequences are in the engine's queue now
        assert (streams.num_starting, engine.queued, streams.num_requests) == (0, 3, 2)
        await sub.aclose()
        assert streams.num_requests == 0 and streams.sinks == {}

    asyncio.run(run())


# ---------------------------------------------------------------- served (one app for the module)


@pytest.fixture(scope="module")
def server(serve_port, tmp_path_factory):
    path = build_preset("kimi-k2-tiny", tmp_path_factory.mktemp("gaps") / "k2", seed=4, progress=False)
    cfg = ServeConfig(model=str(path), served_model_name=NAME, attention=1, experts=2, api_key=KEY, port=serve_port,
                      max_queue=32, max_num_seqs=8, num_blocks=512, max_body_bytes=64 * 1024, max_tokens_per_step=64)
    serve.run(build_app(cfg.model_dump()), name="moeray-gaps", route_prefix="/")
    url = f"http://127.0.0.1:{serve_port}"
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.5)
    yield {"url": url, "tok": Tokenizer.from_dir(path), "port": serve_port}
    serve.delete("moeray-gaps")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0)


def _headers() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _post(server, route: str, payload: dict) -> httpx.Response:
    return httpx.post(f"{server['url']}{route}", headers=_headers(), json=payload, timeout=120)


GREEDY = {"model": NAME, "prompt": [5, 77, 300, 12, 9], "temperature": 0, "ignore_eos": True}


def test_served_logit_bias_forces_a_token(server):
    tok = server["tok"]
    token = tok.encode(" the")[0]
    r = _post(server, "/v1/completions", {**GREEDY, "max_tokens": 4, "logit_bias": {str(token): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([token]) * 4, r.json()
    bad = _post(server, "/v1/completions", {**GREEDY, "logit_bias": {str(tok.vocab_size): 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias", bad.text


def test_served_penalties_and_min_p_are_accepted(server):
    r = _post(server, "/v1/completions", {**GREEDY, "max_tokens": 4, "presence_penalty": 1.5,
                                          "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_served_special_tokens_skipped_by_default_and_stop_token_ids(server):
    """This greedy output starts <|reserved_token_876|> 'orth' ...: by default the special token is not
    in the text; stop_token_ids ends the choice at 'orth', whose text is kept only with
    include_stop_str_in_output."""
    tok = server["tok"]
    kw = {**GREEDY, "max_tokens": 8}
    shown = _post(server, "/v1/completions", {**kw, "skip_special_tokens": False}).json()["choices"][0]["text"]
    plain = _post(server, "/v1/completions", kw).json()["choices"][0]["text"]
    specials = [tok.decode([t]) for t in tok.special_token_ids if tok.decode([t]) in shown]
    without = shown
    for text in specials:
        without = without.replace(text, "")
    assert specials and "<|" not in plain and plain == without, (shown, plain)
    stop = tok.encode("orth")[0]
    cut = _post(server, "/v1/completions", {**kw, "stop_token_ids": [stop], "skip_special_tokens": False}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] == 2, cut
    assert cut["choices"][0]["text"] == tok.decode([876])
    kept = _post(server, "/v1/completions", {**kw, "stop_token_ids": [stop], "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == "orth", kept.text
    bad = _post(server, "/v1/completions", {**kw, "stop_token_ids": [tok.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids", bad.text


def test_served_reply_ending_with_the_end_of_turn_token_does_not_carry_it(server):
    """The end-of-turn token (forced here by logit_bias) ends the reply; its text is not in the content,
    even with skip_special_tokens false, unless include_stop_str_in_output."""
    tok = server["tok"]
    end = tok.token_to_id("<|im_end|>")
    kw = {"model": NAME, "messages": USER, "max_tokens": 5, "temperature": 0, "logit_bias": {str(end): 100}}
    for extra, content in (({}, ""), ({"skip_special_tokens": False}, ""),
                           ({"skip_special_tokens": False, "include_stop_str_in_output": True}, "<|im_end|>")):
        r = _post(server, "/v1/chat/completions", {**kw, **extra}).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["message"]["content"] == content, r


def test_served_sdk_request_with_every_field(server, client):
    fields = {k: v for k, v in SDK_CHAT.items() if k not in ("stream", "stream_options", "tool_choice", "tools")}
    r = _post(server, "/v1/chat/completions", {"model": NAME, "messages": USER, **fields})
    assert r.status_code == 200, r.text
    got = client.chat.completions.create(model=NAME, messages=USER, max_completion_tokens=2, store=False,
                                         metadata={"a": "b"}, user="u", service_tier="auto", parallel_tool_calls=False,
                                         safety_identifier="s", prompt_cache_key="k", verbosity="low",
                                         reasoning_effort="low", extra_body={"min_p": 0.05})
    assert got.usage.completion_tokens <= 2
    bad = _post(server, "/v1/chat/completions", {"model": NAME, "messages": USER, "frobnicate": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "frobnicate"


def test_served_tokenize_detokenize_and_models(server):
    tok, url = server["tok"], server["url"]
    r = _post(server, "/tokenize", {"model": NAME, "prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    assert r["token_strs"] == [tok.id_to_token(i) for i in r["tokens"]]
    c = _post(server, "/tokenize", {"model": NAME, "messages": USER}).json()
    assert c["tokens"] == chat_prompt_ids(chat(), tok) and c["token_strs"] is None
    assert _post(server, "/detokenize", {"model": NAME, "tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    assert _post(server, "/detokenize", {"tokens": [876]}).json() == {"prompt": tok.decode([876])}
    for route, payload, status, param in (("/detokenize", {"tokens": [tok.vocab_size]}, 400, "tokens"),
                                          ("/tokenize", {"prompt": 3}, 400, "prompt"),
                                          ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model")):
        bad = _post(server, route, payload)
        assert bad.status_code == status and bad.json()["error"]["param"] == param, bad.text
    for route in ("/tokenize", "/detokenize"):
        assert httpx.post(f"{url}{route}", json={"prompt": "x", "tokens": [1]}, timeout=30).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers=_headers(), timeout=30).json()
    assert models["data"][0]["max_model_len"] == 4096


def _status(server) -> dict:
    return httpx.get(f"{server['url']}/status", headers=_headers(), timeout=30).json()


def _wait_idle(server, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        st = _status(server)
        if st["running"] == 0 and st["waiting"] == 0 and st["streams"]["requests"] == 0:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)


def test_served_non_streamed_request_freed_when_its_client_goes(server):
    _wait_idle(server, 60)
    before = _generated(server)
    payload = json.dumps({**GREEDY, "prompt": "go", "max_tokens": 4000}).encode()
    sock = socket.create_connection(("127.0.0.1", server["port"]))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(payload)).encode()
                 + b"\r\n\r\n" + payload)
    deadline = time.monotonic() + 60
    while _status(server)["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.5)
    sock.close()
    st = _wait_idle(server, 5)
    assert st["streams"]["subscriptions"] == 1, st  # the replica's engine stream outlives the request
    assert all(a["cache_blocks_used"] == 0 for a in st["attention"]), st
    generated = _generated(server) - before
    assert generated < 4000, generated  # cut short, not run to its max_tokens


def test_served_streamed_logprob_offsets_continue_as_not_streamed(client):
    kw = dict(model=NAME, prompt=[5, 77, 300, 12, 9], max_tokens=12, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert tokens == whole.tokens and offsets == whole.text_offset and offsets[-1] > 0, (offsets, whole.text_offset)


def _generated(server) -> float:
    text = httpx.get(f"{server['url']}/metrics", headers=_headers(), timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "moeray:generation_tokens_total")


def test_served_choice_stopped_by_its_stop_string_stops_decoding(server, client):
    """Two prompts in one request (two sequences behind one fanout): the first meets its stop string
    early, the second runs to max_tokens. The engine generates about max_tokens + a few tokens, not
    2 * max_tokens (the stopped sequence running on until the other finished)."""
    prompts, most = [[5, 77, 300, 12, 9], [42, 43, 44]], 150
    kw = dict(model=NAME, max_tokens=most, temperature=0, extra_body={"ignore_eos": True})
    first, second = (c.text for c in client.completions.create(prompt=prompts, **kw).choices)
    stop = next(first[i:i + 3] for i in range(len(first)) if first[i:i + 3] not in second and len(first[i:i + 3]) == 3)
    assert first.find(stop) < len(first) // 4, (first, stop)
    _wait_idle(server, 60)
    before = _generated(server)
    r = client.completions.create(prompt=prompts, stop=[stop], **kw)
    assert [c.finish_reason for c in r.choices] == ["stop", "length"] and r.choices[0].text == first[:first.find(stop)]
    _wait_idle(server, 30)
    generated = _generated(server) - before
    assert most < generated < most + most // 2, generated


def test_chat_content_keeps_the_stop_string_with_include_stop_str_in_output(tok):
    from cluster.aengine import StreamChunk
    from deploy.chat_turn import ChatPlan
    from deploy.output import ChoiceOutput, OutputOptions

    plan = ChatPlan([1], None, None, False, False)
    for include, want in ((False, "ab"), (True, "abEND")):
        out = ChoiceOutput(tok, 0, OutputOptions(stop=("END",), include_stop_str_in_output=include), chat=True,
                           plan=plan)
        piece, stopped = out.push(StreamChunk(tuple(tok.encode("abEND and more")), None))
        assert stopped and "".join(d["content"] for d in piece.deltas) == want
        assert out.result().message["content"] == want and piece.finish_reason == "stop"
