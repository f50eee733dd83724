"""Seconds of compute per layer kind within one step, for the per-token profile (bench/bench_step.py,
the engine's breakdown): the attention of MLA and KDA layers, dense MLPs, a MoE block's own part (gate,
shared experts, latent projections), the embedding and the final norm. A MoE block's routed experts
are not here: they run where the exchange takes the rows (the exchange times them).

Host clock (``time.perf_counter``) around eager modules: on a GPU these are launch times unless the
caller synchronizes. A model holds none of this unless its cache carries a :class:`StepTimes`
(``ModelCache.times``); a stage that waits (a MoE block at its exchange) is timed only while it runs."""

from __future__ import annotations

import time
from collections.abc import Generator


class StepTimes:
    """Seconds per kind, added up until :meth:`reset` (the actor resets it at each step's start)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def stages(self, kind: str, gen: Generator):
        """``yield from`` this instead of ``gen``: ``gen``'s running time is added to ``kind``, the
        time it spends suspended (the caller exchanging its rows) is not."""
        value, t = None, time.perf_counter()
        while True:
            try:
                req = gen.send(value)
            except StopIteration as stop:
                self.add(kind, time.perf_counter() - t)
                return stop.value
            self.add(kind, time.perf_counter() - t)
            value = yield req
            t = time.perf_counter()
