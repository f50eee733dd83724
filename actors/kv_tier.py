"""The KV tier beyond the device: cached blocks kept in host memory and on disk, each entry checking itself
(docs/architecture.md, "The KV tier").

A :class:`Tier` is one level: a directory of entries, size-bounded, evicted least recently used first. The
node tier is a directory in host memory (``/dev/shm``: shared by every process of the node, and it outlives
them); the disk tier any directory. An entry is what one block holds — its MLA latent rows, or a KDA state
snapshot — stored as a safetensors file whose metadata carries the entry's key, the digest of the cache layout
that wrote it (cluster/kv_transfer.py ``layout_digest``: model and config, dtype, block size, row shapes) and
a CRC-32 of every byte. A read checks all three: an entry missing, torn (a write cut short, a
truncated file), of another layout, or whose bytes changed is a **miss** — counted by its reason and removed —
never an answer. Writes are atomic (a temporary file renamed into place): a reader sees a whole entry or none.

:class:`Tiers` stacks them: what the node tier evicts moves to the disk tier (when there is one) instead of
vanishing; a read looks top-down and a lower tier's hit is promoted back up.

Several processes may share a tier (every attention actor of a node does): the entries are files, their last
use their modification time (set from the nanosecond clock), and making room takes a lock on the directory (``fcntl.flock``), so each entry is
evicted once. What one process knows of the tier's size is refreshed by a scan when its own count says it is
full, or after ``rescan_every`` writes or a sixteenth of the entries it last saw, whichever is more (a scan
stats every entry: ~30 ms at 12,000 of them, the GIL held, so one every 64 writes took the engine's thread
seconds over an agent trace). Between two scans the others' writes are unseen: each other process may take
the tier past its bound by about a sixteenth. A tier over its bound is evicted down to ``low_water`` (90 %)
of it, so the scan comes once per many writes.

Owns: the entries' files, their format and checks, each tier's size bound and LRU order, the counters.
Never: decides what is written or read (the engine does), or touches a device cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import struct
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import torch


MAGIC = "moeray-kv-1"
_SUFFIX = ".kv"
MISSES = ("absent", "torn", "layout", "corrupt")  # why a read found nothing: see Tier.get


def checksum(parts: dict[str, torch.Tensor]) -> int:
    """CRC-32 over every part's bytes, in name order."""
    crc = 0
    for name in sorted(parts):
        t = parts[name].detach().contiguous().cpu()
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", crc)
    return crc


class Tier:
    """One level of the KV tier: ``path`` (made if missing), at most ``capacity_bytes`` of entries."""

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, layout: str, *, name: str = "node",
                 rescan_every: int = 64, low_water: float = 0.9):
        if capacity_bytes <= 0:
            raise ValueError(f"the {name} tier's size must be > 0 bytes, got {capacity_bytes}")
        self.path, self.capacity, self.name = Path(path), int(capacity_bytes), name
        self.path.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.rescan_every = rescan_every
        # making room evicts down to this fraction of the bound: a scan of the directory per many writes, not each
        self.low_water = int(self.capacity * low_water)
        self.spill_to = None  # what takes an evicted entry's file before it goes (Tiers: the disk tier)
        self._lock = threading.Lock()  # this process's counters and size estimate
        self.hits = 0
        self.misses: Counter = Counter()  # by reason (MISSES)
        self.bytes_in = self.bytes_out = 0  # written, read back
        self.evictions = 0
        self.load_s = 0.0  # reading hits back
        self._writes = 0  # since the last scan
        self._entries = 0  # what the last scan found
        self._used = self._scan(order=False)[1]

    # ---- entries --------------------------------------------------------------------------------
    def _file(self, key: bytes) -> Path:
        return self.path / (entry_name(self.layout, key) + _SUFFIX)

    def names(self, limit: int) -> list[str]:
        """The names (:func:`entry_name`) of the ``limit`` most recently used entries, most recent first."""
        recent = reversed(self._scan()[0][-limit:]) if limit > 0 else ()
        return [os.path.basename(f)[: -len(_SUFFIX)] for _, _, f in recent]

    def __contains__(self, key: bytes) -> bool:
        return self._file(key).exists()

    def put(self, key: bytes, parts: dict[str, torch.Tensor]) -> int:
        """Store ``parts`` (tensors, CPU or not) under ``key``, replacing what it held; returns the entry's bytes.
        Then evicts the least recently used entries (this one last) until the tier fits."""
        return self.put_bytes(key, self.encode(key, parts))

    def encode(self, key: bytes, parts: dict[str, torch.Tensor]) -> bytes:
        from safetensors.torch import save

        tensors = {n: t.detach().contiguous().cpu() for n, t in parts.items()}
        meta = {"magic": MAGIC, "key": key.hex(), "layout": self.layout, "crc32": str(checksum(tensors))}
        return save(tensors, metadata=meta)

    def put_bytes(self, key: bytes, data: bytes) -> int:
        """Store an encoded entry (:meth:`encode`, or moved from another tier of the same layout)."""
        if len(data) > self.capacity:
            raise ValueError(f"an entry of {len(data)} bytes does not fit the {self.name} tier ({self.capacity} bytes)")
        final = self._file(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            f = open(tmp, "wb")
        except FileNotFoundError:  # its directory was removed (a tmpfs cleaned up under it): made again
            self.path.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")
        with f:
            f.write(data)
        _used_now(tmp)
        os.replace(tmp, final)  # atomic: readers see the whole entry or the one it replaced
        with self._lock:
            self.bytes_in += len(data)
            self._used += len(data)
            self._writes += 1
            full = self._used > self.capacity or self._writes >= max(self.rescan_every, self._entries // 16)
        if full:
            self.make_room(self.spill_to)
        return len(data)

    def get(self, key: bytes) -> dict[str, torch.Tensor] | None:
        """The parts stored under ``key``, bit for bit, or None: a miss, counted by why — ``absent`` (never
        written, or evicted), ``torn`` (not a whole entry), ``layout`` (another key or layout under this name),
        ``corrupt`` (its bytes changed). A bad entry is removed."""
        got = self.fetch(key)
        return None if got is None else got[0]

    def fetch(self, key: bytes) -> tuple[dict[str, torch.Tensor], bytes] | None:
        """:meth:`get`, with the entry's bytes as stored (to move it to another tier as it is)."""
        t0 = time.perf_counter()
        f = self._file(key)
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            self._miss("absent")
            return None
        parts = self._decode(key, data)
        if parts is None:
            return None
        try:
            _used_now(f)
        except FileNotFoundError:  # evicted meanwhile: what was read is still whole and checked
            pass
        with self._lock:
            self.hits += 1
            self.bytes_out += len(data)
            self.load_s += time.perf_counter() - t0
        return parts, data

    def check(self, key: bytes, data: bytes) -> dict[str, torch.Tensor] | None:
        """The parts of an entry that came from another node's tier (:meth:`fetch`'s bytes), checked as a read
        here is — key, layout, checksum — or None (a miss, counted by why)."""
        return self._decode(key, data, remove=False)

    def _decode(self, key: bytes, data: bytes, remove: bool = True) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load

        reason = None
        try:
            meta = _metadata(data)
            parts = load(data)
        except Exception:  # noqa: BLE001 — any malformed entry is a torn one
            reason = "torn"
        else:
            if meta.get("magic") != MAGIC or meta.get("key") != key.hex() or meta.get("layout") != self.layout:
                reason = "layout"
            elif meta.get("crc32") != str(checksum(parts)):
                reason = "corrupt"
        if reason is None:
            return parts
        self._miss(reason)
        if remove:
            self._remove(self._file(key))
        return None

    def _miss(self, reason: str) -> None:
        with self._lock:
            self.misses[reason] += 1

    def _remove(self, f: Path) -> int:
        try:
            size = f.stat().st_size
            f.unlink()
        except FileNotFoundError:
            return 0
        with self._lock:
            self._used -= size
        return size

    # ---- size -----------------------------------------------------------------------------------
    def _scan(self, order: bool = True) -> tuple[list[tuple[int, int, str]], int]:
        """(mtime_ns, size, path) of every entry, oldest first (none with ``order`` False), and their total
        bytes. Paths stay strings: making a ``Path`` of each took three quarters of a scan."""
        out, total, n = [], 0, 0
        with os.scandir(self.path) as it:
            for e in it:
                if e.name.endswith(_SUFFIX):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    total, n = total + st.st_size, n + 1
                    if order:
                        out.append((st.st_mtime_ns, st.st_size, e.path))
        out.sort()
        with self._lock:
            self._entries, self._writes = n, 0
        return out, total

    def make_room(self, evicted=None) -> int:
        """Evict the least recently used entries until the tier fits — down to its low-water mark once it is over
        (under the directory's lock: one process at a time); ``evicted(path)`` sees each one before it goes (a
        lower tier takes it). Returns how many."""
        with open(self.path / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries, used = self._scan()
                target = self.low_water if used > self.capacity else self.capacity
                n = 0
                for _, size, f in entries:
                    if used <= target:
                        break
                    if evicted is not None:
                        evicted(Path(f))
                    try:
                        os.unlink(f)
                    except FileNotFoundError:
                        pass
                    used -= size
                    n += 1
                with self._lock:
                    self._used, self.evictions = used, self.evictions + n
                return n
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def used_bytes(self) -> int:
        return self._scan(order=False)[1]

    def status(self) -> dict:
        with self._lock:
            return {"tier": self.name, "path": str(self.path), "capacity_bytes": self.capacity,
                    "used_bytes": self._used, "hits": self.hits, "misses": dict(self.misses),
                    "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "evictions": self.evictions,
                    "load_s": self.load_s}


def _used_now(f: Path) -> None:
    """Record a use of ``f`` as its modification time: the LRU order. Set from the nanosecond clock, as the
    kernel's own file times tick only every few milliseconds (ties would evict in name order)."""
    now = time.time_ns()
    os.utime(f, ns=(now, now))


def _metadata(data: bytes) -> dict:
    """A safetensors file's ``__metadata__`` (its header: 8 bytes of length, then JSON)."""
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("header past the end")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


class Tiers:
    """The node tier over an optional disk tier: the node tier's evictions move down, a lower hit moves up."""

    def __init__(self, node: Tier, disk: Tier | None = None):
        if disk is not None and disk.layout != node.layout:
            raise ValueError("the node and disk tiers must hold one layout")
        self.node, self.disk = node, disk
        self.levels = [node] + ([disk] if disk is not None else [])
        if disk is not None:
            node.spill_to = self._spill

    def put(self, key: bytes, parts: dict[str, torch.Tensor]) -> None:
        """A new entry (write-through): into the node tier; a disk copy of the key is dropped (it may hold other
        bits — the same tokens computed in another batch — and the node tier's copy is the one to keep)."""
        self.node.put(key, parts)
        if self.disk is not None:
            self.disk._remove(self.disk._file(key))

    def put_entry(self, key: bytes, data: bytes) -> None:
        """:meth:`put` of an entry as stored (one another node's tier sent: :meth:`fetch`)."""
        self.node.put_bytes(key, data)
        if self.disk is not None:
            self.disk._remove(self.disk._file(key))

    def _spill(self, f: Path) -> None:
        """A node-tier entry on its way out: copied whole to the disk tier (its key is in its metadata) — unless
        the disk tier holds it already (it was promoted from there: a new write of the key drops the disk's copy),
        which then counts as a use of it there."""
        try:
            data = f.read_bytes()
            key = bytes.fromhex(_metadata(data)["key"])
        except Exception:  # noqa: BLE001 — a torn entry is dropped, not moved
            return
        below = self.disk._file(key)
        try:
            if below.stat().st_size == len(data):
                _used_now(below)  # (whole or not, its read checks it: a bad copy is a miss, then gone)
                return
        except FileNotFoundError:
            pass
        if len(data) <= self.disk.capacity:
            self.disk.put_bytes(key, data)

    def get(self, key: bytes) -> dict[str, torch.Tensor] | None:
        """The entry from the highest tier that holds it whole (a lower hit is promoted), or None."""
        got = self.fetch(key)
        return None if got is None else got[0]

    def fetch(self, key: bytes) -> tuple[dict[str, torch.Tensor], bytes] | None:
        """:meth:`get`, with the entry's bytes as stored (to send to another node's tier)."""
        got = self.node.fetch(key)
        if got is not None or self.disk is None:
            return got
        got = self.disk.fetch(key)
        if got is not None:
            self.node.put_bytes(key, got[1])
        return got

    def __contains__(self, key: bytes) -> bool:
        return any(key in t for t in self.levels)

    def names(self, limit: int) -> list[str]:
        """The names of the entries the tiers hold, the node tier's first, each most recently used first."""
        out = self.node.names(limit)
        return out + (self.disk.names(limit - len(out)) if self.disk is not None else [])

    def status(self) -> list[dict]:
        return [t.status() for t in self.levels]


def entry_name(layout: str, key: bytes) -> str:
    """The file name (less its suffix) of ``key``'s entry in a tier of ``layout``: a digest of both (the engine's
    index of what each node's tier holds keeps these)."""
    return hashlib.blake2b(layout.encode() + key, digest_size=20).hexdigest()


def block_key(h: bytes) -> bytes:
    """A block's entry key: its chained prefix hash (salted, as the prefix cache's)."""
    return b"B" + h


def snapshot_key(h: bytes) -> bytes:
    """A KDA snapshot's entry key: the chained hash of the block ending at its boundary."""
    return b"S" + h


def tier_key(kind: str, h: bytes) -> bytes:
    """The entry key of a "block" or a "snapshot" registered under prefix hash ``h``."""
    return block_key(h) if kind == "block" else snapshot_key(h)


NODE = "{node}"  # in a tier's directory: this node's address (a directory per node on a shared file system)


def node_dir(path: str, node: str | None) -> Path:
    """``path`` with :data:`NODE` replaced by ``node`` (this node's address), as the tier's actors open it."""
    if NODE in path and not node:
        raise ValueError(f"the KV tier's directory {path!r} names {NODE}, and this process knows no node address")
    return Path(path.replace(NODE, node or ""))


def open_tiers(spec: dict, node: str | None = None) -> Tiers:
    """The tiers of ``spec`` (cluster/kv_transfer.py ``tier_spec``: directories, sizes, the cache's layout digest)
    on node ``node`` (its address, for a directory naming :data:`NODE`): each a folder per layout under its
    directory (so the size bound is per layout)."""
    sub = spec["layout"]
    tier = Tier(node_dir(spec["path"], node) / sub, spec["bytes"], sub, name="node")
    disk = Tier(node_dir(spec["disk"], node) / sub, spec["disk_bytes"], sub, name="disk") if spec.get("disk") else None
    return Tiers(tier, disk)
