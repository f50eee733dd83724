"""Mailboxes: the slots a decode step's expert exchange is written into between two processes on one node.

The links (:mod:`actors.wire`, and their shared-memory rings, :mod:`actors.shm`) carry numbered frames
through a byte stream: a frame header, a sender thread when the socket is full, a reader that matches
each frame to its posted receive. At a decode step's sizes that machinery is most of an MoE layer's
exchange (~0.13 ms of two messages each way where a memcpy of their bytes takes 0.5 µs;
bench/bench_exchange.py). A mailbox is the least that can carry the same rows: per direction,
:data:`SLOTS` fixed slots of bytes, each with a word the writer sets after its bytes (the message's
number). The writer copies the tensors into a slot and publishes the word; the reader spins on the word,
then reads the tensors in place. No frame, no thread, and a system call only to wake a reader that
went to sleep: a round trip between two spinning processes costs microseconds.

Which slot a message takes: the n-th message written one way over the pair's life takes slot
``n % SLOTS``, and its word carries n, the step and the message's number in the step (:func:`word`).
The two ends send the same messages in the same order (actors/board.py), so a reader knows n from
its own count and the word it waits for: a slot's old message never passes for a new one, and two
ends that disagree (a step that failed on one of them) wait, time out and fail, never read the wrong
rows. The caller's exchange order keeps a slot from being
overwritten before its reader is done with it (actors/board.py: the dispatch and combine of every
exchange, every worker waiting for every peer's).

Waits: a reader spins :data:`SPIN_S`, then sleeps on the box's wake-up word (a futex in the shared
segment: the writer wakes it after publishing, so a waiting reader takes no core — on a few cores
busy with other processes, one that kept looking took them from the engine, the HTTP path and the
peer it waited for), and every :data:`CHECK_S` of sleep it checks the peer's end (the link's TCP
socket: a killed peer's closes, so a wait fails within a millisecond, never at the timeout) and the
link's timeout (a stopped peer fails the wait at the group's timeout, as on the links). After any
failure the mailbox is broken: every later use raises (the engine regroups; a new epoch makes new
segments).

Memory order: the data is written before the word, and a full barrier (a lock's atomic instruction,
as :mod:`actors.shm`'s rings use) sits between them; x86-64 keeps the reader's loads in order. The
wake-up's protocol is in :meth:`Mailbox.wait`. Other
machines never get a mailbox (:func:`actors.shm.node_key`).

Owns: the slots of one pair of processes, one direction written here and one read here. Never: decides
what goes in a message or in which order (actors/board.py does), or which pairs share a node
(:func:`actors.shm.upgrade`).
"""

from __future__ import annotations

import ctypes
import mmap
import select
import threading
import time

import torch

SLOTS = 4  # messages in flight per direction (two exchanges of two messages: two micro-batches)
BOX_BYTES = 4 << 20  # data bytes per direction (SLOTS slots); a message larger than a slot takes the links
SPIN_S = 50e-6  # a waiting reader spins this long, then sleeps until the writer wakes it (futex)
PR_SET_TIMERSLACK = 29  # prctl(2)
CHECK_S = 1e-3  # how often a waiting reader checks the peer's end and the timeout
ALIGN = 64  # each tensor of a message starts at a multiple of this (any dtype's view of it is aligned)
PAGE = 4096
_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR | select.POLLNVAL


_libc = ctypes.CDLL(None, use_errno=True)
SYS_FUTEX = 202  # x86-64's futex(2): mailboxes exist only there (actors.shm.node_key)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in a segment two processes map
_slack = threading.local()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, expected: int, seconds: float) -> None:
    """Sleep until the 32-bit word at ``addr`` is woken (or no longer ``expected``, or ``seconds`` pass).
    ctypes lets go of the GIL for the call; the thread's timer slack is cut to a microsecond first (Linux
    lets a timed sleep run 50 µs late by default)."""
    if not getattr(_slack, "cut", False):
        _slack.cut = True
        _libc.prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    ts = _Timespec(0, int(seconds * 1e9))
    _libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, 1, None, None, 0)


def box_size(box_bytes: int) -> int:
    """Bytes one direction's mailbox takes in a segment: a page of words, then the slots."""
    return PAGE + box_bytes


def word(n: int, step: int, i: int) -> int:
    """The word of the ``n``-th message one way, message ``i`` of step ``step`` (never 0, the value before any)."""
    return ((n % (1 << 24)) << 40 | (step % (1 << 28)) << 12 | (i % (1 << 12))) + 1


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def message_bytes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes a message of tensors of these shapes and dtypes takes in a slot."""
    total = 0
    for shape, dtype in shapes:
        n = dtype.itemsize
        for d in shape:
            n *= d
        total += _aligned(n)
    return total


class _Box:
    """One direction: :data:`SLOTS` words (each on its own cache line), the wake-up word (a 32-bit count
    of messages written, which a sleeping reader waits on), the reader's sleeping flag, and the slots."""

    def __init__(self, mm: mmap.mmap, offset: int, box_bytes: int):
        self.slot_bytes = (box_bytes // SLOTS) // ALIGN * ALIGN
        self.words = [ctypes.c_uint64.from_buffer(mm, offset + 64 * i) for i in range(SLOTS)]
        self.wake = ctypes.c_uint32.from_buffer(mm, offset + 64 * SLOTS)
        self.wake_at = ctypes.addressof(self.wake)
        self.sleeping = ctypes.c_uint32.from_buffer(mm, offset + 64 * (SLOTS + 1))
        self.data = torch.frombuffer(mm, dtype=torch.uint8, count=SLOTS * self.slot_bytes, offset=offset + PAGE)
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, slot: int, at: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape`` and ``dtype`` at byte ``at`` of slot ``slot`` (a view: one op)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.data.view(dtype)
        stride, step = [], 1
        for d in reversed(shape):
            stride.append(step)
            step *= d
        return typed.as_strided(shape, stride[::-1], (slot * self.slot_bytes + at) // dtype.itemsize)


class MailboxBroken(ConnectionError):
    """A mailbox that failed once (a peer gone or stuck): every later use raises this."""


class Mailbox:
    """The mailboxes between this process and one peer: ``out`` written here, ``inbox`` read here;
    ``raw`` the link's TCP socket (the peer's end), ``timeout_s`` each wait's limit (None: none)."""

    def __init__(self, mm: mmap.mmap, offset: int, box_bytes: int, *, acceptor: bool, raw, label: str,
                 timeout_s: float | None, fence):
        boxes = [_Box(mm, offset, box_bytes), _Box(mm, offset + box_size(box_bytes), box_bytes)]
        # box 0 carries acceptor -> connector, box 1 connector -> acceptor (as the rings)
        self.out, self.inbox = (boxes[0], boxes[1]) if acceptor else (boxes[1], boxes[0])
        self.slot_bytes = self.out.slot_bytes
        self.raw, self.label, self.timeout_s, self._fence = raw, label, timeout_s or None, fence
        self.broken: Exception | None = None
        self.sent = 0  # messages written over the pair's life
        self._poll = select.poll()
        self._poll.register(raw, _GONE)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def put(self, step: int, i: int, tensors: list[torch.Tensor]) -> int:
        """Message ``i`` of step ``step``: copy ``tensors`` into the next slot, then publish it; returns n,
        its number over the pair's life."""
        self._check()
        slot, at = self.sent % SLOTS, 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if at + n > self.slot_bytes:
                raise ValueError(f"a message of {message_bytes([(tuple(x.shape), x.dtype) for x in tensors])} bytes "
                                 f"does not fit a mailbox slot of {self.slot_bytes} (check fits() first)")
            if n:
                self.out.tensor(slot, at, tuple(t.shape), t.dtype).copy_(t)
            at += _aligned(n)
        out = self.out
        self._fence()  # the bytes before the word (a lock's atomic instruction is a full barrier)
        out.words[self.sent % SLOTS].value = word(self.sent, step, i)
        out.wake.value = (out.wake.value + 1) & 0xFFFFFFFF
        self._fence()  # the word before the flag's load (see wait)
        if out.sleeping.value:
            _futex_wake(out.wake_at)
        self.sent += 1
        return self.sent - 1

    def get(self, n: int, step: int, i: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Wait for the peer's ``n``-th message, message ``i`` of step ``step``; its tensors as views of the
        slot (read them before this process's next message lets the peer write the slot again)."""
        self.wait(n, step, i)
        slot, at, out = n % SLOTS, 0, []
        for shape, dtype in shapes:
            out.append(self.inbox.tensor(slot, at, shape, dtype))
            at += message_bytes([(shape, dtype)])
        return out

    def wait(self, n: int, step: int, i: int) -> None:
        """Until the peer's ``n``-th message (message ``i`` of step ``step``) is there: a spin, then sleeps on
        the box's wake-up word. The reader reads the wake-up count, raises its flag, fences and looks at the
        word once more before it sleeps; the writer publishes the word, bumps the count, fences and wakes a
        flagged reader. So either the reader sees the word or the writer sees the flag (the fences order
        each side's store before its load), and a wake that comes before the sleep finds the count changed:
        no message is slept through. A sleep lasts at most :data:`CHECK_S`, when the peer's end and the
        timeout are checked."""
        self._check()
        box = self.inbox
        w, want = box.words[n % SLOTS], word(n, step, i)
        if w.value == want:
            return
        start = time.monotonic()
        spin_until = start + SPIN_S
        while w.value != want:
            now = time.monotonic()
            if now < spin_until:
                continue
            seen = box.wake.value
            box.sleeping.value = 1
            self._fence()
            try:
                if w.value == want:
                    return
                _futex_wait(box.wake_at, seen, CHECK_S)  # the core and the GIL go to whoever needs them
            finally:
                box.sleeping.value = 0
            if w.value == want:
                return
            if self._poll.poll(0):
                self._fail(MailboxBroken(f"{self.label} is gone (its end of the link closed)"))
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                self._fail(TimeoutError(f"{self.label} wrote nothing for {self.timeout_s:g} s"))

    def _fail(self, e: Exception) -> None:
        self.broken = e
        raise e

    def _check(self) -> None:
        if self.broken is not None:
            raise MailboxBroken(f"the mailbox to {self.label} failed earlier: {self.broken}")
