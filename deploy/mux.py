"""One multiplexed engine stream per Ingress replica.

A Ray item costs the same whether it carries one token or a hundred, so each Ingress replica holds
one subscription (:meth:`EngineStreams.subscribe`). Requests enter by a unary
``submit`` naming that subscription and are cancelled by a unary ``cancel``; one choice of a request
(a sequence) is stopped alone by a unary ``stop_choice``. Per step, the subscription carries one
item: every chunk for every request of that replica.

* :class:`EngineStreams` is the engine replica's side. It keeps one sink per subscription, and one task
  per request that forwards the request's :meth:`AsyncEngine.generate_many` chunks into its sink.
* :class:`StreamMux` is the Ingress replica's side. It owns the subscription, opened on first use and
  reopened after a failure. A pump task hands each chunk to its request's :class:`~deploy.fanout.Fanout`.

Every call to the engine replica is made outside the Serve request that caused it (:func:`_detached`):
Serve cancels a request's child calls when its client goes away, and the subscription, opened during
some request, must outlive it, as must the cancel a request sends on its way out.

Never: loses a request silently. When a subscription ends, with an error or because its engine
replica went away, every request that rode on it gets an error. When an Ingress replica goes away,
its subscription's requests are aborted in the engine. Every wait has a timeout, except the wait for
tokens, which the engine's own health bounds.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import uuid

from dataclasses import dataclass

from cluster.aengine import AsyncEngine
from cluster.stream import EngineRequest, StreamChunk

from .fanout import Fanout


@dataclass(frozen=True)
class End:
    """A request is done: every choice's last chunk came before."""


@dataclass(frozen=True)
class Failed:
    """A request failed in the engine (every choice still open ends with this error)."""

    message: str


@dataclass(frozen=True)
class MuxItem:
    """What the subscription carries (engine replica → Ingress replica), per request ``key``: a chunk
    of choice ``index``, or the request's :class:`End` or :class:`Failed` (``index`` None)."""

    key: int
    index: int | None
    item: StreamChunk | End | Failed


class _Sink:
    """One subscription's pending items and its requests' forwarding tasks."""

    def __init__(self):
        self.items: list = []
        self.ready = asyncio.Event()
        self.tasks: dict[int, asyncio.Task] = {}
        self.seq_ids: dict[int, dict[int, int]] = {}  # request key → choice index → the engine's seq_id
        self.starting: dict[int, int] = {}  # request key → its sequences, until its task queues them in the engine

    def put(self, item) -> None:
        self.items.append(item)
        self.ready.set()


class EngineStreams:
    """The engine replica's side: sinks by subscription id."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine
        self.sinks: dict[str, _Sink] = {}

    @property
    def num_requests(self) -> int:
        return sum(len(s.tasks) for s in self.sinks.values())

    @property
    def num_starting(self) -> int:
        """Sequences admitted by :meth:`submit` whose task has not yet run to queue them in the engine
        (not yet in :attr:`AsyncEngine.num_waiting`): a burst of submits comes before any of them."""
        return sum(sum(s.starting.values()) for s in self.sinks.values())

    async def subscribe(self, sink_id: str):
        """Yield ``[]`` at once (subscribed), then, whenever some are pending, lists of
        :class:`MuxItem`. Closing it (the Ingress went away) aborts its requests."""
        sink = self.sinks[sink_id] = _Sink()
        try:
            yield []
            while True:
                await sink.ready.wait()
                sink.ready.clear()
                batch, sink.items = sink.items, []
                yield batch
        finally:
            self.sinks.pop(sink_id, None)
            for task in list(sink.tasks.values()):
                task.cancel()

    def submit(self, sink_id: str, key: int, requests: list[EngineRequest]) -> None:
        """Start request ``key`` of subscription ``sink_id``. Raises ValueError for bad input and
        RuntimeError when the engine cannot take it (or does not know the subscription)."""
        sink = self.sinks.get(sink_id)
        if sink is None:
            raise RuntimeError("this engine replica holds no such stream (it was restarted); retry")
        self.aengine.check(requests)
        sink.starting[key] = len(requests)
        sink.tasks[key] = asyncio.get_running_loop().create_task(self._forward(sink, key, requests))

    def stop_choice(self, sink_id: str, key: int, index: int) -> None:
        """Abort one sequence of a request (its choice met a stop string); the others run on."""
        sink = self.sinks.get(sink_id)
        seq_id = None if sink is None else sink.seq_ids.get(key, {}).get(index)
        if seq_id is not None:
            self.aengine.abort(seq_id)

    def cancel(self, sink_id: str, keys: list[int]) -> None:
        """Abort these requests (the client went away, or every choice stopped early)."""
        sink = self.sinks.get(sink_id)
        for key in keys if sink is not None else ():
            sink.starting.pop(key, None)  # a task cancelled before it ran queues nothing
            task = sink.tasks.pop(key, None)
            if task is not None:
                task.cancel()

    async def _forward(self, sink: _Sink, key: int, requests: list[EngineRequest]) -> None:
        sink.starting.pop(key, None)  # the stream's first step queues them, before this task first waits
        stream = self.aengine.generate_many(requests)
        seq_ids = sink.seq_ids[key] = {}
        try:
            async for index, seq_id, chunk in stream:
                seq_ids[index] = seq_id
                sink.put(MuxItem(key, index, chunk))
            sink.put(MuxItem(key, None, End()))
        except Exception as e:  # noqa: BLE001 — the engine failed: the request's error, as plain text
            sink.put(MuxItem(key, None, Failed(f"{type(e).__name__}: {e}")))
        finally:
            sink.tasks.pop(key, None)
            sink.seq_ids.pop(key, None)
            await stream.aclose()  # a request cut short aborts its sequences still running


class StreamMux:
    """The Ingress replica's side. ``engine``: the engine deployment's handle."""

    def __init__(self, engine, timeout_s: float):
        self.engine, self.timeout_s = engine, timeout_s
        self.requests: dict[int, tuple[str, Fanout]] = {}  # key → (subscription, its request)
        self.sink: str | None = None
        self.pump: asyncio.Task | None = None
        self.gen = None  # the subscription's stream
        self._keys = itertools.count()
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()

    async def open(self, requests: list[EngineRequest]) -> tuple[Fanout, object]:
        """Submit one request's sequences; returns its :class:`Fanout` and the engine's answer (None:
        admitted, else its refusal). Raises TimeoutError when the engine replica does not answer."""
        sink = await self._connect()
        key = next(self._keys)
        fan = Fanout(len(requests), lambda: self._cancel(key), lambda index: self._stop_choice(key, index))
        self.requests[key] = (sink, fan)
        try:
            refusal = await asyncio.wait_for(_detached(lambda: self.engine.submit.remote(sink, key, requests)),
                                             self.timeout_s)
        except BaseException:
            fan.close()
            raise
        if refusal is not None:
            self.requests.pop(key, None)
        return fan, refusal

    async def _connect(self) -> str:
        async with self._lock:
            if self.pump is None or self.pump.done():
                sink = uuid.uuid4().hex
                gen = _detached(lambda: self.engine.options(stream=True).subscribe.remote(sink))
                try:
                    await asyncio.wait_for(gen.__anext__(), self.timeout_s)
                except BaseException:
                    gen.cancel()
                    raise
                self.sink, self.gen, self.pump = sink, gen, asyncio.create_task(self._pump(gen, sink))
            return self.sink

    def close(self) -> None:
        """Drop the subscription (this replica is shutting down): the engine replica aborts what ran
        on it and has no call left open that would hold up its own shutdown."""
        try:
            if self.pump is not None:
                self.pump.cancel()
            if self.gen is not None:
                self.gen.cancel()
        except RuntimeError:  # the event loop is already closed: nothing is left to cancel
            pass

    async def _pump(self, gen, sink: str) -> None:
        try:
            async for batch in gen:
                for m in batch:
                    entry = self.requests.get(m.key)
                    if entry is None:
                        continue
                    fan = entry[1]
                    if isinstance(m.item, StreamChunk):
                        fan.feed(m.index, m.item)
                        continue
                    del self.requests[m.key]
                    fan.end() if isinstance(m.item, End) else fan.fail(RuntimeError(m.item.message))
            err: BaseException = RuntimeError("the engine's stream ended")
        except Exception as e:  # noqa: BLE001 — the engine replica is gone: every request on it fails
            err = e
        for key, (s, fan) in list(self.requests.items()):
            if s == sink:
                del self.requests[key]
                fan.fail(err)

    def _cancel(self, key: int) -> None:
        entry = self.requests.pop(key, None)
        if entry is None:  # already ended (or refused): nothing runs in the engine
            return
        self._send(_detached(lambda: self.engine.cancel.remote(entry[0], [key])))

    def _stop_choice(self, key: int, index: int) -> None:
        entry = self.requests.get(key)
        if entry is not None:
            self._send(_detached(lambda: self.engine.stop_choice.remote(entry[0], key, index)))

    def _send(self, call) -> None:
        task = asyncio.get_running_loop().create_task(self._wait(call))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _wait(self, call) -> None:
        try:
            await asyncio.wait_for(call, self.timeout_s)
        except Exception:  # noqa: BLE001 — best effort: a subscription that ends aborts its requests anyway
            pass


def _detached(call):
    """``call()`` (a handle's ``.remote``) in a fresh context: no Serve request is its parent, so a client
    that goes away does not cancel it."""
    return contextvars.Context().run(call)
