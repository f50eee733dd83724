"""Chat templates: K2-Instruct's real layout (names, tool results, tool calls), the K2-Thinking
template (reasoning kept only in the unfinished agent turn, `thinking=false`), template kwargs."""

from __future__ import annotations

import copy

import pytest

from model.chat_template import (K2_CHAT_TEMPLATE, K2_DEFAULT_SYSTEM_PROMPT, K2_THINKING_CHAT_TEMPLATE,
                                 RESERVED_TEMPLATE_KWARGS, check_template_kwargs)
from model.tokenizer import SHIPPED_DIR, SHIPPED_RANKS, Tokenizer
from model.tokenizer_backends import TiktokenBackend

R = SHIPPED_RANKS
IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = R + 2, R + 3, R + 4, R + 10, R + 17
THINK, END_THINK = R + 22, R + 23
K2_SYS = f"<|im_system|>system<|im_middle|>{K2_DEFAULT_SYSTEM_PROMPT}<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def kimi() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED_DIR / "kimi")


@pytest.fixture(scope="module")
def thinking(kimi: Tokenizer) -> Tokenizer:
    """The shipped kimi vocabulary with the K2-Thinking template."""
    return Tokenizer(TiktokenBackend.from_dir(SHIPPED_DIR / "kimi"), bos_token=kimi.bos_token,
                     eos_token=kimi.eos_token, chat_template=K2_THINKING_CHAT_TEMPLATE)


def call(call_id: str | None, name: str, arguments: str) -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return out | ({"id": call_id} if call_id else {})


# An agent conversation: a finished exchange, then a turn still in its tool loop.
AGENT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "reasoning": "need a tool", "tool_calls": [call("functions.w:0", "w", "{}")]},
    {"role": "tool", "tool_call_id": "functions.w:0", "content": "sunny"},
]
AGENT_HEAD = K2_SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
AGENT_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.w:0<|tool_call_argument_begin|>{}"
              "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
              "<|im_system|>tool<|im_middle|>## Return of functions.w:0\nsunny<|im_end|>")


# ---------------------------------------------------------------- K2-Instruct

def test_names_in_role_headers(kimi: Tokenizer):
    msgs = [{"role": "system", "content": "S", "name": "ops"},
            {"role": "user", "content": "Hi", "name": "ann"},
            {"role": "assistant", "content": "Yo", "name": "kimi"},
            {"role": "user", "content": "bye"}]
    out = kimi.apply_chat_template(msgs)
    assert out == ("<|im_system|>ops<|im_middle|>S<|im_end|><|im_user|>ann<|im_middle|>Hi<|im_end|>"
                   "<|im_assistant|>kimi<|im_middle|>Yo<|im_end|><|im_user|>user<|im_middle|>bye<|im_end|>" + GEN)
    enc = kimi.encode
    header = [IM_SYSTEM, *enc("ops"), IM_MIDDLE, *enc("S"), IM_END, IM_USER, *enc("ann"), IM_MIDDLE]
    assert enc(out)[:len(header)] == header
    assert K2_DEFAULT_SYSTEM_PROMPT not in out  # the first message is a (named) system message


def test_tool_result_renders_return_of(kimi: Tokenizer):
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call("functions.f:0", "f", '{"a": 1}')]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": [{"type": "text", "text": "42"}]}]
    out = kimi.apply_chat_template(msgs, add_generation_prompt=False)
    tail = "<|im_system|>tool<|im_middle|>## Return of functions.f:0\n42<|im_end|>"
    assert out.endswith(tail)
    enc = kimi.encode
    assert enc(out)[-len(enc(tail)):] == [IM_SYSTEM, *enc("tool"), IM_MIDDLE, *enc("## Return of functions.f:0\n42"),
                                          IM_END]


def test_tool_call_ids_count_across_the_conversation(kimi: Tokenizer):
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "A", "tool_calls": [call(None, "f", "{}")]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"},
            {"role": "assistant", "content": None, "tool_calls": [call(None, "g", "{}"), call("mine", "h", {"x": "é"})]}]
    out = kimi.apply_chat_template(msgs, add_generation_prompt=False)
    assert "A<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}" in out
    assert "<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}<|tool_call_end|>" in out
    assert '<|tool_call_begin|>mine<|tool_call_argument_begin|>{"x": "é"}<|tool_call_end|>' in out


def test_instruct_template_ignores_reasoning_and_thinking(kimi: Tokenizer):
    out = kimi.apply_chat_template(AGENT)
    assert out == AGENT_HEAD + "<|im_assistant|>assistant<|im_middle|>Hello.<|im_end|>" \
        "<|im_user|>user<|im_middle|>weather?<|im_end|><|im_assistant|>assistant<|im_middle|>" + AGENT_CALL + GEN
    assert kimi.apply_chat_template(AGENT, thinking=False) == out
    assert not kimi.thinking and "<think>" not in K2_CHAT_TEMPLATE


# ---------------------------------------------------------------- K2-Thinking

def test_thinking_keeps_only_the_unfinished_turns_reasoning(thinking: Tokenizer):
    out = thinking.apply_chat_template(AGENT)
    assert out == (AGENT_HEAD + "<|im_assistant|>assistant<|im_middle|><think></think>Hello.<|im_end|>"
                   "<|im_user|>user<|im_middle|>weather?<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|><think>need a tool</think>" + AGENT_CALL + GEN)
    ids = thinking.encode(out)
    assert ids.count(THINK) == 2 and ids.count(END_THINK) == 2
    assert ids[ids.index(THINK) + 1] == END_THINK  # the finished turn's reasoning is gone
    assert thinking.decode(ids[ids.index(THINK, ids.index(THINK) + 1) + 1:ids.index(END_THINK, ids.index(END_THINK) + 1)]) \
        == "need a tool"


def test_thinking_drops_reasoning_once_the_turn_is_answered(thinking: Tokenizer):
    answered = AGENT + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "done"},
                        {"role": "user", "content": "thanks"}]
    out = thinking.apply_chat_template(answered)
    assert "need a tool" not in out and "done" not in out and "greet back" not in out
    assert out.count("<think></think>") == 3 and out.endswith("<|im_user|>user<|im_middle|>thanks<|im_end|>" + GEN)
    # a tool-calling turn after the last answer keeps its reasoning, the answer before it does not
    tail = answered + [{"role": "assistant", "content": None, "reasoning_content": "again",
                        "tool_calls": [call("functions.w:1", "w", "{}")]}]
    assert "<think>again</think><|tool_calls_section_begin|>" in thinking.apply_chat_template(tail)


def test_thinking_false(thinking: Tokenizer):
    on = thinking.apply_chat_template(AGENT)
    assert thinking.apply_chat_template(AGENT, thinking=True) == on
    off = thinking.apply_chat_template(AGENT, thinking=False)
    assert off.endswith(GEN + "<think></think>") and "need a tool" not in off
    assert thinking.encode(off)[-3:] == [IM_MIDDLE, THINK, END_THINK]
    assert on.endswith(GEN) and thinking.encode(on)[-1] == IM_MIDDLE  # the model opens <think> itself
    assert thinking.apply_chat_template(AGENT, add_generation_prompt=False, thinking=False).endswith(AGENT_CALL)


def test_reasoning_alias_and_no_mutation(thinking: Tokenizer):
    msgs = copy.deepcopy(AGENT)
    msgs[3] = {**msgs[3], "reasoning_content": msgs[3].pop("reasoning")}
    assert thinking.apply_chat_template(msgs) == thinking.apply_chat_template(AGENT)
    before = copy.deepcopy(AGENT)
    thinking.apply_chat_template(AGENT)
    assert AGENT == before and "reasoning_content" not in AGENT[3]


def test_thinking_property_and_think_ids(thinking: Tokenizer, kimi: Tokenizer):
    assert thinking.thinking and thinking.think_ids == (THINK, END_THINK)
    assert not kimi.thinking and kimi.think_ids == (THINK, END_THINK)  # the vocabulary has them either way
    assert not Tokenizer.from_dir(SHIPPED_DIR / "deepseek").thinking


# ---------------------------------------------------------------- template kwargs

@pytest.mark.parametrize("name", RESERVED_TEMPLATE_KWARGS)
def test_reserved_template_kwargs(kimi: Tokenizer, name: str):
    with pytest.raises(ValueError, match=f"may not set {name}"):
        check_template_kwargs({name: "x", "thinking": False})
    if name not in ("tools", "add_generation_prompt"):  # those two are real arguments of the method
        with pytest.raises(ValueError, match=f"may not set {name}"):
            kimi.apply_chat_template([{"role": "user", "content": "x"}], **{name: "x"})


def test_reserved_kwargs_all_named(kimi: Tokenizer):
    with pytest.raises(ValueError, match="may not set bos_token, messages"):
        kimi.apply_chat_template([{"role": "user", "content": "x"}], messages=[], bos_token="", thinking=True)
    with pytest.raises(ValueError, match="string keys"):
        check_template_kwargs({1: True})
    with pytest.raises(ValueError, match="string keys"):
        check_template_kwargs(["thinking"])
    kwargs = {"thinking": False}
    assert check_template_kwargs(kwargs) == kwargs and check_template_kwargs(kwargs) is not kwargs


def test_template_kwargs_reach_the_template(kimi: Tokenizer):
    custom = Tokenizer(TiktokenBackend.from_dir(SHIPPED_DIR / "kimi"), bos_token="[BOS]", eos_token="[EOS]",
                       chat_template="{{ bos_token }}{{ greeting | default('none') }}|{{ messages | length }}")
    assert custom.apply_chat_template([{"role": "user", "content": "x"}], greeting="hey") == "[BOS]hey|1"
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "[BOS]none|1"
