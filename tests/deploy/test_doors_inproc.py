"""One response path behind every front door (deploy/answer.py), over real HTTP in one process (no Ray;
tests/deploy/inproc.py). The same greedy request through Chat Completions, Anthropic's Messages and
OpenAI's Responses, streamed and whole, read by the official `openai` and `anthropic` clients, gives
the same text, the same token counts and the same end. And the answer ends alike at every door,
Completions included: a client that goes away frees its sequences (a non-streamed answer is a 499,
found by the Ingress's poll: no Serve here to cancel the handler), and an engine that fails mid-answer
ends a stream with the door's own error event and a non-streamed answer with a 503 in the door's
envelope. The same client going away under Serve is in test_live.py."""

import contextlib
import json
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest

from inproc import post, preset, serve

KEY = "doors-key"
NAME = "k2"
USER = "Tell me about the sea."
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages",
          "responses": "/v1/responses"}
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
          "completed": "stop", "incomplete": "length"}  # Messages' stop_reason, a response's status


@pytest.fixture(scope="module")
def server():
    with serve(preset("kimi-k2-tiny", seed=4), served_model_name=NAME, attention=1, experts=2, api_key=KEY,
               max_num_seqs=8, num_blocks=512, max_tokens_per_step=64) as s:
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
        yield s


def _body(door: str, max_tokens: int, **more) -> dict:
    """The same greedy request in each door's words (``more``: fields only OpenAI's doors take)."""
    if door == "completions":
        return {"model": NAME, "prompt": USER, "max_tokens": max_tokens, "temperature": 0, **more}
    if door == "responses":
        return {"model": NAME, "input": USER, "max_output_tokens": max_tokens, "temperature": 0}
    body = {"model": NAME, "messages": [{"role": "user", "content": USER}], "max_tokens": max_tokens, "temperature": 0}
    return {**body, **more} if door == "chat" else body


# ---- one request, one answer, at every door -------------------------------------------------------------------
def test_one_greedy_request_gives_one_answer_through_every_door_streamed_and_whole(server):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    ant = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    chat, messages, responses = _body("chat", 24), _body("messages", 24), _body("responses", 24)
    messages["extra_body"] = {"temperature": messages.pop("temperature")}  # newer SDKs send none themselves
    got = {}  # door → (text, prompt tokens, output tokens, finish)

    r = oai.chat.completions.create(**chat, extra_body={"return_token_ids": True})
    ids = r.to_dict()["choices"][0]["token_ids"]
    got["chat"] = (r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens,
                   r.choices[0].finish_reason)
    chunks = list(oai.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    got["chat, streamed"] = ("".join(p.delta.content or "" for p in pieces), chunks[-1].usage.prompt_tokens,
                             chunks[-1].usage.completion_tokens, pieces[-1].finish_reason)

    def message(m, text=None):
        whole = "".join(b.text for b in m.content if b.type == "text")
        assert text is None or text == whole  # the SDK's accumulated message is its stream's text
        prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens  # Anthropic's split of the prompt
        return whole, prompt, m.usage.output_tokens, FINISH[m.stop_reason]

    got["messages"] = message(ant.messages.create(**messages))
    with ant.messages.stream(**messages) as s:
        text = "".join(s.text_stream)
        got["messages, streamed"] = message(s.get_final_message(), text)

    def response(r, text=None):
        assert text is None or text == r.output_text
        return r.output_text, r.usage.input_tokens, r.usage.output_tokens, FINISH[r.status]

    got["responses"] = response(oai.responses.create(**responses))
    events = list(oai.responses.create(**responses, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    got["responses, streamed"] = response(events[-1].response, text)

    assert len(set(got.values())) == 1, got
    text, _, tokens, _ = got["chat"]
    assert text.strip() and tokens == len(ids), got["chat"]  # a real answer, each of its tokens counted


# ---- how an answer ends: the client goes away, or the engine fails ----------------------------------------------
def _status(server) -> dict:
    return httpx.get(f"{server.url}/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()


def _until(what, why, within_s: float = 20.0) -> None:
    """Wait until ``what()``; else fail saying ``why`` (a string, or a function making one)."""
    deadline = time.monotonic() + within_s
    while not what():
        assert time.monotonic() < deadline, why() if callable(why) else why
        time.sleep(0.02)


def _idle(server) -> dict:
    """/status once no sequence runs or waits and no request is open."""
    st = {}

    def idle():
        st.update(_status(server))
        return st["running"] == 0 and st["waiting"] == 0 and st["streams"]["requests"] == 0

    _until(idle, lambda: f"the engine is still busy: {st}")
    return st


def _freed(server) -> None:
    """Every sequence ended and its cache freed; the replica's engine stream outlives the requests."""
    st = _idle(server)
    assert all(a["cache_blocks_used"] == 0 for a in st["attention"]), st
    assert st["streams"] == {"subscriptions": 1, "requests": 0}, st


def _answers(server, monkeypatch) -> tuple[list, threading.Event]:
    """What the Ingress's one response path answers, request by request, and an event set once a
    request's first tokens are in (its answer has begun)."""
    ingress, out, begun = server.ingress, [], threading.Event()
    serve_one, open_one = ingress._serve, ingress._open

    async def served(*args, **kwargs):
        out.append(await serve_one(*args, **kwargs))
        return out[-1]

    async def opened(*args, **kwargs):
        fan_and_firsts = await open_one(*args, **kwargs)
        begun.set()
        return fan_and_firsts

    monkeypatch.setattr(ingress, "_serve", served)
    monkeypatch.setattr(ingress, "_open", opened)
    return out, begun


@contextlib.contextmanager
def _engine_held(server):
    """The engine thread held between two steps for the block: the answer cannot end meanwhile."""
    inside, go = threading.Event(), threading.Event()
    held = server.engine_server.aengine.control(lambda engine: (inside.set(), go.wait(60))[1])
    assert inside.wait(30), "the engine thread was not held"
    try:
        yield
    finally:
        go.set()
    assert held.result(timeout=30) is True


def _send(server, route: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}"
                 f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("door", list(ROUTES))
def test_a_client_that_goes_away_frees_its_answer_at_every_door(server, door, stream, monkeypatch):
    """The client leaves while its answer runs (the engine held, so the answer cannot end first): the
    Ingress lets go of the request before the engine takes another step, and then every sequence is
    freed. Streamed, Starlette sees the client go; whole, the Ingress's poll does and answers 499."""
    _idle(server)
    (answers, begun), streams = _answers(server, monkeypatch), server.engine_server.streams
    sock = _send(server, ROUTES[door], {**_body(door, 2000, ignore_eos=True), "stream": stream})
    assert begun.wait(30), "the answer never began"
    seen = b""
    while stream and b"data: " not in seen:  # the first event is out
        seen += sock.recv(4096)
        assert seen, "the server closed the stream"
    with _engine_held(server):
        assert streams.num_requests == 1, "the answer ended before its client went away"
        sock.close()
        _until(lambda: streams.num_requests == 0, "the answer outlived its client")
    _freed(server)
    assert [getattr(a, "status_code", None) for a in answers] == [200 if stream else 499], answers


def _failing(generate_many, after: int):
    """``AsyncEngine.generate_many`` whose stream fails after ``after`` chunks: the engine dies mid-answer."""

    async def failing(requests):
        stream, n = generate_many(requests), 0
        try:
            async for item in stream:
                yield item
                n += 1
                if n == after:
                    raise RuntimeError("injected engine failure")
        finally:
            await stream.aclose()

    return failing


def _events(server, route: str, body: dict) -> list[tuple[str | None, object]]:
    """A stream off the wire: (event name or None, data) in order; data is JSON, or the text "[DONE]"."""
    out, name = [], None
    with httpx.stream("POST", f"{server.url}{route}", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
                out.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
    return out


def _error(door: str, message: str, *, event: bool) -> dict:
    """The door's error: Anthropic's envelope on Messages, the Responses API's error event, else OpenAI's
    envelope (its code says the engine failed in a stream's error chunk)."""
    if door == "messages":
        return {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    if door == "responses" and event:
        return {"type": "error", "sequence_number": 0, "code": "engine_failed", "message": message, "param": None}
    return {"error": {"message": message, "type": "service_unavailable", "param": None,
                      "code": "engine_failed" if event else None}}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("door", list(ROUTES))
def test_an_engine_that_fails_mid_answer_ends_it_in_the_doors_error(server, door, stream, monkeypatch):
    """Streamed: what came before stays, and the door's error event ends the stream (OpenAI's chunk
    APIs then send [DONE]). Whole: a 503 with Retry-After in the door's envelope. Either way the
    sequences are freed, and the engine serves on."""
    _idle(server)
    aengine = server.engine_server.aengine
    monkeypatch.setattr(aengine, "generate_many", _failing(aengine.generate_many, after=3))
    body = _body(door, 40, ignore_eos=True)
    if stream:
        events = _events(server, ROUTES[door], body)
        if door in ("completions", "chat"):
            assert events.pop() == (None, "[DONE]"), events
        name, error = events[-1]
        assert len(events) > 3 and name == (None if door in ("completions", "chat") else "error"), events
    else:
        r = post(server, ROUTES[door], body, KEY)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        error = r.json()
    message = error.get("message") or error["error"]["message"]
    assert error == _error(door, message, event=stream)
    assert message.startswith("the request failed while generating (") and "injected engine failure" in message
    _freed(server)
    monkeypatch.undo()
    assert post(server, ROUTES[door], _body(door, 4), KEY).status_code == 200
