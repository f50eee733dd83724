"""The rest of what SDKs send, as protocol (no app served): penalties, min_p and logit_bias mapped
into the sampling parameters; special tokens left out of the text (skip_special_tokens,
include_stop_str_in_output, stop_token_ids); every field of OpenAI's request bodies accepted; vLLM's
/tokenize and /detokenize; running text offsets in logprobs; a choice stopped by its stop string
stops alone, and the stream mux's engine calls are never children of the Serve request that made
them (Serve's request context: the one test here that imports Ray; it starts nothing); a burst of
submits counts against the queue's room before it reaches the engine.

The same behaviours served over HTTP are in test_api_gaps_inproc.py (one process, no Ray); a
non-streamed request whose client went away under Serve, in test_live.py."""

import asyncio
import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from actors.messages import SampledToken
from deploy.fanout import Fanout
from deploy.openai_api import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                               TokenizeCompletionRequest, _template_message, chat_prompt_ids, detokenize_text,
                               models_response, parse_request, parse_tokenize, sampling_params, tokenize_ids,
                               tokenize_response)
from deploy.output import StopStrings, completion_logprobs
from model.tokenizer import SHIPPED_DIR, Tokenizer
from test_openai_api import LIMIT, USER, api_error, body, chat, completion


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
    from cluster.stream import EngineRequest
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


# ---------------------------------------------------------------- chat content (no Ray)


def test_chat_content_keeps_the_stop_string_with_include_stop_str_in_output(tok):
    from cluster.stream import StreamChunk
    from deploy.chat_turn import ChatPlan
    from deploy.output import ChoiceOutput, OutputOptions

    plan = ChatPlan([1], None, None, False, False)
    for include, want in ((False, "ab"), (True, "abEND")):
        out = ChoiceOutput(tok, 0, OutputOptions(stop=("END",), include_stop_str_in_output=include), chat=True,
                           plan=plan)
        piece, stopped = out.push(StreamChunk(tuple(tok.encode("abEND and more")), None))
        assert stopped and "".join(d["content"] for d in piece.deltas) == want
        assert out.result().message["content"] == want and piece.finish_reason == "stop"
