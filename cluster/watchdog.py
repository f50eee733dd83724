"""The hang watchdog's clock: how long an actor kind's step may take before the actors still silent
are asked whether they live.

A step's wait for an actor ends in one of three ways: its answer; its channel closing (the process
or its node died: found at once); or silence. Silence is ambiguous: a long prefill, a peer that is
slow, or a process that stopped answering anything (``kill -STOP``, a wedged driver, a swap storm).
The executor waits up to :meth:`HangWatch.budget` — ``clamp(factor × p99 of the kind's recent step
times, floor_s, cap_s)`` — then asks every silent actor for a heartbeat on Ray's thread (never the
step thread): one that answers lives (its step is long, or it waits for a peer) and gets another
budget; one that does not answer within the heartbeat timeout is hung, and is killed and replaced
through recovery. ``cap_s`` (the step timeout) bounds the whole wait.

Owns: the recent step times per actor kind. Never: talks to an actor (the executor and its fleet do).
"""

from __future__ import annotations

import math
from collections import deque


class HangWatch:
    def __init__(self, *, floor_s: float, factor: float, cap_s: float, window: int = 256):
        if not 0 < floor_s <= cap_s or factor <= 0:
            raise ValueError(f"hang watchdog: need 0 < floor_s <= cap_s and factor > 0, got floor_s={floor_s}, "
                             f"cap_s={cap_s}, factor={factor}")
        self.floor_s, self.factor, self.cap_s = floor_s, factor, cap_s
        self.recent: dict[str, deque[float]] = {}
        self.window = window

    def observe(self, kind: str, seconds: float) -> None:
        """One actor of ``kind`` answered a step ``seconds`` after the wait for it began."""
        self.recent.setdefault(kind, deque(maxlen=self.window)).append(seconds)

    def p99(self, kind: str) -> float | None:
        times = sorted(self.recent.get(kind, ()))
        return times[max(0, math.ceil(0.99 * len(times)) - 1)] if times else None  # nearest rank

    def budget(self, kind: str) -> float:
        """Seconds to wait for ``kind``'s answer before asking the silent actors for a heartbeat."""
        p99 = self.p99(kind)
        return min(self.cap_s, max(self.floor_s, self.factor * p99 if p99 is not None else 0.0))
