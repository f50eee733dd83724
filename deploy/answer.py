"""One answer, streamed or whole: the one response path behind every front door.

A request's choices come from the engine through the Ingress's :class:`~deploy.fanout.Fanout`, one
:class:`Choice` each, through their output processors (:class:`~deploy.output.ChoiceOutput`) into
the API's :class:`Renderer`, which makes the events: sent as SSE, or drained for the whole answer,
which is the same events assembled. The same rules hold for every API: a non-streamed request whose
client is found gone is answered 499; an engine that fails mid-answer ends a stream with the API's
error event, and a non-streamed request with a 503; whatever ends the answer frees every sequence.

Owns: the order of a renderer's calls and the answer's end. Never: parses requests, talks to the
engine (but for what the Fanout carries) or shapes an API's JSON (the renderers do).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .fanout import Fanout
from .openai_api import APIError
from .output import ChoiceOutput, Piece

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request asks whether its client is still there


class Renderer(Protocol):
    """One request's answer in one API's shape, built from the output processor's pieces:
    :class:`~deploy.openai_api.CompletionStream` and :class:`~deploy.openai_api.ChatStream` (``n``
    choices), :class:`~deploy.anthropic_api.MessageStream` and
    :class:`~deploy.responses_api.ResponseStream` (choice 0). Each method returns the stream events
    it makes; :meth:`sse` writes one."""

    def start(self, cached_tokens: int) -> list:
        """The opening events; ``cached_tokens``: the prompt tokens read from the prefix cache."""

    def feed(self, out: ChoiceOutput, piece: Piece) -> list:
        """The events of one choice's next piece (``out``: that choice's output processor)."""

    def finish(self, outs: list[ChoiceOutput]) -> list:
        """The closing events, once every choice ended."""

    def whole(self) -> dict:
        """The non-streamed answer, after :meth:`finish`."""

    def failed(self, message: str) -> list:
        """The events that end a stream whose engine failed (a 503's message)."""

    def sse(self, event) -> str: ...


class Choice:
    """One choice's stream from the engine (``gen``, whose ``first`` chunk is in) through its output
    processor."""

    def __init__(self, out: ChoiceOutput, gen, first):
        self.out, self.gen, self.first = out, gen, first

    async def pieces(self):
        """The choice's pieces until it ends (a stop string stops its sequence in the engine)."""
        chunk = self.first
        while True:
            piece, stopped = self.out.push(chunk)
            if stopped:
                self.gen.cancel()
            yield piece
            if piece.finish_reason is not None:
                return
            chunk = await self.gen.__anext__()

    async def pump(self, queue: asyncio.Queue) -> None:
        try:
            async for piece in self.pieces():
                await queue.put((self, piece))
        except Exception as e:  # noqa: BLE001 — the engine failed mid-stream: the reader raises it
            await queue.put(e)
        finally:
            await queue.put(None)


async def answer(request: Request, fan: Fanout, choices: list[Choice], renderer: Renderer, *, stream: bool,
                 cached_tokens: int, before_end: Callable[[], Awaitable[None]] | None = None):
    """``choices`` into ``renderer``: a streamed response of its events, or (drained while the client
    is there) its whole answer. ``before_end`` (the Responses store) is awaited before the closing
    events, so that a client's next request finds what it stored."""

    async def events():
        try:
            yield renderer.start(cached_tokens)
            async with contextlib.aclosing(_pieces(choices)) as pieces:
                async for choice, piece in pieces:
                    yield renderer.feed(choice.out, piece)
            closing = renderer.finish([c.out for c in choices])
            if before_end is not None:
                await before_end()
            yield closing
        finally:  # done, failed, or the client went away (Serve cancels the handler): free every sequence
            fan.close()

    if stream:
        return StreamingResponse(_sse(events(), renderer), media_type="text/event-stream")
    try:
        if not await _wait_while_connected(request, asyncio.ensure_future(_consume(events()))):
            return Response(status_code=499)  # nobody reads it: the client went away
    except Exception as e:  # noqa: BLE001 — the engine failed mid-request
        raise APIError(503, failure_message(e), retry_after_s=1) from None
    finally:
        fan.close()
    return renderer.whole()


def failure_message(err: BaseException) -> str:
    """What the 503 of an engine that failed says (a stream's error event, or the error answer)."""
    cause = getattr(err, "cause", None)  # a Ray task error: the engine server's own error
    if isinstance(cause, BaseException):
        err = cause
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"the request failed while generating ({type(err).__name__}: {first}); retry it"


async def _pieces(choices: list[Choice]):
    """Every choice's ``(choice, piece)`` as they come; raises what ended them. One choice is read
    directly; several are pumped into one queue."""
    if len(choices) == 1:
        async for piece in choices[0].pieces():
            yield choices[0], piece
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(c.pump(queue)) for c in choices]
    try:
        for _ in choices:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def _sse(events, renderer: Renderer):
    """The events as server-sent events; an engine that fails mid-stream ends them with the renderer's
    error event, not a hang."""
    try:
        async with contextlib.aclosing(events) as batches:
            async for batch in batches:
                for event in batch:
                    yield renderer.sse(event)
    except Exception as e:  # noqa: BLE001 — the engine failed mid-stream
        for event in renderer.failed(failure_message(e)):
            yield renderer.sse(event)


async def _consume(gen) -> None:
    async for _ in gen:
        pass


async def _wait_while_connected(request: Request, task: asyncio.Future) -> bool:
    """Wait for ``task``; False as soon as the client is found gone (the task is then cancelled).
    Serve cancels a handler whose client went away; the poll covers servers that do not."""
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return False
        task.result()
        return True
    finally:
        if not task.done():
            task.cancel()
