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
from typing import AsyncIterator, Callable

from model.sampling import SamplingParams

from .aengine import AsyncEngine
from .engine import Engine
from .pd import FAILURES, Disaggregated, Route
from .stream import EngineRequest, StreamChunk


class AsyncDisaggregated:
    def __init__(self, prefill: AsyncEngine, decode: AsyncEngine, *, min_uncached_tokens: int = 256,
                 lease_s: float = 30.0, timeout_s: float = 60.0):
        """``timeout_s``: the longest wait for one engine's part of a transfer (a call between its steps)."""
        self.prefill, self.decode, self.timeout_s = prefill, decode, timeout_s
        self.core = Disaggregated(prefill.engine, decode.engine, min_uncached_tokens=min_uncached_tokens,
                                  lease_s=lease_s)
        self._keys = itertools.count()

    async def _on(self, engine: AsyncEngine, fn: Callable[[Engine], object], settled: bool = False):
        return await asyncio.wait_for(asyncio.wrap_future(engine.control(fn, settled=settled)), self.timeout_s)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        """Stream ``request`` (its route counted once it ends: :attr:`routes`)."""
        self.decode.check([request])  # a request refused here takes nothing on either engine
        prompt, salt = list(request.prompt_ids), request.cache_salt
        key = next(self._keys)
        route, cut, replica = await self._on(self.decode, lambda e: self.core.route(prompt, salt))
        ended, hit = False, None
        try:
            if route.kind == "pd":
                route = await self._transfer(route, prompt, salt, cut, replica, key)
            ahead = EngineRequest(request.prompt_ids, request.params, salt,
                                  replica if route.kind == "pd" else None)
            first = True
            async for chunk in self.decode.generate(ahead):
                if first:  # admitted: the arrival is the decode engine's cache now
                    self.decode.control(lambda e: self.core.release_arrival(key))
                    first, hit = False, chunk.cached_tokens
                yield chunk
            ended = True
        finally:
            self.decode.control(lambda e: self.core.release_arrival(key))  # (after a transfer still being written)
            if not ended:
                route.kind = "aborted"
            self.core.finished(route, hit)

    async def _transfer(self, route: Route, prompt: list[int], salt: str | None, cut: int, replica: int,
                        key: int) -> Route:
        """The prompt's blocks up to ``cut`` from the prefill engine into decode ``replica``: the route it took."""
        async for _ in self.prefill.generate(EngineRequest(tuple(prompt[: cut + 1]), SamplingParams(max_tokens=1),
                                                           salt)):
            pass
        try:
            lease, kv = await self._on(self.prefill, lambda e: self.core.read(prompt, salt, cut, key))
            route.written = await self._on(self.decode, lambda e: self.core.accept(kv, replica, key, lease),
                                           settled=True)
            route.nbytes = kv.nbytes
            return route
        except FAILURES as e:
            return Route("local", f"transfer failed: {e}")
        finally:  # acknowledged, failed or abandoned (queued behind the read, if that still runs): let go
            self.prefill.control(lambda e: self.core.leases.end_key(key))

    @property
    def routes(self):
        return self.core.routes

    def status(self) -> dict:
        return self.core.status()
