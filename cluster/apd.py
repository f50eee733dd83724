"""Prefill/decode disaggregation behind the async API: the prefill and the decode engine each on its own
thread (:class:`~cluster.aengine.AsyncEngine`), so the decode engine's streams go on while a long prompt
is prefilled on the other (docs/architecture.md, "Prefill/decode disaggregation").

:meth:`AsyncDisaggregated.generate` streams one request as :meth:`AsyncEngine.generate` does. Each part of
its path runs on the thread of the engine whose state it touches, between that engine's steps: its route
on the decode engine's (its prefix cache, its replicas' load); the prompt's prefill as a request of the
prefill engine; pinning and reading its blocks on the prefill engine's (:meth:`Disaggregated.read`);
checking and writing them on the decode engine's once no step is in flight (``settled``:
:meth:`Disaggregated.accept`); the lease's end back on the prefill engine's. A client that goes away at
any point ends what its request holds on both (each release queued behind the call that took it, in the
engines' control order). A failed transfer is counted and the request prefilled on decode, as in
:class:`~cluster.pd.Disaggregated`, whose routes, leases and counts this shares.

Owns: one request's way through the two engines. Never: touches an engine from another thread.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import AsyncIterator, Callable

from model.sampling import SamplingParams

from .aengine import AsyncEngine, chunks_of
from .engine import Engine
from .pd import FAILURES, Disaggregated, PrefillError, Route
from .stream import EngineRequest, StreamChunk


class AsyncDisaggregated:
    def __init__(self, prefill: AsyncEngine, decode: AsyncEngine, *, min_uncached_tokens: int = 256,
                 lease_s: float = 30.0, timeout_s: float = 60.0, transport: str = "channel"):
        """``timeout_s``: the longest wait for one engine's part of a transfer (a call between its steps);
        ``transport``: how the blocks move (cluster/kv_transfer.py ``TRANSPORTS``)."""
        self.prefill, self.decode, self.timeout_s = prefill, decode, timeout_s
        self.core = Disaggregated(prefill.engine, decode.engine, min_uncached_tokens=min_uncached_tokens,
                                  lease_s=lease_s, transport=transport)
        self._keys = itertools.count()
        self._entering = 0  # sequences taken in by generate_many and not yet queued on decode (in a transfer)
        self._loop: asyncio.AbstractEventLoop | None = None  # the requests' loop: a recovery's prefill runs there
        self.max_recovering = 8  # a decode recovery's sequences brought back at once (the rest wait, parked)
        self._recovering: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        decode.engine.on_rewound = self._rewound

    async def _on(self, engine: AsyncEngine, fn: Callable[[Engine], object], settled: bool = False):
        return await asyncio.wait_for(asyncio.wrap_future(engine.control(fn, settled=settled)), self.timeout_s)

    # ---- what the serving streams (deploy/mux.py) ask of an async engine ------------------------
    def check(self, requests: list[EngineRequest]) -> None:
        self.decode.check(requests)  # a request refused here takes nothing on either engine

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run: those in a transfer (not yet queued on decode) and decode's waiting ones
        (what a queue limit counts: the serving app's ``max_queue``)."""
        return self._entering + self.decode.num_waiting

    def abort(self, seq_id: int) -> None:
        self.decode.abort(seq_id)  # (the decode engine's sequence ids: those generate_many yields)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        """Stream one request (its route counted once it ends: :attr:`routes`)."""
        async for chunk in chunks_of(self.generate_many([request])):
            yield chunk

    async def generate_many(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, int, StreamChunk]]:
        """:meth:`AsyncEngine.generate_many` through both engines: each sequence routed, the long ones'
        blocks brought across (concurrently), then all admitted on the decode engine together. While the
        prefill engine is unavailable every sequence is prefilled on decode."""
        self.check(requests)
        self._loop = asyncio.get_running_loop()
        keys = [next(self._keys) for _ in requests]
        prompts = [(list(r.prompt_ids), r.cache_salt) for r in requests]
        entering = len(requests)
        self._entering += entering
        try:
            plan = await self._on(self.decode, lambda e: self.core.plan(prompts))
        except BaseException:
            self._entering -= entering
            raise
        if not self.prefill.healthy:
            plan = [(Route("local", "the prefill engine is unavailable"), 0, rep) if route.kind == "pd" else
                     (route, cut, rep) for route, cut, rep in plan]
        routes = [route for route, _, _ in plan]
        hits, done = {}, set()
        try:
            moved = [self._transfer(route, p, salt, cut, rep, key)
                     for (route, cut, rep), (p, salt), key in zip(plan, prompts, keys) if route.kind == "pd"]
            if moved:
                outcome = iter(await asyncio.gather(*moved))
                routes = [next(outcome) if route.kind == "pd" else route for route in routes]
            ahead = [EngineRequest(r.prompt_ids, r.params, r.cache_salt, rep if route.kind == "pd" else None)
                     for r, route, (_, _, rep) in zip(requests, routes, plan)]
            stream = self.decode.generate_many(ahead)
            first = asyncio.ensure_future(stream.__anext__())  # queues the sequences in the decode engine ...
            await asyncio.sleep(0)
            self._entering, entering = self._entering - entering, 0  # (counted there now)
            self._release(keys)  # ... then, behind them, their arrivals: cached once queued (held until
            # admission, a request waiting for room could wait on blocks held for another)
            try:
                item = await first
                while True:
                    i, seq_id, chunk = item
                    hits.setdefault(i, chunk.cached_tokens)
                    if chunk.finish_reason is not None and chunk.finish_reason != "abort":
                        done.add(i)
                    yield i, seq_id, chunk
                    item = await stream.__anext__()
            except StopAsyncIteration:
                pass
            finally:
                await stream.aclose()
        finally:
            self._entering -= entering  # (a request that ended before it was queued)
            self._release(keys)  # (queued behind a transfer still being written)
            for i, route in enumerate(routes):
                if i not in done:
                    route.kind = "aborted"
                self.core.finished(route, hits.get(i))

    async def _transfer(self, route: Route, prompt: list[int], salt: str | None, cut: int, replica: int,
                        key: int) -> Route:
        """The prompt's blocks up to ``cut`` from the prefill engine into decode ``replica``: the route it took."""
        try:
            async for _ in self.prefill.generate(EngineRequest(tuple(prompt[: cut + 1]), SamplingParams(max_tokens=1),
                                                               salt)):
                pass
        except Exception as e:  # noqa: BLE001 — the prefill engine failed it (or went away): decode prefills it
            self.core.count_failure("PrefillError")
            return Route("local", f"the prefill engine failed: {type(e).__name__}: {e}")
        try:
            t0 = time.perf_counter()
            lease, kv = await self._on(self.prefill, lambda e: self.core.read(prompt, salt, cut, key))
            route.written = await self._on(self.decode, lambda e: self.core.accept(kv, replica, key, lease),
                                           settled=True)
            route.nbytes, route.seconds = kv.nbytes, time.perf_counter() - t0
            self.core.timed(route.seconds)
            return route
        except FAILURES as e:
            return Route("local", f"transfer failed: {e}")
        except (TimeoutError, asyncio.TimeoutError) as e:  # an engine did not get to its part in time
            self.core.count_failure("TimeoutError")
            return Route("local", f"transfer failed: an engine's part took over {self.timeout_s:g} s ({e})")
        except Exception as e:  # noqa: BLE001 — e.g. an engine that stopped meanwhile: decode prefills it
            self.core.count_failure("Error")
            return Route("local", f"transfer failed: {type(e).__name__}: {e}")
        finally:  # acknowledged, failed or abandoned (queued behind the read, if that still runs): let go
            self.prefill.control(lambda e: self.core.leases.end_key(key), even_if_unavailable=True)

    # ---- a decode engine's recovery through the prefill engine ----------------------------------------
    def _rewound(self, eng: Engine, seqs: list) -> None:
        """On the decode engine's thread, as it recovers: each sequence of :meth:`Disaggregated.to_recover` is
        set aside (parked: decode's other streams go on) while the prefill engine makes its blocks and they are
        brought to its replica (:meth:`_bring_back`, on the requests' event loop); then it is queued again,
        to compute only its tail there. Without a loop or a healthy prefill engine decode re-prefills them."""
        loop, todo = self._loop, self.core.to_recover(seqs)
        if loop is None or loop.is_closed() or not self.prefill.healthy:
            for _ in todo:
                self.core.recovered_by("local")
            return
        for seq, tokens, cut, replica in todo:
            key = next(self._keys)  # this parking's own (a later one of the same sequence gets another)
            # parked at most as long as its transfer may take (each part's timeout), then prefilled on decode
            eng.scheduler.park(seq, time.monotonic() + 4 * self.timeout_s, key)
            try:
                asyncio.run_coroutine_threadsafe(self._bring_back(seq.seq_id, key, seq.cache_salt, tokens, cut,
                                                                  replica), loop)
            except RuntimeError:  # the loop closed meanwhile: prefilled on decode
                eng.scheduler.unpark(seq.seq_id, None, key)

    async def _bring_back(self, seq_id: int, key: int, salt: str | None, tokens: list[int], cut: int,
                          replica: int) -> None:
        """A parked sequence's blocks from the prefill engine into decode ``replica``, then it is unparked there
        (or, on any failure, unparked to be prefilled on decode); counted by where it was re-prefilled."""
        home, error = None, None
        loop = asyncio.get_running_loop()
        if self._recovering is None or self._recovering[0] is not loop:  # (one per loop: it binds to it)
            self._recovering = (loop, asyncio.Semaphore(self.max_recovering))
        gate = self._recovering[1]
        try:
            await gate.acquire()  # a dead replica's many sequences do not all prefill at once
        except BaseException:
            self.decode.control(lambda e: e.scheduler.unpark(seq_id, None, key), even_if_unavailable=True)
            raise
        try:
            if await self._on(self.decode, lambda e: e.scheduler.parked.get(seq_id, (None, 0.0, None))[2]) != key:
                return  # it ended (or waited past its time) meanwhile: nothing to bring
            async def prefill():
                async for _ in self.prefill.generate(EngineRequest(tuple(tokens[: cut + 1]),
                                                                   SamplingParams(max_tokens=1), salt)):
                    pass
            try:
                await asyncio.wait_for(prefill(), self.timeout_s)
            except Exception as e:  # noqa: BLE001 — failed or overdue
                raise PrefillError(f"{type(e).__name__}: {e}") from e
            try:
                lease, kv = await self._on(self.prefill, lambda e: self.core.read(tokens, salt, cut, key))
                await self._on(self.decode, lambda e: self.core.accept(kv, replica, key, lease), settled=True)
            finally:  # (a read that ran past its wait still took a lease: ended behind it)
                self.prefill.control(lambda e: self.core.leases.end_key(key), even_if_unavailable=True)
            home = replica
        except Exception as e:  # noqa: BLE001 — decode prefills it itself
            error = e
        finally:
            gate.release()

            def back(e: Engine) -> None:
                if e.scheduler.unpark(seq_id, home, key):  # (not if it ended, or waited past its time, meanwhile)
                    self.core.recovered_by("pd" if home is not None else "local", error)
                self.core.release_arrival(key)  # (queued: the arrivals are cached)
            self.decode.control(back, even_if_unavailable=True)

    def _release(self, keys: list[int]) -> None:
        """Queue the release of these requests' arrivals on the decode engine's thread (also while it is
        unavailable: its thread runs them)."""
        for key in keys:
            self.decode.control(lambda e, key=key: self.core.release_arrival(key), even_if_unavailable=True)

    @property
    def routes(self):
        return self.core.routes

    def status(self) -> dict:
        return self.core.status()
