"""An attention actor's side of the KV tier (cluster/kv_tier.py): the blocks the engine names are copied out of
the cache as a step begins (write-through; a writer thread files them, off the step's path), and entries are
probed and loaded into cache blocks between steps (docs/architecture.md, "The KV tier").

Owns: the actor's tiers handle, its writer thread and queue, its counters. Never: decides what is written or
loaded (the engine's prefix cache does), or reads the environment (the engine's config says where the tier is).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from .kv_tier import open_tiers, tier_key
from model.cache import ModelCache, read_blocks

log = logging.getLogger(__name__)


def fetch_from(source, want: list[tuple[str, bytes]], wait_s: float, name: str = "") -> dict[bytes, bytes]:
    """The entries ``want`` [(kind, hash)] as another node's tier stores them, read by this actor from ``source``
    (that node's attention actor: a Ray actor handle, called through Ray so the bytes go between the two nodes,
    not through the engine; or in one process the worker itself), waiting at most ``wait_s``: key → bytes, up to
    the first the source could not read. A source that fails or does not answer in time gives none (logged):
    those entries are prefilled; :meth:`ActorTier.load` checks every one it gets."""
    try:
        call = getattr(source, "tier_fetch")
        if hasattr(call, "remote"):
            import ray

            got = ray.get(call.options(concurrency_group="tier").remote(want), timeout=wait_s)
        else:
            got = call(want)
    except Exception:  # noqa: BLE001 — what cannot come is prefilled
        log.warning("%s: reading another node's KV tier failed; its entries are prefilled", name, exc_info=True)
        return {}
    return {tier_key(k, h): data for (k, h), data in zip(want, got)}


class ActorTier:
    """The KV tier as one attention actor's cache sees it (``spec``: cluster/kv_transfer.py ``tier_spec``)."""

    def __init__(self, spec: dict, cache: ModelCache, max_queued: int = 1024):
        from .group import node_ip

        self.tiers, self.cache = open_tiers(spec, node_ip()), cache
        self.queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.copied = self.dropped = self.write_errors = self.loaded = 0
        self.sent = self.received = 0  # entries sent to, and received from, other nodes' actors
        self.thread = threading.Thread(target=self._write, name="moeray-kv-tier", daemon=True)
        self.thread.start()

    # ---- write-through ------------------------------------------------------------------------
    def copy_out(self, items) -> None:
        """Copy each (kind, id, key) — a "block" or a KDA "snapshot" — out of the cache now (its rows may be
        reused once this step is done) and queue it for the writer; a full queue drops it (counted)."""
        for kind, i, key in items:
            parts = self._read(kind, i)
            try:
                self.queue.put_nowait((key, parts))
                self.copied += 1
            except queue.Full:
                self.dropped += 1

    def _read(self, kind: str, i: int) -> dict[str, torch.Tensor]:
        if kind == "block":
            return {"latent": read_blocks(self.cache, [i])["latent"]}
        conv, recurrent = self.cache.kda.snapshot(i)
        return {"conv": conv.to("cpu", copy=True), "recurrent": recurrent.to("cpu", copy=True)}

    def _write(self) -> None:
        while True:
            key, parts = self.queue.get()
            try:
                if key is None:
                    return
                if isinstance(parts, bytes):  # an entry another node's tier sent, as stored there
                    self.tiers.put_entry(key, parts)
                else:
                    self.tiers.put(key, parts)
            except Exception:  # noqa: BLE001 — a write that fails is a later miss, never a wrong answer
                self.write_errors += 1
                log.exception("KV tier: a write-through failed")
            finally:
                self.queue.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is filed (tests, and an orderly stop); False if it took longer."""
        end = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True

    # ---- reading back -------------------------------------------------------------------------
    def probe(self, blocks: list[bytes], snapshots: list[bytes]) -> tuple[int, list[bool]]:
        """How many of ``blocks``' keys, in order, the tiers hold (up to the first absent), and which of
        ``snapshots``' keys they hold. A probe only: a later load checks every entry."""
        n = 0
        for key in blocks:
            if key not in self.tiers:
                break
            n += 1
        return n, [key in self.tiers for key in snapshots]

    def fetch(self, keys: list[bytes]) -> list[bytes]:
        """The entries of ``keys`` as stored, in order, up to the first this node's tiers do not hold whole: for
        another node's actor to load (:meth:`load`'s ``fetched``), which checks them again on arrival."""
        out = []
        for key in keys:
            got = self.tiers.fetch(key)
            if got is None:
                break
            out.append(got[1])
        self.sent += len(out)
        return out

    def names(self, limit: int) -> list[str]:
        """The names of the entries this node's tiers hold (most recently used first): the engine's index of them
        after a restart."""
        return self.tiers.names(limit)

    def load(self, items, fetched: dict[bytes, bytes] | None = None) -> int:
        """Load each (kind, id, key) into the cache, in order, up to the first entry that is not there whole (a
        miss: absent, torn, foreign, changed): returns how many were loaded. An entry in ``fetched`` (key → its
        bytes from another node's tier: :meth:`fetch`) is checked as a read here is, loaded, and queued to be
        filed in this node's tier too."""
        n = 0
        for kind, i, key in items:
            data = (fetched or {}).get(key)
            parts = self.tiers.get(key) if data is None else self.tiers.node.check(key, data)
            if parts is None or not self._write_in(kind, i, parts):
                break
            if data is not None:
                self.received += 1
                try:
                    self.queue.put_nowait((key, data))
                except queue.Full:
                    self.dropped += 1
            n += 1
        self.loaded += n
        return n

    def _write_in(self, kind: str, i: int, parts: dict) -> bool:
        try:
            if kind == "block":
                data, bs = self.cache.latent.data, self.cache.latent.block_size
                rows = data.view(data.shape[0], -1, bs, data.shape[2])
                rows[:, i] = parts["latent"][:, 0].to(data.device)  # (shapes checked: a mismatch raises)
            else:
                conv, recurrent = self.cache.kda.snapshot(i)
                conv.copy_(parts["conv"].to(conv.device))
                recurrent.copy_(parts["recurrent"].to(recurrent.device))
            return True
        except (KeyError, RuntimeError, IndexError) as e:  # the layout digest matched, yet the rows do not fit
            log.warning("KV tier: an entry did not fit the cache (%s): a miss", e)
            return False

    def status(self) -> dict:
        return {"copied": self.copied, "dropped": self.dropped, "write_errors": self.write_errors,
                "queued": self.queue.qsize(), "loaded": self.loaded, "sent": self.sent,
                "received": self.received, "tiers": self.tiers.status()}

    _last: dict | None = None

    def changed(self) -> dict | None:
        """:meth:`status`, when it differs from the last one given (each step's result carries it then)."""
        now = self.status()
        now.pop("queued")
        if now == self._last:
            return None
        self._last = now
        return now

    def close(self) -> None:
        try:
            self.queue.put_nowait((None, None))
        except queue.Full:
            pass
