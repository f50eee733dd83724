"""The output processor: one choice's token ids from the engine → what the client sees.

The engine streams ids (:class:`~cluster.stream.StreamChunk`); text exists only here, on the
Ingress, as in vLLM's front-end ``OutputProcessor``. :class:`ChoiceOutput` owns, for one choice:
incremental decoding (special tokens left out unless ``skip_special_tokens`` is off; a UTF-8
character split over tokens held back), stop strings (:class:`StopStrings`), for a chat turn with
K2's markers the tool-call and reasoning parser (:class:`~deploy.tool_parser.ToolCallStream`), the
logprobs in OpenAI's two shapes (a completion's text offsets run on from piece to piece), and the
whole answer the pieces assemble into (:class:`ChoiceResult`) — so a non-streamed answer is always
the assembly of the stream.

A sequence ended by its stop token (``finish_reason`` "stop" from the engine) has that token's text
left out unless ``include_stop_str_in_output`` (vLLM's meaning); a stop string ends the choice here,
and the caller then stops its sequence in the engine.

Owns: the per-choice decode, parse and stop state. Never: talks to the engine, imports a protocol
module, builds HTTP responses or SSE (each API's renderer does, deploy/answer.py serves them), or
decides what the model may generate (the grammar is planned in deploy/chat_turn.py and applied on
the attention actors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from actors.messages import SampledToken
from cluster.stream import StreamChunk
from model.tokenizer import IncrementalDecoder, Tokenizer

from .chat_turn import ChatPlan
from .tool_parser import ToolCallStream

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM's floor


class StopStrings:
    """Per-choice stop-string matcher over streamed text. Owns the text held back because it may
    be the start of a stop string; never emits anything after a stop string, nor the stop string
    itself (OpenAI excludes it) unless ``include`` (vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stops: list[str], include: bool = False):
        if any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.stops, self.include = list(stops), include
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text

    def push(self, delta: str) -> tuple[str, bool]:
        """New text → (text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self.held + delta
        hits = [(i, i + len(s), s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.stopped, self.held = True, ""
            start, end, self.matched = min(hits)
            return text[:end if self.include else start], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """End of the stream without a stop: the held-back text is output after all."""
        held, self.held = ("" if self.stopped else self.held), ""
        return held


# ---- logprobs, in OpenAI's two shapes ------------------------------------------------------------
def _lp(value: float | None) -> float:
    return MIN_LOGPROB if value is None or math.isnan(value) else max(float(value), MIN_LOGPROB)


def text_lengths(sampled: list[SampledToken], tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> list[int]:
    """How far each token moves a choice's text offset: its text's length, 0 for a special token
    left out of the text."""
    skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
    return [0 if s.token_id in skip else len(tokenizer.decode([s.token_id])) for s in sampled]


def completion_logprobs(sampled: list[SampledToken], tokenizer: Tokenizer, *, text_offset: int = 0,
                        skip_special_tokens: bool = True) -> dict:
    """Legacy completions format. ``text_offset``: where the first of these tokens starts in the
    choice's text (a stream's chunk continues from the tokens before it, so the streamed offsets
    are the non-streamed ones); the offsets then advance by :func:`text_lengths`."""
    tokens = [tokenizer.decode([s.token_id]) for s in sampled]
    offsets = []
    for length in text_lengths(sampled, tokenizer, skip_special_tokens=skip_special_tokens):
        offsets.append(text_offset)
        text_offset += length
    return {"tokens": tokens, "token_logprobs": [_lp(s.logprob) for s in sampled],
            "top_logprobs": [{tokenizer.decode([i]): _lp(lp) for i, lp in s.top_logprobs} for s in sampled],
            "text_offset": offsets}


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> dict:
    return {"token": tokenizer.decode([token_id]), "logprob": _lp(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}


def chat_logprobs(sampled: list[SampledToken], tokenizer: Tokenizer) -> dict:
    return {"content": [{**_chat_token(tokenizer, s.token_id, s.logprob),
                         "top_logprobs": [_chat_token(tokenizer, i, lp) for i, lp in s.top_logprobs]}
                        for s in sampled]}


# ---- one choice's output ---------------------------------------------------------------------------
@dataclass
class ChoiceResult:
    """One finished choice, as :meth:`ChoiceOutput.result` assembles it. ``logprobs`` is None when not
    requested, else already in the choice's shape (:func:`chat_logprobs` or :func:`completion_logprobs`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: dict | None = None
    message: dict | None = None  # chat: the assembled assistant message (content, reasoning, tool calls)


@dataclass(frozen=True)
class OutputOptions:
    """What only the front end needs of a choice's output; it never leaves the Ingress."""

    stop: tuple[str, ...] = ()  # stop strings
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False  # render the sampled tokens' logprobs


@dataclass(frozen=True)
class Piece:
    """One streamed piece of a choice: a completion's new ``text`` or a chat turn's new ``deltas``
    (content, reasoning, tool-call header or argument fragments), the logprobs of the tokens it
    came from, and the finish reason on the last piece."""

    text: str = ""
    deltas: tuple[dict, ...] = ()
    logprobs: dict | None = None
    finish_reason: str | None = None

    @property
    def empty(self) -> bool:
        return not self.text and not self.deltas and self.logprobs is None and self.finish_reason is None


@dataclass
class _Assembled:
    """A chat turn's deltas so far, assembled (OpenAI's message)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)

    def take(self, d: dict) -> dict:
        if "content" in d:
            self.content.append(d["content"])
        if "reasoning_content" in d:
            self.reasoning.append(d["reasoning_content"])
        for call in d.get("tool_calls", ()):
            if "id" in call:
                self.calls.append({"id": call["id"], "type": "function",
                                   "function": {"name": call["function"]["name"], "arguments": ""}})
            self.calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")
        return d

    def message(self) -> dict:
        """OpenAI's assistant message; reasoning under both ``reasoning_content`` and its newer alias
        ``reasoning``."""
        content = "".join(self.content)
        msg = {"role": "assistant", "content": None if (not content and self.calls) else content}
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


class ChoiceOutput:
    """One choice's output as it streams: :meth:`push` each engine chunk for the piece to send (and
    whether a stop string ended the choice); :meth:`result` is the whole answer, the pieces
    assembled. ``chat``: pieces are deltas (``plan`` says whether K2's markers are parsed), else text."""

    def __init__(self, tok: Tokenizer, index: int, options: OutputOptions, *, chat: bool,
                 plan: ChatPlan | None = None):
        self.tok, self.index, self.options, self.chat = tok, index, options, chat
        self.decoder = IncrementalDecoder(tok, skip_special_tokens=options.skip_special_tokens)
        self.stops = StopStrings(list(options.stop), options.include_stop_str_in_output)
        self.parser = None
        if chat and plan is not None and plan.markers is not None:
            def decode(ids):
                return tok.decode(ids, skip_special_tokens=options.skip_special_tokens)

            self.parser = ToolCallStream(decode, plan.markers, tools_enabled=plan.tools_enabled, think=plan.think)
        self.token_ids: list[int] = []
        self.sampled: list = []
        self.text = ""  # a completion's text so far
        self.assembled = _Assembled()  # a chat turn's deltas so far
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # of its prompt, found in the prefix cache
        self._text_offset = 0  # where the next streamed token starts in the text (logprobs' text_offset)

    # ---- the stream ----------------------------------------------------------------------------
    def push(self, chunk: StreamChunk) -> tuple[Piece, bool]:
        """The engine's next chunk → (the piece to send, whether a stop string ended the choice; the
        caller then stops its sequence). The piece of the last chunk carries the finish reason."""
        self.token_ids.extend(chunk.token_ids)
        self.sampled.extend(chunk.sampled)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        done = chunk.finish_reason is not None
        by_token = chunk.finish_reason == "stop" and bool(chunk.token_ids)  # the last id is a stop token
        body = chunk.token_ids[:-1] if by_token else chunk.token_ids
        if self.parser is not None:
            deltas, stopped = self._through_stops(self.parser.feed(body))
            text = ""
        else:
            text = "".join(self.decoder.push(t) for t in body) + (self.decoder.flush() if done else "")
            if by_token and self.options.include_stop_str_in_output:
                text += self.decoder.push(chunk.token_ids[-1]) + self.decoder.flush()
            if self.chat:
                deltas, stopped = self._through_stops([{"content": text}])
                text = ""
            else:
                text, stopped = self.stops.push(text)
                deltas = []
        reason = "stop" if stopped else chunk.finish_reason
        if reason is not None:
            more_text, more_deltas = self._finish(reason)
            text, deltas = text + more_text, deltas + more_deltas
        self.text += text
        return Piece(text, tuple(deltas), self._logprobs(list(chunk.sampled)), self.finish_reason), stopped

    def _finish(self, engine_reason: str) -> tuple[str, list[dict]]:
        """The end: held-back text; OpenAI's finish_reason ("tool_calls" when a chat turn called)."""
        reason = "stop" if engine_reason == "stop" else "length"
        if not self.chat:
            self.finish_reason = reason
            return self.stops.flush(), []
        deltas: list[dict] = []
        if self.parser is not None:
            deltas, _ = self._through_stops(self.parser.finish())
        held = self.stops.flush()
        if held:
            deltas.append(self.assembled.take({"content": held}))
        if self.assembled.calls and reason != "length":
            reason = "tool_calls"
        self.finish_reason = reason
        return "", [d for d in deltas if d]

    def _through_stops(self, deltas: list[dict]) -> tuple[list[dict], bool]:
        """A chat turn's content goes through the choice's stop strings; reasoning gets its newer alias."""
        out = []
        for d in deltas:
            if "content" in d:
                text, stopped = self.stops.push(d["content"])
                if text:
                    out.append(self.assembled.take({"content": text}))
                if stopped:
                    return out, True
            elif "reasoning_content" in d:
                out.append(self.assembled.take({**d, "reasoning": d["reasoning_content"]}))
            else:
                out.append(self.assembled.take(d))
        return out, False

    def _logprobs(self, sampled: list) -> dict | None:
        """The streamed logprobs of these tokens; a completion's text offsets run on from the tokens
        before them (as the non-streamed answer counts them)."""
        if not self.options.logprobs or not sampled:
            return None
        lp = self._shaped(sampled, self._text_offset)
        if not self.chat:
            skip = self.options.skip_special_tokens
            self._text_offset += sum(text_lengths(sampled, self.tok, skip_special_tokens=skip))
        return lp

    def _shaped(self, sampled: list, text_offset: int = 0) -> dict:
        if self.chat:
            return chat_logprobs(sampled, self.tok)
        return completion_logprobs(sampled, self.tok, text_offset=text_offset,
                                   skip_special_tokens=self.options.skip_special_tokens)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self.stops.matched

    # ---- the whole answer ------------------------------------------------------------------------
    def result(self) -> ChoiceResult:
        return ChoiceResult(self.index, self.text, self.token_ids, self.finish_reason,
                            self._shaped(self.sampled) if self.options.logprobs else None,
                            self.assembled.message() if self.chat else None)
