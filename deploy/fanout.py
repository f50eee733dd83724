"""One request's choices over one engine stream (the Ingress side of ``EngineServer.generate_many``).

All sequences of a request (``n`` choices, a list of prompts) are submitted in one call, so the engine
admits them at one step boundary and no choice's first token waits for another's. :class:`Fanout`
owns that call's stream: it reads ``(index, seq_id, chunk)`` items and hands each chunk to its
choice's :class:`ChoiceStream`, which the Ingress reads like one stream per choice.
Never: touches the engine (it only reads the stream and cancels it), or ends a choice's stream without
a finish or an error (a stream that ends early is an error to every choice still open).
"""

from __future__ import annotations

import asyncio
from typing import Callable


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
        self.fanout.release(self.index)


class Fanout:
    """``gen``: the engine stream. ``reject``: called with a first item that is not a chunk (it raises).

    A choice that stops early (a stop string) is only released: its sequence runs on in the engine until
    every choice of the request is released, then the stream is cancelled, which aborts what still
    runs (the engine has no per-sequence cancel over one stream)."""

    def __init__(self, gen, n: int, reject: Callable[[object], None]):
        self.gen, self.n, self.reject = gen, n, reject
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self.open_choices = set(range(n))
        self.task: asyncio.Task | None = None

    async def open(self) -> list:
        """The first chunk of every choice (a rejection raises). Then chunks flow to the choices' queues."""
        item = await self.gen.__anext__()
        if not isinstance(item, tuple):
            self.reject(item)
        first: dict[int, object] = {}
        while True:
            index, _, chunk = item
            if index in first:
                self.queues[index].put_nowait(chunk)
            else:
                first[index] = chunk
            if len(first) == self.n:
                break
            item = await self.gen.__anext__()
        self.task = asyncio.create_task(self._pump())
        for i, chunk in first.items():
            if chunk.finish_reason is not None:  # done at its first token (max_tokens=1)
                self.release(i)
        return [first[i] for i in range(self.n)]

    def stream(self, index: int) -> ChoiceStream:
        return ChoiceStream(self, index)

    async def _pump(self) -> None:
        try:
            async for index, _, chunk in self.gen:
                self.queues[index].put_nowait(chunk)
            err: Exception = RuntimeError("the engine stream ended before every choice finished")
        except Exception as e:  # noqa: BLE001 — the engine failed mid-stream: every open choice gets it
            err = e
        for i in self.open_choices:
            self.queues[i].put_nowait(err)

    def release(self, index: int) -> None:
        self.open_choices.discard(index)
        if not self.open_choices:
            self.close()

    def close(self) -> None:
        """Stop reading and cancel the engine stream (which aborts whatever still runs)."""
        self.open_choices.clear()
        if self.task is not None:
            self.task.cancel()
        self.gen.cancel()
