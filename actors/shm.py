"""Shared-memory links for the expert exchange between two processes on one node.

A loopback TCP message costs two system calls, two copies through the kernel and the receiver's
wake-up: at one token an MoE layer's exchange took ~0.9 ms between two colocated workers, about 50x
what copying its bytes costs. Between processes on one node the exchange can skip the kernel: two
rings in one shared segment, one per direction, each a byte stream exactly like the socket's.

* :class:`ShmStream` is socket-shaped (``recv_into``, ``sendmsg``, ``sendall``, ``shutdown``,
  ``close``): :class:`actors.wire.Link` drives it unchanged, so frames, call numbers, posted
  receives, the sender thread, a broken link and every error text are the socket's.
* The link's TCP connection stays: after the upgrade it carries only one-byte doorbells (a reader
  that stopped spinning sleeps in ``poll`` on it) and the peer's end (a killed or closed peer's
  socket closes, so its readers fail at once, never at the timeout).
* A reader spins briefly (:data:`SPIN_S`) on the ring's head, then sleeps in ``poll`` with a short
  cap (a doorbell lost to a store/load race costs at most the cap); a writer whose ring is full
  sleeps with back-off until the reader frees space, the peer goes or the timeout passes. Messages
  larger than a ring stream through it.
* :func:`upgrade` runs over an epoch's freshly made mesh (after its token handshake): each pair
  whose two ends report the same node key gets a segment, created by the accepting end, named only
  over the authenticated link, mapped by both and unlinked at once (no name outlives the handshake;
  the memory lives as the two mappings). A pair whose segment cannot be made or opened keeps TCP.

Memory order: head and tail are aligned 8-byte words each written by one side; on x86-64 (TSO)
stores are seen in order, so a reader that sees the new head sees the bytes before it. Other
machines keep TCP (:func:`node_key` answers None).

Owns: the rings, their segments and doorbells. Never: numbers or orders messages (:class:`Link`
does), or decides which pairs share a node (the caller's node key does).
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import platform
import secrets
import select
import socket
import threading
import time

from .mailbox import Mailbox, box_size

SHM_DIR = "/dev/shm"
PREFIX = "moeray-x-"
MAGIC = b"moeray-r"
VERSION = 3  # 3: the mailboxes' wake-up words (actors/mailbox.py)
PAGE = 4096
RING_BYTES = 2 << 20  # data bytes per direction (whole pages; the tests pass smaller rings to upgrade())
SPIN_S = 50e-6  # a reader's spin before it sleeps
SLEEP_CAP_S = 0.002  # a sleeping reader's longest poll (a lost doorbell's cost)
SETUP = -1  # the call number of the upgrade's handshake frames
_HEAD, _TAIL, _SLEEPING = 0, 64, 128  # offsets in a ring's control page
_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR | select.POLLNVAL
# A full barrier between a store and the load after it (x86 may let the load pass the store): a reader
# going to sleep stores its flag and loads the head, a writer stores the head and loads the flag; without
# it both can see the old values and the reader sleeps its cap with the data there. A lock's atomic
# instruction is such a barrier.
_FENCE = threading.Lock()


def _fence() -> None:
    with _FENCE:
        pass


def node_key() -> str | None:
    """Which node this process is on, for pairing: its Ray node's id, else this host's boot id; None
    where shared memory is not used (not x86-64, or no /dev/shm; ``transport: socket`` turns it off)."""
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.isdir(SHM_DIR):
        return None
    try:
        import ray

        if ray.is_initialized():
            return "ray:" + ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "host:" + f.read().strip()
    except OSError:
        return None


class _Ring:
    """One direction: a control page (head, tail, reader-sleeping) and ``size`` data bytes."""

    def __init__(self, mm: mmap.mmap, offset: int, size: int):
        self.size = size
        self.head = ctypes.c_uint64.from_buffer(mm, offset + _HEAD)  # bytes written, ever (the writer's)
        self.tail = ctypes.c_uint64.from_buffer(mm, offset + _TAIL)  # bytes read, ever (the reader's)
        self.sleeping = ctypes.c_uint64.from_buffer(mm, offset + _SLEEPING)
        self.data = memoryview(mm)[offset + PAGE:offset + PAGE + size]

    def write(self, parts: list[memoryview]) -> int:
        """Copy as much of ``parts`` (in order) as fits; publish it; return the bytes written."""
        head = self.head.value
        free = self.size - (head - self.tail.value)
        wrote = 0
        for p in parts:
            while free and len(p):
                at = (head + wrote) % self.size
                k = min(free, len(p), self.size - at)
                self.data[at:at + k] = p[:k]
                p, wrote, free = p[k:], wrote + k, free - k
            if len(p):
                break
        if wrote:
            self.head.value = head + wrote
        return wrote

    def read(self, view: memoryview) -> int:
        """Copy what is there, up to ``view``'s size; free it; return the bytes read."""
        tail = self.tail.value
        n = min(self.head.value - tail, len(view))
        got = 0
        while got < n:
            at = (tail + got) % self.size
            k = min(n - got, self.size - at)
            view[got:got + k] = self.data[at:at + k]
            got += k
        if got:
            self.tail.value = tail + got
        return got


def _size(ring_bytes: int, box_bytes: int = 0) -> int:
    """A segment's bytes: a header page, two rings, and (``box_bytes``) two mailboxes (actors/mailbox.py)."""
    return PAGE + 2 * (PAGE + ring_bytes) + (2 * box_size(box_bytes) if box_bytes else 0)


class ShmStream:
    """A socket-shaped byte stream over a segment's two rings (``inbound`` read here, ``outbound``
    written here), with ``raw`` (the link's TCP socket) for doorbells and the peer's end."""

    def __init__(self, mm: mmap.mmap, raw: socket.socket, *, acceptor: bool, timeout_s: float | None):
        size = int.from_bytes(mm[16:24], "little")
        rings = [_Ring(mm, PAGE, size), _Ring(mm, 2 * PAGE + size, size)]
        # ring 0 carries acceptor -> connector, ring 1 connector -> acceptor
        self.outbound, self.inbound = (rings[0], rings[1]) if acceptor else (rings[1], rings[0])
        self.mm, self.raw, self.timeout_s = mm, raw, timeout_s or None  # 0: none, as Link's
        self.closed = False
        self.peer_gone = False
        self._poll = select.poll()
        self._poll.register(raw, select.POLLIN | _GONE)

    # ---- the socket's surface, as actors.wire.Link and actors.framing use it ------------
    def recv_into(self, view: memoryview, n: int) -> int:
        """Up to ``n`` bytes into ``view``; 0 once the peer is gone (or this end closed) and nothing is
        left; BlockingIOError after ``timeout_s`` without a byte (as SO_RCVTIMEO)."""
        view = memoryview(view).cast("B")[:n]
        start = time.monotonic()
        ring = self.inbound
        while True:
            if self.closed:
                return 0
            k = ring.read(view)
            if k:
                return k
            if self.peer_gone:
                return ring.read(view)  # what it wrote before it went, then the end
            spin_until = time.monotonic() + SPIN_S
            while time.monotonic() < spin_until and ring.head.value == ring.tail.value and not self.closed:
                pass
            if ring.head.value != ring.tail.value:
                continue
            ring.sleeping.value = 1
            _fence()
            try:
                if ring.head.value != ring.tail.value:
                    continue
                left = None if self.timeout_s is None else start + self.timeout_s - time.monotonic()
                if left is not None and left <= 0:
                    raise BlockingIOError("no bytes within the timeout")
                wait = SLEEP_CAP_S if left is None else min(SLEEP_CAP_S, left)
                for _fd, ev in self._poll.poll(wait * 1000):
                    self._doorbells(ev)
            finally:
                ring.sleeping.value = 0

    def _doorbells(self, events: int) -> None:
        """Drain the doorbells; note the peer's end."""
        if events & select.POLLIN:
            try:
                while True:
                    got = self.raw.recv(4096, socket.MSG_DONTWAIT)
                    if not got:
                        self.peer_gone = True
                        return
                    if len(got) < 4096:
                        break
            except BlockingIOError:
                pass
            except OSError:
                self.peer_gone = True
                return
        if events & _GONE:
            self.peer_gone = True

    def sendmsg(self, parts, _ancillary=(), _flags: int = 0) -> int:
        """Write what fits now (never waits); BlockingIOError when nothing fits."""
        if self.closed:
            raise BrokenPipeError("the exchange's shared-memory link is closed")
        wrote = self.outbound.write([memoryview(p).cast("B") for p in parts])
        if not wrote:
            raise BlockingIOError("the ring is full")
        self._ring()
        return wrote

    def sendall(self, data) -> None:
        """Write all of ``data``, waiting for the reader to free space (the sender thread's call)."""
        rest = [memoryview(data).cast("B")]
        pause, last = 20e-6, time.monotonic()
        while len(rest[0]):
            if self.closed:
                raise ConnectionError("the exchange's sockets were closed")
            wrote = self.outbound.write(rest)
            if wrote:
                rest = [rest[0][wrote:]]
                self._ring()
                pause, last = 20e-6, time.monotonic()
                continue
            if self._gone_now():
                raise BrokenPipeError("the peer closed its end of the shared-memory link")
            if self.timeout_s is not None and time.monotonic() - last > self.timeout_s:
                raise TimeoutError(f"the peer read nothing for {self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 500e-6)

    def _ring(self) -> None:
        _fence()
        if self.outbound.sleeping.value:
            try:
                self.raw.send(b"\x01", socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                pass  # a full doorbell socket has a wake-up in it already; a closed one: the reader sees the end

    def _gone_now(self) -> bool:
        p = select.poll()
        p.register(self.raw, _GONE)
        return bool(p.poll(0))

    def shutdown(self, how: int) -> None:
        self.closed = True
        self.raw.shutdown(how)

    def close(self) -> None:
        self.closed = True
        self.raw.close()  # the mapping goes with the last reference (a copy in flight keeps it)


# ---- segments ------------------------------------------------------------------------------
def _create(ring_bytes: int, box_bytes: int = 0) -> tuple[str, mmap.mmap]:
    ring_bytes = max(PAGE, -(-ring_bytes // PAGE) * PAGE)  # whole pages: the control words stay aligned
    box_bytes = -(-box_bytes // PAGE) * PAGE
    sweep()
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, _size(ring_bytes, box_bytes))  # /dev/shm full: fails here, never a SIGBUS later
        mm = mmap.mmap(fd, _size(ring_bytes, box_bytes))
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise
    os.close(fd)
    mm[:8] = MAGIC
    mm[8:16] = VERSION.to_bytes(8, "little")
    mm[16:24] = ring_bytes.to_bytes(8, "little")
    mm[24:32] = box_bytes.to_bytes(8, "little")
    return name, mm


def _open(name: str) -> mmap.mmap:
    if not (name.startswith(PREFIX) and "/" not in name):
        raise ValueError(f"not an exchange segment: {name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        _unlink(name)
    if mm[:8] != MAGIC or int.from_bytes(mm[8:16], "little") != VERSION or \
            _size(int.from_bytes(mm[16:24], "little"), int.from_bytes(mm[24:32], "little")) != size:
        raise ValueError(f"segment {name} is not a version-{VERSION} exchange segment")
    return mm


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def sweep() -> None:
    """Unlink this user's segments whose creator is dead (a creator killed between making one and its
    handshake's end leaves the name behind)."""
    for path in glob.glob(os.path.join(SHM_DIR, PREFIX + "*")):
        try:
            pid = int(os.path.basename(path)[len(PREFIX):].split("-")[0])
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (ValueError, OSError):
            continue


def upgrade(mesh, key: str | None, ring_bytes: int = RING_BYTES, *, rings: bool = True, box_bytes: int = 0) -> int:
    """Give every link of ``mesh`` whose two ends share ``key`` (:func:`node_key`) a shared-memory
    segment; the others keep TCP. With ``rings`` the link's stream moves into it (:class:`ShmStream`);
    with ``box_bytes`` the link also gets mailboxes of that many bytes each way (``link.box``,
    :mod:`actors.mailbox`; without rings the stream stays on TCP beside them). Every rank of the epoch
    calls it right after making the mesh, with the same arguments; returns the links upgraded. Each
    step only waits on what the other end sent before its own first wait, so the handshake has no
    cycle: connectors send their key; acceptors answer a segment's name (or nothing); connectors open
    it and acknowledge; acceptors read the acknowledgements."""
    mine = (key or "").encode()
    ring_bytes = ring_bytes if rings else PAGE
    for peer in mesh.connected:
        mesh.links[peer].send_bytes(SETUP, mine).wait()
    made: dict[int, tuple[str, mmap.mmap]] = {}
    try:
        for peer in sorted(mesh.accepted):
            link = mesh.links[peer]
            theirs = _setup_frame(link)
            name = b""
            if key and theirs == mine:
                try:
                    made[peer] = _create(ring_bytes, box_bytes)
                    name = made[peer][0].encode()
                except OSError:
                    pass  # no room in /dev/shm: this pair keeps TCP
            link.send_bytes(SETUP, name).wait()
        upgraded = 0
        for peer in mesh.connected:
            link = mesh.links[peer]
            name = _setup_frame(link).decode()
            if not name:  # another node (or no room there): nothing to acknowledge
                continue
            try:
                mm = _open(name)
            except (OSError, ValueError):
                mm = None
            link.send_bytes(SETUP, b"\x01" if mm is not None else b"\x00").wait()
            if mm is not None:
                _attach(link, mm, acceptor=False, rings=rings)
                upgraded += 1
        for peer, (name, mm) in made.items():
            link = mesh.links[peer]
            ok = _setup_frame(link) == b"\x01"
            _unlink(name)
            if ok:
                _attach(link, mm, acceptor=True, rings=rings)
                upgraded += 1
        return upgraded
    finally:
        for name, _mm in made.values():
            _unlink(name)


def _attach(link, mm: mmap.mmap, *, acceptor: bool, rings: bool) -> None:
    """Move ``link`` onto its segment ``mm``: its stream into the rings (``rings``), its mailboxes
    (when the segment has them) beside it."""
    raw = link.sock
    ring_bytes, box_bytes = int.from_bytes(mm[16:24], "little"), int.from_bytes(mm[24:32], "little")
    if box_bytes:
        link.box = Mailbox(mm, PAGE + 2 * (PAGE + ring_bytes), box_bytes, acceptor=acceptor, raw=raw,
                           label=link.label, timeout_s=link.timeout_s, fence=_fence)
    if rings:
        link.sock = ShmStream(mm, raw, acceptor=acceptor, timeout_s=link.timeout_s)


def _setup_frame(link) -> bytes:
    call, data = link.read_frame()
    if call != SETUP:
        raise ConnectionError(f"{link.label} sent call {call} during the shared-memory handshake")
    return bytes(data)
