"""The errors the engine's seam raises (:mod:`cluster.executor`) and the engine passes on."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The cluster failed: an actor died, a collective timed out, or a step got no answer."""


class StepFailed(EngineError):
    """A step failed. ``dead``: the members that died or never answered (to replace); ``errored``:
    those that answered with an error (an exchange whose peer died): they only need a new process
    group, unless their node is gone too (the epoch owner probes their nodes)."""

    def __init__(self, message: str, dead: list[tuple[str, int]], errored: list[tuple[str, int]] = (),
                 hung: list[tuple[str, int]] = ()):
        super().__init__(message)
        self.dead = list(dead)  # (kind, index) with kind "attention" or "expert"
        self.errored = list(errored)
        self.hung = list(hung)  # of the dead: those found hung (silent, no heartbeat) and killed


class RequestsFailed(EngineError):
    """The same work failed step after step although every failure was recovered (the actors
    replaced or regrouped each time): its sequences ``seq_ids`` are dropped with this error, so that
    work that fails every time (a bug an input meets, say) ends instead of being retried for ever."""

    def __init__(self, message: str, seq_ids: list[int]):
        super().__init__(message)
        self.seq_ids = seq_ids


class NoCapacity(EngineError):
    """Recovery needs a replacement actor that the cluster has no room for right now."""
