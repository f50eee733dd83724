"""An async token stream per request over the (synchronous) engine.

:class:`AsyncEngine` owns one background thread, the only one that touches the :class:`Engine`:
it admits submitted requests (:class:`~cluster.stream.EngineRequest`), runs steps while there is
work, and hands each request's new token ids (with their logprobs, the finish reason and the
prompt tokens found cached) to that request's asyncio queue. It never makes text: the front end
does (deploy/output.py). After each step it publishes a :class:`~cluster.engine.EngineSnapshot`,
which ``/metrics`` and the queue check read instead of the engine's live state. A consumer that stops
iterating (a client that disconnected) aborts its request, which frees its cache at once, and one
sequence of a request can be aborted alone (:meth:`AsyncEngine.abort`: a choice that met its stop
string).
A failed step is recovered inside the engine (dead actors replaced, the step redone), invisible to
the streams. When recovery is impossible for now (no capacity), every open and queued request gets
the error, new ones are refused with the reason (``unavailable``), and the thread retries the
recovery every ``heal_every_s`` until it succeeds. Work that fails every time it is redone
(:class:`~cluster.engine.RequestsFailed`) ends its own requests with the error; the rest go on.
Any other failure of a step is fatal: every open request gets the error and the engine is marked
unhealthy (Serve's health check replaces it).
Control calls (epoch changes, status) reach the engine only through this thread too
(:meth:`AsyncEngine.control`), between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from model.threads import release_openmp_pool

from .engine import Engine, EpochChange, NoCapacity, RequestsFailed, Transition
from .stream import EngineRequest, StreamChunk


@dataclass(frozen=True)
class _Add:
    """Inbox: admit one request's sequences together, then resolve ``ready`` with their ids."""

    requests: list  # [(EngineRequest, _Stream)]
    ready: asyncio.Future


@dataclass(frozen=True)
class _Call:
    """Inbox: run ``fn(engine)`` between steps (``settled``: with no step in flight); its result or exception
    goes to ``future``."""

    fn: Callable
    future: concurrent.futures.Future
    settled: bool = False


@dataclass(frozen=True)
class _Abort:
    """Inbox: drop one sequence."""

    seq_id: int


class _Stream:
    """One sequence's way to its consumer: ``(index, item)`` into a queue it may share with the other
    sequences of its request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int = 0):
        self.loop, self.queue, self.index = loop, queue, index

    def push(self, item) -> bool:
        """Hand an item to the consumer's loop; False when that loop is gone (consumer vanished)."""
        return _call(self.loop, self.queue.put_nowait, (self.index, item))


class AsyncEngine:
    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05, heal_every_s: float = 2.0):
        self.engine, self.idle_wait_s, self.heal_every_s = engine, idle_wait_s, heal_every_s
        self.unavailable: str | None = None  # why new requests are refused (no capacity to recover), or None
        self._next_heal = 0.0
        self._inbox: queue.Queue = queue.Queue()
        self._queued, self._queued_lock = 0, threading.Lock()  # sequences in the inbox, not yet admitted
        self._streams: dict[int, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moeray-engine", daemon=True)
        self.error: BaseException | None = None
        self._settled: list[_Call] = []  # control calls waiting for the steps in flight to finish

    def start(self) -> "AsyncEngine":
        # the steps run on the engine thread from now on: a pool the starting thread made (building the
        # model in process) would throttle every parallel op there (model/threads.py)
        release_openmp_pool()
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine runs (it may be waiting for capacity to recover); False once a step failed fatally."""
        return self.error is None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.alive and self.unavailable is None

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet running (queued here, or in the scheduler at the last step)."""
        return self._queued + self.engine.snapshot.waiting

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        """Stream one request. Raises ValueError for bad input before anything is queued."""
        async for chunk in chunks_of(self.generate_many([request])):
            yield chunk

    async def generate_many(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, int, StreamChunk]]:
        """Stream the sequences of one request (its ``n`` choices, its list of prompts), which enter the
        engine together: all are admitted at one step boundary, so none waits behind another's first
        token. Yields ``(index into requests, seq_id, chunk)`` as they come, until every one finished.
        Raises as :meth:`check` does, before anything is queued. Closing the iterator aborts the
        sequences still running."""
        self.check(requests)
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        streams = [_Stream(loop, out, i) for i in range(len(requests))]
        ready: asyncio.Future = loop.create_future()
        with self._queued_lock:
            self._queued += len(requests)
        self._inbox.put(_Add(list(zip(requests, streams)), ready))
        try:
            seq_ids = await asyncio.shield(ready)
        except asyncio.CancelledError:  # gone before admission: abort as soon as it is admitted
            ready.add_done_callback(self._abort_when_admitted)
            raise
        running = set(range(len(requests)))
        try:
            while running:
                i, item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                yield i, seq_ids[i], item
                if item.finish_reason is not None:
                    running.discard(i)
        finally:  # the consumer went away (or one sequence failed): free the others now
            for i in running:
                self._inbox.put(_Abort(seq_ids[i]))

    def abort(self, seq_id: int) -> None:
        """Abort one sequence (of a request still being read): its stream ends with an ``abort`` chunk,
        and its cache is freed at the next step boundary. Any thread; a finished one is left alone."""
        self._inbox.put(_Abort(seq_id))

    def check(self, requests: list[EngineRequest]) -> None:
        """The one check of a request's limits (the engine thread admits it without another): raises
        ValueError for bad input and RuntimeError when the engine cannot take work now. Any thread:
        it reads only the engine's fixed settings."""
        if not self.healthy:
            raise RuntimeError(f"engine is unavailable: {self.unavailable}" if self.alive
                               else f"engine is not running: {self.error}")
        if not requests:
            raise ValueError("a request needs at least one sequence")
        for r in requests:
            self.engine.validate(list(r.prompt_ids), r.params)

    def control(self, fn: Callable[[Engine], object], *, even_if_unavailable: bool = False,
                settled: bool = False) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread at the next step boundary; the future holds its
        result or its exception (which does not stop the engine). ``even_if_unavailable``: also while
        the engine waits for capacity or has failed (status, chaos), as long as its thread runs.
        ``settled``: once the steps in flight are finished and their tokens delivered (no step sent
        ahead: :meth:`Engine.settle`), as writing cache blocks from outside needs."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not (self._thread.is_alive() if even_if_unavailable else self.healthy):
            fut.set_exception(RuntimeError(f"engine is not running: {self.error}"))
            return fut
        self._inbox.put(_Call(fn, fut, settled))
        return fut

    async def change(self, begin: Callable[[Engine], Transition], timeout_s: float) -> EpochChange:
        """Begin an epoch change on the engine thread and wait until it happened (steps go on)."""
        transition = await asyncio.wait_for(asyncio.wrap_future(self.control(begin)), timeout_s)
        return await asyncio.wait_for(asyncio.wrap_future(transition.done), timeout_s)

    def _abort_when_admitted(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            for seq_id in fut.result():
                self._inbox.put(_Abort(seq_id))

    # ---- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        """Steps back to back, pipelined: a decode step is sent before the last one's results are
        back (:meth:`Engine.launch_ahead`), else once its tokens are applied; only then are the
        finished step's statistics recorded and its tokens detokenised and delivered — that work
        overlaps the actors computing the next step (the engine keeps the steps in flight)."""
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.busy)
            if self._stop.is_set():
                continue
            try:
                if self.error is not None:  # failed for good: only answer what still arrives
                    continue
                if self.unavailable is not None:
                    self._heal()
                    continue
                if self._settled:
                    self._run_settled()
                    continue
                if not engine.busy:
                    engine.advance()  # an epoch change can happen while idle too
                    continue
                events = engine.pipelined()
                t0 = time.perf_counter()
                for ev in events:
                    self._deliver(ev)
                engine.publish()
                engine.stats.add_time(deliver=time.perf_counter() - t0)
            except RequestsFailed as e:  # work that failed every time it ran: only its requests end
                for seq_id in e.seq_ids:
                    stream = self._streams.pop(seq_id, None)
                    if stream is not None:
                        stream.push(e)
                continue
            except NoCapacity as e:  # recovery must wait for room: fail what is open, refuse new work
                self.unavailable = str(e)
                self._next_heal = time.monotonic() + self.heal_every_s
                self._fail_all(e)
                continue
            except BaseException as e:  # noqa: BLE001 — delivered to every waiting request
                engine.inflight.clear()
                self.error = e
                self._fail_all(e)

    def _run_settled(self) -> None:
        """Finish the steps in flight (their tokens delivered), then run the settled control calls."""
        calls, self._settled = self._settled, []
        try:
            self.engine.settle(self._deliver)
        except BaseException as e:  # the loop handles the failure; the calls are answered with it
            for call in calls:
                if call.future.set_running_or_notify_cancel():
                    call.future.set_exception(e)
            raise
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                try:
                    call.future.set_result(call.fn(self.engine))
                except BaseException as e:  # noqa: BLE001 — the caller's error, not the engine's
                    call.future.set_exception(e)

    def _heal(self) -> None:
        if time.monotonic() < self._next_heal:
            return
        self._next_heal = time.monotonic() + self.heal_every_s
        self.engine.heal()  # raises NoCapacity again while there is still no room
        self.unavailable = None

    def _fail_all(self, err: BaseException) -> None:
        """Every open request (running or queued) ends with ``err``; the scheduler is emptied; control calls
        waiting for a settled boundary get ``err`` too."""
        calls, self._settled = self._settled, []
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(err)
        for seq_id, stream in list(self._streams.items()):
            stream.push(err)
            self.engine.abort(seq_id)
        self._streams.clear()
        for seq_id in list(self.engine.requests):
            self.engine.abort(seq_id)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if isinstance(item, _Add):
            self._add(item.requests, item.ready)
        elif isinstance(item, _Call):
            # a call whose caller stopped waiting (a control route that answered 503 at its timeout
            # cancels it) is not run: the caller was told it did not happen. Once running it cannot be
            # cancelled, so answering it cannot raise (an InvalidStateError here ended the thread)
            if item.settled:  # run by the loop, where a step failure while settling is handled as any other
                self._settled.append(item)
            elif item.future.set_running_or_notify_cancel():
                try:
                    result = item.fn(self.engine)
                except BaseException as e:  # noqa: BLE001 — the caller's error, not the engine's
                    item.future.set_exception(e)
                else:
                    item.future.set_result(result)
        elif isinstance(item, _Abort):
            stream = self._streams.pop(item.seq_id, None)
            self.engine.abort(item.seq_id)
            if stream is not None:  # ends the sequence's place in its request's stream
                stream.push(StreamChunk((), "abort", seq_id=item.seq_id))
        self.engine.publish()  # admissions and aborts change what /metrics shows
        if isinstance(item, _Add):  # (counted by the snapshot now)
            with self._queued_lock:
                self._queued -= len(item.requests)

    def _add(self, jobs: list, ready: asyncio.Future) -> None:
        """Admit one request's sequences together (all or none), before the next step."""
        loop = jobs[0][1].loop
        if self.error is not None or self.unavailable is not None:  # queued at the failure: answered
            why = f"engine is not running: {self.error}" if self.error is not None else \
                f"engine is unavailable: {self.unavailable}"
            _call(loop, _set_exception, ready, RuntimeError(why))
            return
        seq_ids: list[int] = []
        try:
            for request, _ in jobs:
                seq_ids.append(self.engine.admit(request))  # checked by check() when submitted
        except BaseException as e:  # noqa: BLE001
            for seq_id in seq_ids:
                self.engine.abort(seq_id)
            _call(loop, _set_exception, ready, e)
            return
        if _call(loop, _set_result, ready, seq_ids):
            self._streams.update((seq_id, stream) for seq_id, (_, stream) in zip(seq_ids, jobs))
        else:  # the consumer's loop is already gone
            for seq_id in seq_ids:
                self.engine.abort(seq_id)

    def _deliver(self, ev: StreamChunk) -> None:
        stream = self._streams.get(ev.seq_id)
        if stream is None:
            return
        delivered = stream.push(ev)
        if not delivered and ev.finish_reason is None:  # nobody will read it: free the sequence now
            self._handle(_Abort(ev.seq_id))
            return
        if ev.finish_reason is not None:
            self._streams.pop(ev.seq_id, None)
            self.engine.release(ev.seq_id)


async def chunks_of(stream: AsyncIterator[tuple[int, int, StreamChunk]]) -> AsyncIterator[StreamChunk]:
    """The chunks of a one-request ``generate_many`` stream, closing it (aborting what runs) when left."""
    try:
        async for _, _, chunk in stream:
            yield chunk
    finally:
        await stream.aclose()


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # closed loop
        return False


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
