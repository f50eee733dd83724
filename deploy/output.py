"""The output processor: one choice's token ids from the engine → what the client sees.

The engine streams ids (:class:`~cluster.aengine.StreamChunk`); text exists only here, on the
Ingress, as in vLLM's front-end ``OutputProcessor``. :class:`ChoiceOutput` owns, for one choice:
incremental decoding (special tokens left out unless ``skip_special_tokens`` is off; a UTF-8
character split over tokens held back), stop strings (:class:`~deploy.openai_api.StopStrings`),
for a chat turn with K2's markers the tool-call and reasoning parser
(:class:`~deploy.tool_parser.ToolCallStream`), the streamed logprobs' text offsets, and the whole
answer the pieces assemble into — so a non-streamed answer is always the assembly of the stream.

A sequence ended by its stop token (``finish_reason`` "stop" from the engine) has that token's text
left out unless ``include_stop_str_in_output`` (vLLM's meaning); a stop string ends the choice here,
and the caller then stops its sequence in the engine.

Owns: the per-choice decode, parse and stop state. Never: talks to the engine, builds HTTP
responses or SSE (deploy/ingress.py and deploy/openai_api.py do), or decides what the model may
generate (the grammar is planned in deploy/chat_turn.py and applied on the attention actors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.aengine import StreamChunk
from model.tokenizer import IncrementalDecoder, Tokenizer

from .chat_turn import ChatPlan
from .openai_api import ChoiceResult, StopStrings, chat_logprobs, completion_logprobs, text_lengths
from .tool_parser import ToolCallStream


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
        if self.chat:
            return chat_logprobs(sampled, self.tok)
        skip = self.options.skip_special_tokens
        lp = completion_logprobs(sampled, self.tok, text_offset=self._text_offset, skip_special_tokens=skip)
        self._text_offset += sum(text_lengths(sampled, self.tok, skip_special_tokens=skip))
        return lp

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self.stops.matched

    # ---- the whole answer ------------------------------------------------------------------------
    def result(self) -> ChoiceResult:
        return ChoiceResult(self.index, self.text, self.token_ids, self.finish_reason,
                            self.sampled if self.options.logprobs else None,
                            self.assembled.message() if self.chat else None)
