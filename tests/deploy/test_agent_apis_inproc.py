"""The agent clients' other two APIs (issue 37): OpenAI's Responses (`/v1/responses`) and Anthropic's
Messages (`/v1/messages`, `/v1/messages/count_tokens`), through the official `openai` and `anthropic`
SDKs against the in-process app (no Ray; tests/deploy/inproc.py). The weights are random, so every
check is one a nonsense-writing model passes only through the grammar, the parser and the protocol
code: tool arguments validate against their schemas, streams obey each protocol's event rules (checked
here by hand, event by event, and by the SDKs' own stream accumulators), and a streamed answer
assembles to the non-streamed one of the same seed.
"""

import asyncio
import copy
import json
import re
import typing
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from anthropic import types as at
from anthropic.types.content_block import ContentBlock

from deploy.anthropic_api import CountTokensRequest, MessagesRequest, ignored_fields
from inproc import post, preset, serve

KEY = "apis-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 16},
    "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}},
             "required": ["day"]}},  # no additionalProperties: closed by default (issue 37)
    "required": ["title", "when"]}
SCHEMAS = {"get_weather": WEATHER, "create_event": EVENT}
A_TOOLS = [{"name": n, "description": f"the {n} tool", "input_schema": s} for n, s in SCHEMAS.items()]
R_TOOLS = [{"type": "function", "name": n, "description": f"the {n} tool", "parameters": s} for n, s in SCHEMAS.items()]
USER = "What is the weather in Paris, and book lunch with Ana."
SEEDS = range(6)


@pytest.fixture(scope="module")
def servers():
    settings = dict(attention=1, experts=1, api_key=KEY, max_num_seqs=32, max_tokens_per_step=512, num_blocks=1024)
    with serve(preset("kimi-k2-tiny", seed=6), served_model_name="k2", **settings) as k2, \
            serve(preset("kimi-k2-thinking-tiny", seed=6), served_model_name="k2t", **settings) as k2t:
        yield {"k2": k2, "k2t": k2t}


def _anthropic(server, cls=anthropic.Anthropic):
    return cls(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def _openai(server, cls=openai.OpenAI):
    return cls(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _sse_events(server, route: str, body: dict) -> list[dict]:
    """The raw stream of a route as (event name, data) pairs, read off the wire."""
    events, name = [], None
    with httpx.stream("POST", f"{server.url}{route}", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name, (name, data)
                events.append(data)
    return events


# ---- the protocols' event rules, checked by hand -------------------------------------------------

_A_DELTAS = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"}, "tool_use": {"input_json_delta"}}


def check_anthropic_events(events: list[dict]) -> dict:
    """Anthropic's stream rules: message_start first, message_stop last; content blocks opened in
    index order 0, 1, ..., one open at a time, each delta for the open block and of its kind, each
    block stopped before the next starts and before message_delta; a tool's input deltas assemble to
    JSON unless the token limit cut the last block (stop_reason max_tokens). Returns the message
    assembled."""
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", [e["type"] for e in events]
    message = copy.deepcopy(events[0]["message"])
    assert message["content"] == []
    open_index, partial, delta_seen, cut = None, {}, False, None
    for e in events[1:-1]:
        kind = e["type"]
        assert not delta_seen or kind == "ping", f"{kind} after message_delta"
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert open_index is None, f"block {e['index']} started while {open_index} is open"
            assert e["index"] == len(message["content"]), f"block index {e['index']}, expected {len(message['content'])}"
            open_index = e["index"]
            message["content"].append(copy.deepcopy(e["content_block"]))
            partial[open_index] = ""
        elif kind == "content_block_delta":
            assert e["index"] == open_index, f"a delta for block {e['index']} while {open_index} is open"
            block, d = message["content"][open_index], e["delta"]
            assert d["type"] in _A_DELTAS[block["type"]], f"{d['type']} in a {block['type']} block"
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            else:
                partial[open_index] += d["partial_json"]
        elif kind == "content_block_stop":
            assert e["index"] == open_index, f"stop of block {e['index']} while {open_index} is open"
            block = message["content"][open_index]
            if block["type"] == "tool_use":
                try:
                    block["input"] = json.loads(partial[open_index]) if partial[open_index] else {}
                except json.JSONDecodeError:  # allowed only where max_tokens cut the last block (checked below)
                    block["input"], cut = partial[open_index], open_index
            open_index = None
        elif kind == "message_delta":
            assert open_index is None, f"message_delta while block {open_index} is open"
            message.update(e["delta"])
            message["usage"]["output_tokens"] = e["usage"]["output_tokens"]
            delta_seen = True
        else:
            raise AssertionError(f"unknown event {kind}")
    assert delta_seen, "no message_delta"
    if cut is not None:  # a tool's input JSON left unfinished: only when the token limit ended the message there
        assert message["stop_reason"] == "max_tokens" and cut == len(message["content"]) - 1, \
            f"block {cut}'s input is not JSON and the message ended with {message['stop_reason']!r}"
    return message


def check_responses_events(events: list[dict]) -> dict:
    """The Responses stream rules: sequence numbers 0, 1, ...; response.created then .in_progress
    first and response.completed / .incomplete last (carrying the whole response); items added in
    output_index order, one open at a time, every delta for the open item (by output_index and
    item_id) and of its kind, its .done events before its output_item.done, whose item is what the
    deltas built. Returns the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    items, open_index, text = [], None, {}
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_index is None and e["output_index"] == len(items), (e, open_index, len(items))
            items.append(copy.deepcopy(e["item"]))
            open_index, text = e["output_index"], {"text": "", "args": "", "parts": 0, "done": set()}
            continue
        assert open_index is not None and e["output_index"] == open_index, (kind, e["output_index"], open_index)
        item = items[open_index]
        assert e.get("item_id", item["id"]) == item["id"]
        if kind == "response.content_part.added":
            assert item["type"] == "message" and e["content_index"] == text["parts"] == 0
            item["content"].append(copy.deepcopy(e["part"]))
            text["parts"] += 1
        elif kind == "response.output_text.delta":
            assert item["type"] == "message" and e["content_index"] < text["parts"] and not text["done"]
            item["content"][e["content_index"]]["text"] += e["delta"]
        elif kind == "response.reasoning_text.delta":
            assert item["type"] == "reasoning" and not text["done"]
            text["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            assert item["type"] == "function_call" and not text["done"]
            item["arguments"] += e["delta"]
        elif kind in ("response.output_text.done", "response.content_part.done", "response.reasoning_text.done",
                      "response.function_call_arguments.done"):
            text["done"].add(kind)
            if kind == "response.output_text.done":
                assert e["text"] == item["content"][e["content_index"]]["text"]
            elif kind == "response.reasoning_text.done":
                assert e["text"] == text["text"]
            elif kind == "response.function_call_arguments.done":
                assert e["arguments"] == item["arguments"]
        elif kind == "response.output_item.done":
            done = e["item"]
            if item["type"] == "message":
                assert text["done"] == {"response.output_text.done", "response.content_part.done"}
                assert done["content"] == item["content"]
            elif item["type"] == "reasoning":
                assert text["done"] == {"response.reasoning_text.done"}
                assert done["content"][0]["text"] == text["text"]
            else:
                assert text["done"] == {"response.function_call_arguments.done"}
                assert done["arguments"] == item["arguments"] and done["call_id"] == item["call_id"]
            items[open_index] = done
            open_index = None
        else:
            raise AssertionError(f"unknown event {kind}")
    assert open_index is None, "an item was never done"
    final = events[-1]["response"]
    assert final["output"] == items
    return final


def _strip(obj):
    """An answer without what differs between two requests: ids, times, and how much of the prompt the
    prefix cache held (the second of two equal requests finds the first's blocks); the prompt's and the
    output's token counts stay."""
    if isinstance(obj, dict):
        out = {k: _strip(v) for k, v in obj.items() if k not in ("id", "created_at", "item_id")}
        if "cache_read_input_tokens" in out:  # Anthropic's usage: input_tokens is what the cache did not hold
            out["input_tokens"] += out.pop("cache_read_input_tokens")
        out.pop("input_tokens_details", None)
        return out
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


# ---- Anthropic Messages --------------------------------------------------------------------------

def _check_tool_uses(message, names=SCHEMAS) -> list:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses, message
    for b in uses:
        assert b.name in names
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return uses


def _samples(client, resource: str, stream: bool, **kw) -> list:
    """len(SEEDS) requests at once through an async SDK's ``client.<resource>`` (messages, responses):
    ``create``, or ``stream`` and its final answer. Unseeded (neither API has a seed), so callers ask
    for one tool call: a random model's parallel calls (up to 16) can run past any token limit, and an
    incomplete answer is no answer to check."""
    async def one():
        api = getattr(client, resource)
        if not stream:
            return await api.create(**kw)
        async with api.stream(**kw) as s:
            return await (s.get_final_message() if resource == "messages" else s.get_final_response())

    async def run():
        async with client:
            return await asyncio.gather(*(one() for _ in SEEDS))

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_sdk_any_tool_gives_valid_tool_use_blocks(servers, stream):
    # Anthropic's API has no seed, and newer SDKs send no temperature (1 here): six samples
    for message in _samples(_anthropic(servers["k2"], anthropic.AsyncAnthropic), "messages", stream, model="k2",
                            max_tokens=400, messages=[{"role": "user", "content": USER}], tools=A_TOOLS,
                            tool_choice={"type": "any", "disable_parallel_tool_use": True}):
        assert len(_check_tool_uses(message)) == 1


def test_anthropic_tool_result_turn_count_tokens_and_the_prefix_cache(servers):
    client = _anthropic(servers["k2"])
    history = [{"role": "user", "content": USER}]
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    first = client.messages.create(model="k2", max_tokens=400, messages=history, tools=A_TOOLS, tool_choice=any_one)
    counted = client.messages.count_tokens(model="k2", messages=history, tools=A_TOOLS).input_tokens
    assert counted == first.usage.input_tokens + first.usage.cache_read_input_tokens
    uses = _check_tool_uses(first)
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "done",
                                              "is_error": True} for b in uses]}]
    second = client.messages.create(model="k2", max_tokens=400, messages=history, tools=A_TOOLS, tool_choice=any_one)
    ids = [b.id for b in _check_tool_uses(second)]
    assert ids[0] == f"functions.{second.content[0].name}:{len(uses)}"  # ids go on counting over the conversation
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt, found in the prefix cache
    assert client.messages.count_tokens(model="k2", messages=history, tools=A_TOOLS).input_tokens == \
        second.usage.input_tokens + second.usage.cache_read_input_tokens
    free = client.messages.create(model="k2", max_tokens=8, messages=history, tools=A_TOOLS,
                                  stop_sequences=["e"])  # auto: text or a call; a stop sequence or the limit
    assert free.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert (free.stop_sequence == "e") == (free.stop_reason == "stop_sequence")


@pytest.mark.parametrize("form", ["model_dump", "objects", "to_param"])
def test_anthropic_sdk_tool_use_blocks_go_back_as_the_sdk_returned_them(servers, form):
    """Agent frameworks send the assistant turn back as the SDK gave it: ``model_dump()`` (every field,
    ``caller: None`` and ``toolset_name: None`` included), the block objects, or ``Message.to_param()``."""
    client = _anthropic(servers["k2"])
    one = {"type": "any", "disable_parallel_tool_use": True}
    history = [{"role": "user", "content": USER}]
    first = client.messages.create(model="k2", max_tokens=400, messages=history, tools=A_TOOLS, tool_choice=one)
    uses = _check_tool_uses(first)
    assistant = {"model_dump": {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 "objects": {"role": "assistant", "content": first.content},
                 "to_param": first.to_param()}[form]
    history += [assistant, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"}
                                                        for b in uses]}]
    second = client.messages.create(model="k2", max_tokens=400, messages=history, tools=A_TOOLS, tool_choice=one)
    # the call was rendered back as a call: K2's ids go on counting from the first turn's
    assert _check_tool_uses(second)[0].id == f"functions.{second.content[0].name}:{len(uses)}"


def _sdk_blocks() -> list:
    """Every block the SDK's ``Message.content`` can hold, built from its own classes with every field
    set (``None`` where a field may be): a web search and a code run as Claude makes them, then two calls
    of this server's tools (one from a code-execution container)."""
    direct, coded = at.DirectCaller(type="direct"), at.ServerToolCaller(type="code_execution_20250825", tool_id="srv_3")
    plain = at.DocumentBlock(type="document", title=None, citations=None,
                             source=at.PlainTextSource(type="text", media_type="text/plain", data="Sunny."))
    return [
        at.ThinkingBlock(type="thinking", thinking="The user asks for the weather.", signature="c2ln"),
        at.RedactedThinkingBlock(type="redacted_thinking", data="ZW5jcnlwdGVk"),
        at.TextBlock(type="text", text="Let me look.", citations=None),
        at.ServerToolUseBlock(type="server_tool_use", id="srv_1", name="web_search", input={"query": "Paris"},
                              caller=direct),
        at.WebSearchToolResultBlock(type="web_search_tool_result", tool_use_id="srv_1", caller=None, content=[
            at.WebSearchResultBlock(type="web_search_result", url="https://example.com/paris", title="Paris",
                                    encrypted_content="ZW5j", page_age=None)]),
        at.WebFetchToolResultBlock(type="web_fetch_tool_result", tool_use_id="srv_2", caller=direct,
                                   content=at.WebFetchBlock(type="web_fetch_result", url="https://example.com/paris",
                                                            retrieved_at=None, content=plain)),
        at.CodeExecutionToolResultBlock(
            type="code_execution_tool_result", tool_use_id="srv_3",
            content=at.CodeExecutionResultBlock(
                type="code_execution_result", stdout="21", stderr="", return_code=0,
                content=[at.CodeExecutionOutputBlock(type="code_execution_output", file_id="file_1")])),
        at.BashCodeExecutionToolResultBlock(type="bash_code_execution_tool_result", tool_use_id="srv_4",
                                            content=at.BashCodeExecutionResultBlock(
                                                type="bash_code_execution_result", stdout="", stderr="", return_code=0,
                                                content=[])),
        at.TextEditorCodeExecutionToolResultBlock(
            type="text_editor_code_execution_tool_result", tool_use_id="srv_5",
            content=at.TextEditorCodeExecutionViewResultBlock(type="text_editor_code_execution_view_result",
                                                              content="x = 1", file_type="text", num_lines=None,
                                                              start_line=None, total_lines=None)),
        at.ToolSearchToolResultBlock(type="tool_search_tool_result", tool_use_id="srv_6",
                                     content=at.ToolSearchToolSearchResultBlock(
                                         type="tool_search_tool_search_result",
                                         tool_references=[at.ToolReferenceBlock(type="tool_reference",
                                                                                tool_name="get_weather")])),
        at.ContainerUploadBlock(type="container_upload", file_id="file_2"),
        at.TextBlock(type="text", text="It is sunny.", citations=[
            at.CitationsWebSearchResultLocation(type="web_search_result_location", cited_text="Sunny.",
                                                encrypted_index="aWR4", title=None, url="https://example.com/paris"),
            at.CitationCharLocation(type="char_location", cited_text="Sunny.", document_index=0, document_title=None,
                                    start_char_index=0, end_char_index=6, file_id=None)]),
        at.ToolUseBlock(type="tool_use", id="functions.get_weather:0", name="get_weather", caller=None,
                        toolset_name=None, input={"city": "Paris", "unit": "celsius"}),
        at.ToolUseBlock(type="tool_use", id="functions.get_weather:1", name="get_weather", caller=coded,
                        toolset_name="weather", input={"city": "Oslo", "unit": "celsius"}),
    ]


def test_the_sdk_blocks_cover_every_block_type_and_field_of_the_installed_sdk():
    """A newer SDK with another block type or field fails here until _sdk_blocks (and the server) take it."""
    blocks = _sdk_blocks()
    classes = typing.get_args(typing.get_args(ContentBlock)[0])
    assert {type(b) for b in blocks} == set(classes)
    for cls in classes:
        assert set().union(*(b.model_fields_set for b in blocks if type(b) is cls)) == set(cls.model_fields), cls


@pytest.mark.parametrize("form", ["model_dump", "objects"])
def test_every_sdk_block_is_accepted_back_and_what_cannot_be_used_is_not_rendered(servers, form):
    """Each block type the SDK returns, sent back as assistant content (its ``model_dump()``, ``None``s and
    all, or the objects): a 200. Server-tool blocks, ``redacted_thinking`` and ``container_upload`` are not
    rendered: the prompt counts the same tokens as the history of text, thinking and tool_use alone."""
    client = _anthropic(servers["k2"])
    blocks = _sdk_blocks()
    rendered = [b.model_dump(exclude_none=True) for b in blocks if b.type in ("text", "thinking", "tool_use")]

    def history(content):
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"}
                   for b in blocks if b.type == "tool_use"]
        return [{"role": "user", "content": USER}, {"role": "assistant", "content": content},
                {"role": "user", "content": [*results, {"type": "text", "text": "And tomorrow?"}]}]

    sent = history([b.model_dump() for b in blocks] if form == "model_dump" else blocks)
    wire = [b.model_dump(exclude_unset=form == "objects") for b in blocks]  # the SDK sends objects' set fields
    assert any(v is None for b in wire for v in b.values())  # the Nones go too
    answer = client.messages.create(model="k2", max_tokens=8, messages=sent, tools=A_TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.output_tokens > 0

    def count(messages) -> int:
        return client.messages.count_tokens(model="k2", messages=messages, tools=A_TOOLS).input_tokens

    assert count(sent) == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert count(sent) == count(history(rendered))
    # and the calls are rendered (the turns up to the assistant's, with and without its tool_use blocks)
    assert count(history(rendered)[:2]) > count(history([b for b in rendered if b["type"] != "tool_use"])[:2])


def test_anthropic_thinking_block_comes_back_and_is_accepted_in_history(servers):
    client = _anthropic(servers["k2t"])
    history = [{"role": "user", "content": USER}]
    first = client.messages.create(model="k2t", max_tokens=24, messages=history)
    thinking = [b for b in first.content if b.type == "thinking"]
    assert thinking and thinking[0].thinking and thinking[0].signature  # a random model rarely closes </think>
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": "go on"}]
    second = client.messages.create(model="k2t", max_tokens=8, messages=history)
    assert second.stop_reason in ("end_turn", "max_tokens") and second.usage.output_tokens > 0
    off = client.messages.create(model="k2t", max_tokens=8, messages=history[:1], thinking={"type": "disabled"})
    assert not any(b.type == "thinking" for b in off.content)


@pytest.mark.parametrize("body", [
    dict(max_tokens=300, tools=A_TOOLS, tool_choice={"type": "any"}, temperature=1.0, top_k=50),
    dict(max_tokens=40, temperature=1.0),
], ids=["tools", "text"])
def test_anthropic_stream_obeys_the_event_rules_and_assembles_to_the_whole_answer(servers, body):
    body = {"model": "k2", "messages": [{"role": "user", "content": USER}], **body}
    for seed_server in ("k2", "k2t"):
        server = servers[seed_server]
        b = {**body, "model": seed_server, "metadata": {"user_id": "u1"}}
        streamed = check_anthropic_events(_sse_events(server, "/v1/messages", {**b, "top_k": 1}))
        whole = post(server, "/v1/messages", {**b, "top_k": 1}, KEY).json()
        assert _strip(streamed) == _strip(whole)


def test_the_anthropic_checker_fails_on_one_misplaced_event(servers):
    body = {"model": "k2t", "max_tokens": 300, "messages": [{"role": "user", "content": USER}], "tools": A_TOOLS,
            "tool_choice": {"type": "any"}}
    events = _sse_events(servers["k2t"], "/v1/messages", body)
    check_anthropic_events(events)
    kinds = [e["type"] for e in events]
    stop = kinds.index("content_block_stop")
    for broken in (events[:stop] + events[stop + 1:stop + 2] + [events[stop]] + events[stop + 2:],  # stop moved
                   events[1:],  # no message_start
                   [e if e["type"] != "content_block_start" else {**e, "index": e["index"] + 1} for e in events]):
        with pytest.raises(AssertionError):
            check_anthropic_events(broken)


def test_the_anthropic_checker_allows_a_tool_input_cut_only_by_the_token_limit():
    """A sampled tool call may run into max_tokens mid-arguments: its input deltas are not JSON, which the
    checker accepts for the last block of a message that stopped on max_tokens, and nowhere else."""
    def stream(stop_reason, inputs=('{"city": "Oslo"}', '{"city": "Par')):
        events = [{"type": "message_start", "message": {"content": [], "usage": {"output_tokens": 0}}}]
        for k, text in enumerate(inputs):
            events += [{"type": "content_block_start", "index": k,
                        "content_block": {"type": "tool_use", "id": f"t{k}", "name": "get_weather", "input": {}}},
                       {"type": "content_block_delta", "index": k, "delta": {"type": "input_json_delta", "partial_json": text}},
                       {"type": "content_block_stop", "index": k}]
        return events + [{"type": "message_delta", "delta": {"stop_reason": stop_reason}, "usage": {"output_tokens": 9}},
                         {"type": "message_stop"}]

    message = check_anthropic_events(stream("max_tokens"))
    assert message["content"][0]["input"] == {"city": "Oslo"} and message["content"][1]["input"] == '{"city": "Par'
    for broken in (stream("tool_use"), stream("max_tokens", ('{"city": "Par', '{"city": "Oslo"}'))):
        with pytest.raises(AssertionError, match="is not JSON"):
            check_anthropic_events(broken)


def test_anthropic_errors_use_its_envelope(servers):
    s = servers["k2"]
    r = httpx.post(f"{s.url}/v1/messages", json={"model": "k2", "max_tokens": 5, "messages": []},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{s.url}/v1/messages", json={"model": "k2", "max_tokens": 5, "messages": []},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="web_search"):
        _anthropic(s).messages.create(model="k2", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                      tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.NotFoundError):
        _anthropic(s).messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


_IGNORED_SAMPLES = {"metadata": {"user_id": "u1"}, "service_tier": "auto", "container": "container_1",
                    "diagnostics": {}, "inference_geo": "us", "cache_control": {"type": "ephemeral"},
                    "context_management": {"edits": []}, "mcp_servers": [], "speed": "fast", "user_profile_id": "up_1",
                    "workspace_id": "wrk_1"}


def test_anthropic_fields_accepted_and_ignored_change_nothing_and_others_are_a_400(servers):
    """Anthropic rejects fields it does not know (``Extra inputs are not permitted``), at the top level and
    in blocks, and so does moeray (a 400 naming the field); the fields it knows and moeray ignores
    (docs/operations.md lists them) leave the answer as it was."""
    s = servers["k2"]
    assert set(_IGNORED_SAMPLES) == set(ignored_fields(MessagesRequest)) > set(ignored_fields(CountTokensRequest))
    body = {"model": "k2", "max_tokens": 12, "top_k": 1, "messages": [{"role": "user", "content": USER}]}
    plain = post(s, "/v1/messages", body, KEY)
    ignored = post(s, "/v1/messages", {**body, **_IGNORED_SAMPLES}, KEY)
    assert plain.status_code == ignored.status_code == 200, ignored.text
    assert _strip(plain.json()) == _strip(ignored.json())
    count = {k: v for k, v in body.items() if k in ("model", "messages")}
    only_create = set(ignored_fields(MessagesRequest)) - set(ignored_fields(CountTokensRequest))
    use = {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather", "input": {}}
    for route, extra, field in [
            ("/v1/messages", {"response_format": {"type": "json_object"}}, "'response_format'"),
            ("/v1/messages", {"messages": [{"role": "user", "content": USER, "name": "ana"}]}, "'messages[0].name'"),
            ("/v1/messages", {"messages": [{"role": "user", "content": USER},
                                          {"role": "assistant", "content": [{**use, "text": "hi"}]}]},
             "'messages[1].content[0].tool_use.text'"),
            ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": 1}]}]},
             "'messages[0].content[0].text.extra'"),
            *[("/v1/messages/count_tokens", {k: _IGNORED_SAMPLES[k]}, repr(k)) for k in sorted(only_create)]]:
        r = post(s, route, {**(count if "count" in route else body), **extra}, KEY)
        assert r.status_code == 400, (route, extra, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and f"unknown field {field}" in error["message"], error
    r = post(s, "/v1/messages", {**body, "messages": [{"role": "user", "content": 5}]}, KEY)
    assert r.status_code == 400 and "messages[0].content: should be a string or a list" in r.json()["error"]["message"]


def test_the_docs_list_exactly_the_fields_accepted_and_ignored():
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    listed = re.search(r"Top-level fields accepted and ignored: ([^.]*)\.", text)
    assert listed, "docs/operations.md: no 'Top-level fields accepted and ignored: ...' sentence"
    assert sorted(re.findall(r"`(\w+)`", listed.group(1))) == sorted(ignored_fields(MessagesRequest))


# ---- OpenAI Responses ----------------------------------------------------------------------------

def _check_calls(response, names=SCHEMAS) -> list:
    calls = [i for i in response.output if i.type == "function_call"]
    assert response.status == "completed" and calls, response
    for c in calls:
        assert c.name in names
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_openai_responses_required_tool_gives_valid_calls(servers, stream):
    for response in _samples(_openai(servers["k2"], openai.AsyncOpenAI), "responses", stream, model="k2", input=USER,
                             tools=R_TOOLS, tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=400, temperature=1.0):
        assert len(_check_calls(response)) == 1


def test_openai_responses_second_turn_by_items_and_by_previous_response_id(servers):
    client = _openai(servers["k2"])
    first = client.responses.create(model="k2", input=USER, tools=R_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=400, instructions="You are terse.")
    calls = _check_calls(first)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "done"} for c in calls]
    by_items = client.responses.create(model="k2", tools=R_TOOLS, tool_choice="required", max_output_tokens=400,
                                       parallel_tool_calls=False,
                                       input=[{"role": "user", "content": USER},
                                              *[i.model_dump(exclude_none=True) for i in first.output], *outputs])
    assert _check_calls(by_items)[0].call_id.endswith(f":{len(calls)}")  # ids go on counting
    by_id = client.responses.create(model="k2", tools=R_TOOLS, tool_choice="required", max_output_tokens=400,
                                    parallel_tool_calls=False, previous_response_id=first.id, input=outputs)
    assert _check_calls(by_id)[0].call_id.endswith(f":{len(calls)}")  # the stored conversation was continued
    assert by_id.usage.input_tokens_details.cached_tokens > 0 and by_id.previous_response_id == first.id
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="k2", input="hi", previous_response_id="resp_nope", max_output_tokens=4)
    unstored = client.responses.create(model="k2", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="k2", input="hi", previous_response_id=unstored.id, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="file_search"):
        client.responses.create(model="k2", input="hi", tools=[{"type": "file_search", "vector_store_ids": ["v"]}])


@pytest.mark.parametrize("body", [
    dict(tools=R_TOOLS, tool_choice="required", max_output_tokens=300),
    dict(max_output_tokens=40),
    dict(text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
         max_output_tokens=300),
], ids=["tools", "text", "json_schema"])
def test_responses_stream_obeys_the_event_rules_and_assembles_to_the_whole_response(servers, body):
    for name in ("k2", "k2t"):
        b = {"model": name, "input": USER, "temperature": 0.0, **body}
        streamed = check_responses_events(_sse_events(servers[name], "/v1/responses", b))
        whole = post(servers[name], "/v1/responses", b, KEY).json()
        assert _strip(streamed) == _strip(whole)
        if "text" in body and whole["status"] == "completed":
            message = [i for i in whole["output"] if i["type"] == "message"][0]
            jsonschema.validate(json.loads(message["content"][0]["text"]), WEATHER)


def test_the_responses_checker_fails_on_one_misplaced_event(servers):
    b = {"model": "k2t", "input": USER, "tools": R_TOOLS, "tool_choice": "required", "max_output_tokens": 300}
    events = _sse_events(servers["k2t"], "/v1/responses", b)
    check_responses_events(events)
    kinds = [e["type"] for e in events]
    done = kinds.index("response.output_item.done")
    swapped = events[:done - 1] + [events[done], events[done - 1]] + events[done + 1:]
    renumbered = [{**e, "sequence_number": i} for i, e in enumerate(swapped)]
    for broken in (swapped, renumbered, events[1:],
                   [e if e["type"] != "response.output_item.added" else {**e, "output_index": e["output_index"] + 1}
                    for e in events]):
        with pytest.raises(AssertionError):
            check_responses_events(broken)


# ---- grammar defaults and routes -----------------------------------------------------------------

def test_a_tool_schema_without_additional_properties_gets_only_its_properties(servers):
    """EVENT and its nested `when` say nothing of other keys: over 20 seeds, only their properties."""
    tools = [{"type": "function", "function": {"name": "create_event", "parameters": EVENT}}]
    closed = {**EVENT, "additionalProperties": False,
              "properties": {**EVENT["properties"], "when": {**EVENT["properties"]["when"], "additionalProperties": False}}}

    async def run():
        async with _openai(servers["k2"], openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model="k2", messages=[{"role": "user", "content": USER}], tools=tools, tool_choice="required",
                temperature=1.0, seed=s, max_tokens=300, parallel_tool_calls=False) for s in range(20)))

    for r in asyncio.run(run()):
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, closed)
        assert call.function.arguments == json.dumps(args, ensure_ascii=False)  # no free whitespace by default


def test_unknown_routes_list_the_api(servers):
    r = httpx.get(f"{servers['k2'].url}/v1/chat", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    for route in ("POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages", "GET /v1/models"):
        assert route in message
    r = httpx.post(f"{servers['k2'].url}/v1/messages/nope", headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["type"] == "error"  # Anthropic's envelope under its prefix
