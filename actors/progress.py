"""Load progress of one actor's weights: bytes read of bytes to read, updated by the reader.

The actor is still in its constructor while it loads, so nobody can ask it; it publishes instead,
to Ray's internal key-value store under ``moeray/load/<placement group id>/<actor>``, where
:mod:`cluster.progress` reads it (the group id tells one engine's start-up from another's).
Never: blocks the reader on publishing for long (at most one small put every ``interval_s``).
"""

from __future__ import annotations

import json
import logging
import threading
import time

KEY_PREFIX = "moeray/load/"
log = logging.getLogger(__name__)


class LoadProgress:
    """Owned by one worker; the checkpoint reader calls :meth:`update`, anyone may read the totals."""

    def __init__(self, actor: str, *, publish: bool = True, interval_s: float = 0.5) -> None:
        self.actor, self.interval_s = actor, interval_s
        self._lock = threading.Lock()
        self.done, self.total = 0, 0
        self._last = 0.0
        self._key = _key(actor) if publish else None

    def update(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, total
        now = time.monotonic()
        if self._key is not None and (done >= total or now - self._last >= self.interval_s):
            self._last = now
            self._publish()

    def _publish(self) -> None:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_put(self._key, json.dumps({"bytes_read": self.done, "bytes_total": self.total}),
                                         overwrite=True)
        except Exception as e:  # progress is advisory: loading goes on, but say so once
            log.warning("%s: could not publish load progress (%r); not trying again", self.actor, e)
            self._key = None


def _key(actor: str) -> str | None:
    """This actor's key, or None outside a Ray placement group (nothing to group it by)."""
    try:
        import ray
    except ImportError:  # a worker in a process without Ray: nobody to publish to
        return None
    if not ray.is_initialized():
        return None
    pg = ray.get_runtime_context().get_placement_group_id()
    return None if pg is None else f"{KEY_PREFIX}{pg}/{actor}"
