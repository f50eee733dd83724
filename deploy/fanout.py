"""One request's choices, fed from the Ingress replica's engine stream (:mod:`deploy.mux`).

All sequences of a request (``n`` choices, a list of prompts) are submitted in one call, so the engine
admits them at one step boundary and no choice's first token waits for another's. :class:`Fanout`
is that request's end of the multiplexed stream: :meth:`Fanout.feed` hands each chunk to its
choice's queue, which the Ingress reads like one stream per choice (:class:`ChoiceStream`).
Never: touches the engine (``cancel`` and ``stop`` are how it says it wants no more of the request, or
of one choice), or ends a choice's stream without a finish or an error (a request that ends early is
an error to every choice still open).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from cluster.stream import StreamChunk

class ChoiceStream:
    """One choice's chunks, in order; ``cancel`` says the Ingress wants no more of them."""

    def __init__(self, fanout: "Fanout", index: int):
        self.fanout, self.index = fanout, index

    async def __anext__(self):
        item = await self.fanout.queues[self.index].get()
        if isinstance(item, BaseException):
            raise item
        if item.finish_reason is not None:
            self.fanout.release(self.index)
        return item

    def cancel(self) -> None:
        """No more of this choice (it met a stop string): its sequence stops in the engine."""
        self.fanout.stop(self.index)


class Fanout:
    """``n`` choices; ``cancel()`` is called once, when every choice is released (or at :meth:`close`).

    A choice that stops early (a stop string) while others still run is stopped alone: ``stop(index)``
    aborts its sequence in the engine, so it decodes no further. When the last open choice is released
    the request is cancelled, which aborts whatever still runs."""

    def __init__(self, n: int, cancel: Callable[[], None], stop: Callable[[int], None] | None = None):
        self.n, self._cancel, self._stop = n, cancel, stop
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self.open_choices = set(range(n))
        self.finished: set[int] = set()
        self.closed = False

    def feed(self, index: int, chunk: StreamChunk) -> None:
        """A chunk of choice ``index``."""
        if chunk.finish_reason is not None:
            self.finished.add(index)
        self.queues[index].put_nowait(chunk)

    def end(self) -> None:
        """The request is done: a choice still unfinished then is an error."""
        self.fail(RuntimeError("the engine stream ended before every choice finished"))

    def fail(self, error: BaseException) -> None:
        """The request failed (the engine, or its replica): ``error`` for every choice still unfinished."""
        for i in range(self.n):
            if i not in self.finished:
                self.queues[i].put_nowait(error)
        self.finished = set(range(self.n))

    async def open(self) -> list:
        """The first chunk of every choice (an engine failure raises). Later chunks wait in the queues."""
        first = []
        for i in range(self.n):
            item = await self.queues[i].get()
            if isinstance(item, BaseException):
                raise item
            first.append(item)
        for i, chunk in enumerate(first):
            if chunk.finish_reason is not None:  # done at its first token (max_tokens=1)
                self.release(i)
        return first

    def stream(self, index: int) -> ChoiceStream:
        return ChoiceStream(self, index)

    def stop(self, index: int) -> None:
        """Want no more of choice ``index``: its sequence is aborted alone while other choices are open
        (else the release cancels the whole request)."""
        if (self._stop is not None and index in self.open_choices and index not in self.finished
                and self.open_choices - {index}):
            self._stop(index)
        self.release(index)

    def release(self, index: int) -> None:
        self.open_choices.discard(index)
        if not self.open_choices:
            self.close()

    def close(self) -> None:
        """Want no more: cancel the request in the engine (aborting whatever still runs), once."""
        self.open_choices.clear()
        if not self.closed:
            self.closed = True
            self._cancel()
