"""Load progress of one actor's weights: bytes read of bytes to read, updated by the reader."""

from __future__ import annotations

import threading


class LoadProgress:
    """Owned by one worker; the checkpoint reader calls :meth:`update`, anyone may read the totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done, self.total = 0, 0

    def update(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, total

    @property
    def fraction(self) -> float:
        return 1.0 if self.total == 0 else self.done / self.total
