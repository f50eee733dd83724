"""Kimi K2 tool calls and reasoning, parsed from the generated token ids.

K2's assistant turn, as the model writes it (MODEL_SPEC §1.11)::

    [<think>] reasoning </think> content
    <|tool_calls_section_begin|>
      <|tool_call_begin|> functions.NAME:IDX <|tool_call_argument_begin|> {json} <|tool_call_end|>
      ...
    <|tool_calls_section_end|>

Every marker is one special token, so the grammar is read on ids (:class:`_Grammar`) and only the
text between markers is decoded. :func:`parse` takes a finished output; :class:`ToolCallStream` is
fed ids as they arrive and yields OpenAI ``chat.completion.chunk`` deltas. Both share the grammar,
and the deltas a stream yields assemble exactly into :func:`parse`'s result.

Owns: the grammar and the per-request parse state. Never: HTTP, the engine, the tokenizer's files,
or deciding stop conditions (the caller passes what the engine generated).

Policies (the same streamed and not):

- Markers never appear in any text. Text goes to ``reasoning`` while reasoning is open, to
  ``content`` outside the section, to a call's id or arguments inside one; text inside the section
  but outside a call (between calls) is dropped.
- Reasoning is open from the start when ``think=True`` (K2-Thinking's generation prompt ends with
  ``<think>``), or from a ``<think>`` token that comes before any tool section; ``</think>`` or the
  start of the tool section closes it. Think markers elsewhere are dropped. Reasoning needs the
  think tokens to be special tokens of the tokenizer (K2-Thinking, K2.5: 163606/163607).
- A call is reported once its id is complete (``<|tool_call_argument_begin|>``, or the call closed
  without one: arguments ""). The name is the id without ``functions.`` and ``:IDX``; the id is
  kept as the model wrote it (stripped), because the next turn's template renders it back and K2
  was trained on ``functions.NAME:IDX`` ids. Stray or out-of-place markers are dropped; a new call
  or section marker, or the section's end, closes an open call.
- Cut off (the output ends inside the section, e.g. at max_tokens): calls whose arguments began
  are reported with the arguments received so far; a call whose id never completed is not reported
  (its name may be truncated). ``finish.cut_off`` is set; :meth:`ParseResult.finish_reason` keeps
  the engine's "length".
- Arguments that are not a JSON object (malformed, or cut off) are passed through as text:
  OpenAI's clients parse ``arguments`` themselves and OpenAI documents that a model may produce
  invalid JSON; streamed fragments cannot be taken back anyway. ``finish.invalid_arguments``
  lists those calls so the caller can log or refuse them.
- ``tools_enabled=False`` (no tools, or ``tool_choice: "none"``): the section is not parsed; the
  tool markers are dropped and the text between them stays in ``content``. That is what the same
  output gives without tool parsing (decoding skips special tokens), so nothing the model wrote is
  hidden, and no marker leaks. Reasoning is still parsed.
- ``content`` is None when it is empty and there are calls; ``reasoning`` is None when empty.
- Streamed text holds back a token whose decoded text ends in U+FFFD (a UTF-8 character split over
  tokens) until the next token completes it, or until a marker or the end flushes it; so the
  pieces concatenate to what ``decode`` gives each run between markers, which is what
  :func:`parse` decodes (exact for byte-level tokenizers such as K2's). This is
  :class:`model.tokenizer.IncrementalDecoder`'s idea on the ``decode`` callable, which stubs and
  any tokenizer provide, rather than on a :class:`~model.tokenizer.Tokenizer`'s token bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Protocol

# ids → text, skipping special tokens (e.g. ``lambda ids: tok.decode(ids, skip_special_tokens=True)``)
Decode = Callable[[Sequence[int]], str]

TOOL_MARKER_TOKENS = {
    "section_begin": "<|tool_calls_section_begin|>",
    "section_end": "<|tool_calls_section_end|>",
    "call_begin": "<|tool_call_begin|>",
    "argument_begin": "<|tool_call_argument_begin|>",
    "call_end": "<|tool_call_end|>",
}
THINK_TOKENS = {"think_begin": "<think>", "think_end": "</think>"}


class _TokenizerLike(Protocol):
    special_token_ids: frozenset[int]

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class K2Markers:
    """The ids of K2's tool-call markers and (optionally) of the think markers."""

    section_begin: int
    section_end: int
    call_begin: int
    argument_begin: int
    call_end: int
    think_begin: int | None = None
    think_end: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"K2Markers.{f.name} must be a token id (int >= 0), got {value!r}")
        if (self.think_begin is None) != (self.think_end is None):
            raise ValueError(f"K2Markers: think_begin={self.think_begin} and think_end={self.think_end} "
                             "must both be set or both be None")
        ids = [i for i in self._ids() if i is not None]
        if len(set(ids)) != len(ids):
            raise ValueError(f"K2Markers: marker ids must be distinct, got {ids}")

    def _ids(self) -> tuple[int | None, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def has_think(self) -> bool:
        return self.think_begin is not None

    @classmethod
    def from_tokenizer(cls, tokenizer: _TokenizerLike) -> K2Markers:
        """Look the markers up by their text among the tokenizer's special tokens. The tool
        markers are required (a ValueError names the first one missing); the think markers are
        optional (K2-Instruct has none)."""
        def special_id(token: str) -> int | None:
            i = tokenizer.token_to_id(token)
            return i if i is not None and i in tokenizer.special_token_ids else None

        ids: dict[str, int | None] = {}
        for field_name, token in TOOL_MARKER_TOKENS.items():
            ids[field_name] = special_id(token)
            if ids[field_name] is None:
                raise ValueError(f"the tokenizer has no special token {token!r}: it cannot carry K2 tool calls")
        think = {name: special_id(token) for name, token in THINK_TOKENS.items()}
        if None in think.values():
            think = {name: None for name in think}
        return cls(**ids, **think)


# K2's real ids (MODEL_SPEC §1.11); K2-Thinking and K2.5 add <think> 163606 and </think> 163607.
K2_MARKERS = K2Markers(section_begin=163595, section_end=163596, call_begin=163597, argument_begin=163598,
                       call_end=163599)
K2_THINKING_MARKERS = K2Markers(section_begin=163595, section_end=163596, call_begin=163597,
                                argument_begin=163598, call_end=163599, think_begin=163606, think_end=163607)


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # the JSON text as generated, never re-serialised


@dataclass(frozen=True)
class ParseFinish:
    """How the tool part ended. ``cut_off``: the output ended inside the tool-call section (a
    call or the section not closed). ``invalid_arguments``: indices into ``tool_calls`` whose
    arguments are not a JSON object."""

    cut_off: bool = False
    invalid_arguments: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParseResult:
    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish: ParseFinish

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's finish_reason: the engine's "length" stays (a cut-off call is still reported);
        otherwise "tool_calls" when there are calls, else the engine's reason."""
        if engine_reason == "length" or not self.tool_calls:
            return engine_reason
        return "tool_calls"


def split_call_id(text: str) -> tuple[str, str]:
    """``" functions.get_weather:0 "`` → ``("functions.get_weather:0", "get_weather")``; an id of
    another form keeps what it has (``"get_weather"`` → name ``"get_weather"``)."""
    call_id = text.strip()
    name = call_id.removeprefix("functions.")
    head, sep, idx = name.rpartition(":")
    if sep and idx.isdigit():
        name = head
    return call_id, name


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _build_result(reasoning: str, content: str, calls: list[ToolCall], cut_off: bool) -> ParseResult:
    invalid = tuple(k for k, call in enumerate(calls) if not _is_json_object(call.arguments))
    return ParseResult(reasoning=reasoning or None, content=None if not content and calls else content,
                       tool_calls=tuple(calls), finish=ParseFinish(cut_off=cut_off, invalid_arguments=invalid))


class _Sink(Protocol):
    """What :class:`_Grammar` tells its consumer. ``channel`` is "content", "reasoning",
    "call_id" or "arguments"."""

    def text(self, channel: str, token_id: int) -> None: ...
    def boundary(self) -> None: ...  # a marker: the current run of text ends
    def call_open(self) -> None: ...
    def header_done(self) -> None: ...  # the open call's id is complete
    def call_close(self) -> None: ...
    def call_drop(self) -> None: ...  # the output ended before the open call's id was complete


_CONTENT, _REASONING, _SECTION, _CALL_ID, _ARGS = "content", "reasoning", "section", "call_id", "arguments"


class _Grammar:
    """K2's output grammar on ids, no decoding: routes each text id to a channel and turns markers
    into call events (the policies are in the module docstring)."""

    def __init__(self, markers: K2Markers, sink: _Sink, *, tools_enabled: bool, think: bool):
        if think and not markers.has_think:
            raise ValueError("think=True needs the tokenizer's <think> and </think> special tokens; "
                             "these markers have none")
        self._m, self._sink, self._tools = markers, sink, tools_enabled
        self._markers = frozenset(i for i in markers._ids() if i is not None)
        self._state = _REASONING if think else _CONTENT
        self._reasoning_seen = think
        self._section_seen = False

    def push(self, token_id: int) -> None:
        if token_id not in self._markers:
            if self._state != _SECTION:
                self._sink.text(self._state, token_id)
            return
        self._sink.boundary()
        m, state = self._m, self._state
        if token_id == m.think_begin:
            if state == _CONTENT and not self._reasoning_seen and not self._section_seen:
                self._state, self._reasoning_seen = _REASONING, True
        elif token_id == m.think_end:
            if state == _REASONING:
                self._state = _CONTENT
        elif not self._tools:
            return  # tool markers dropped, their text stays content
        elif token_id == m.section_begin:
            self._close_call()
            self._state, self._section_seen = _SECTION, True
        elif token_id == m.call_begin:
            self._close_call()
            self._section_seen = True
            self._sink.call_open()
            self._state = _CALL_ID
        elif token_id == m.argument_begin:
            if state == _CALL_ID:
                self._sink.header_done()
                self._state = _ARGS
        elif token_id == m.call_end:
            self._close_call()
        elif token_id == m.section_end:
            if state in (_SECTION, _CALL_ID, _ARGS):
                self._close_call()
                self._state = _CONTENT

    def _close_call(self) -> bool:
        if self._state == _CALL_ID:
            self._sink.header_done()
        elif self._state != _ARGS:
            return False
        self._sink.call_close()
        self._state = _SECTION
        return True

    def end(self) -> bool:
        """The output is complete; returns whether it ended inside the tool-call section."""
        self._sink.boundary()
        if self._state == _CALL_ID:
            self._sink.call_drop()
        return self._state in (_SECTION, _CALL_ID, _ARGS)


class _Collector:
    """:func:`parse`'s sink: collects each run of ids and decodes it whole."""

    def __init__(self, decode: Decode):
        self._decode = decode
        self._run: list[int] = []
        self._run_channel = ""
        self.texts = {_CONTENT: "", _REASONING: ""}
        self.calls: list[ToolCall] = []
        self._id_text, self._args = "", ""
        self._call_open = False

    def text(self, channel: str, token_id: int) -> None:
        self._run_channel = channel
        self._run.append(token_id)

    def boundary(self) -> None:
        if not self._run:
            return
        piece, self._run = self._decode(self._run), []
        if self._run_channel == _CALL_ID:
            self._id_text += piece
        elif self._run_channel == _ARGS:
            self._args += piece
        else:
            self.texts[self._run_channel] += piece

    def call_open(self) -> None:
        self._id_text, self._args, self._call_open = "", "", True

    def header_done(self) -> None:
        pass

    def call_close(self) -> None:
        self.calls.append(ToolCall(*split_call_id(self._id_text), self._args))
        self._call_open = False

    def call_drop(self) -> None:
        self._call_open = False

    def finish(self) -> None:
        if self._call_open:  # cut off inside the arguments: reported with what arrived
            self.call_close()


def parse(token_ids: Iterable[int], decode: Decode, markers: K2Markers, *, tools_enabled: bool = True,
          think: bool = False) -> ParseResult:
    """Parse a finished assistant output (the generated ids, stop token included or not).
    ``think``: the prompt ended with an open ``<think>`` (K2-Thinking's generation prompt)."""
    sink = _Collector(decode)
    grammar = _Grammar(markers, sink, tools_enabled=tools_enabled, think=think)
    for token_id in token_ids:
        grammar.push(token_id)
    cut_off = grammar.end()
    sink.finish()
    return _build_result(sink.texts[_REASONING], sink.texts[_CONTENT], sink.calls, cut_off)


class _Emitter:
    """:class:`ToolCallStream`'s sink: decodes each run incrementally and queues deltas."""

    def __init__(self, decode: Decode):
        self._decode = decode
        self._pending: list[int] = []  # ids whose text is held back (a split UTF-8 character)
        self._pending_channel = ""
        self._id_text = ""
        self.texts = {_CONTENT: "", _REASONING: ""}
        self.calls: list[ToolCall] = []  # reported calls; the last one's arguments may still grow
        self.queue: list[tuple[str, int, str]] = []  # (kind, call index, text), kind: a channel or "header"

    def text(self, channel: str, token_id: int) -> None:
        assert not self._pending or self._pending_channel == channel, "a channel changed without a marker"
        self._pending_channel = channel
        self._pending.append(token_id)
        if channel == _CALL_ID:
            return  # the id is reported whole, at header_done
        piece = self._decode(self._pending)
        if not piece.endswith("\ufffd"):
            self._pending.clear()
            self._emit(channel, piece)

    def boundary(self) -> None:
        if not self._pending:
            return
        piece, self._pending = self._decode(self._pending), []
        if self._pending_channel == _CALL_ID:
            self._id_text += piece
        else:
            self._emit(self._pending_channel, piece)

    def _emit(self, channel: str, piece: str) -> None:
        if not piece:
            return
        if channel == _ARGS:
            call = self.calls[-1]
            self.calls[-1] = call._replace(arguments=call.arguments + piece)
            self.queue.append((_ARGS, len(self.calls) - 1, piece))
        else:
            self.texts[channel] += piece
            self.queue.append((channel, -1, piece))

    def call_open(self) -> None:
        self._id_text = ""

    def header_done(self) -> None:
        self.calls.append(ToolCall(*split_call_id(self._id_text), ""))
        self.queue.append(("header", len(self.calls) - 1, ""))

    def call_close(self) -> None:
        pass

    def call_drop(self) -> None:
        self._id_text = ""


def _deltas(queue: list[tuple[str, int, str]], calls: list[ToolCall]) -> list[dict]:
    """OpenAI delta dicts from queued pieces; neighbours of one kind (and call) are merged."""
    merged: list[tuple[str, int, str]] = []
    for kind, index, piece in queue:
        if merged and kind != "header" and merged[-1][:2] == (kind, index):
            merged[-1] = (kind, index, merged[-1][2] + piece)
        else:
            merged.append((kind, index, piece))
    out: list[dict] = []
    for kind, index, piece in merged:
        if kind == _CONTENT:
            out.append({"content": piece})
        elif kind == _REASONING:
            out.append({"reasoning_content": piece})
        elif kind == "header":
            out.append({"tool_calls": [{"index": index, "id": calls[index].id, "type": "function",
                                        "function": {"name": calls[index].name, "arguments": ""}}]})
        else:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return out


class ToolCallStream:
    """One request's streaming parser. :meth:`feed` the generated ids as they come (one or many
    at a time) and send the deltas it returns; :meth:`finish` at the end flushes held-back text;
    :attr:`result` is then what :func:`parse` gives the same ids. Deltas are the ``delta`` objects
    of ``chat.completion.chunk``: ``{"content": s}``, ``{"reasoning_content": s}``, and per call
    one ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}``
    followed by ``{"tool_calls": [{"index", "function": {"arguments": fragment}}]}``."""

    def __init__(self, decode: Decode, markers: K2Markers, *, tools_enabled: bool = True, think: bool = False):
        self._sink = _Emitter(decode)
        self._grammar = _Grammar(markers, self._sink, tools_enabled=tools_enabled, think=think)
        self._result: ParseResult | None = None

    def feed(self, token_ids: Iterable[int]) -> list[dict]:
        if self._result is not None:
            raise ValueError("ToolCallStream.feed after finish")
        for token_id in token_ids:
            self._grammar.push(token_id)
        return self._take()

    def finish(self) -> list[dict]:
        if self._result is not None:
            raise ValueError("ToolCallStream.finish called twice")
        cut_off = self._grammar.end()
        sink = self._sink
        self._result = _build_result(sink.texts[_REASONING], sink.texts[_CONTENT], sink.calls, cut_off)
        return self._take()

    @property
    def result(self) -> ParseResult:
        if self._result is None:
            raise ValueError("ToolCallStream.result is known only after finish()")
        return self._result

    def _take(self) -> list[dict]:
        out = _deltas(self._sink.queue, self._sink.calls)
        self._sink.queue = []
        return out
