"""The rest of what SDKs send, served over HTTP in one process (no Ray): logit_bias, penalties and
min_p reaching the sampler; special tokens left out of the text (skip_special_tokens,
include_stop_str_in_output, stop_token_ids, the end-of-turn token); an SDK request with every field;
vLLM's /tokenize and /detokenize and /v1/models; running text offsets in streamed logprobs; a choice
stopped by its stop string stops decoding while the others run on.

One in-process app for the module (tests/deploy/inproc.py). The protocol tests are in
test_api_gaps.py; a client that goes away is in test_doors_inproc.py (and under Serve in test_live.py)."""

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.openai_api import chat_prompt_ids
from inproc import preset, serve
from model.tokenizer import Tokenizer
from test_api_gaps import SDK_CHAT
from test_openai_api import USER, chat

KEY = "gaps-key"
NAME = "k2"


@pytest.fixture(scope="module")
def server():
    path = preset("kimi-k2-tiny", seed=4)
    with serve(path, served_model_name=NAME, attention=1, experts=2, api_key=KEY, max_queue=32, max_num_seqs=8,
               num_blocks=512, max_body_bytes=64 * 1024, max_tokens_per_step=64) as s:
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        yield {"url": s.url, "tok": Tokenizer.from_dir(path), "port": s.port}


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120)


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
