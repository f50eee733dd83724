"""Mailboxes: the slots a decode step's expert exchange is written into between two processes on one node.

The links (:mod:`actors.wire`, and their shared-memory rings, :mod:`actors.shm`) carry numbered frames
through a byte stream: a frame header, a sender thread when the socket is full, a reader that matches
each frame to its posted receive. At a decode step's sizes that machinery is most of an MoE layer's
exchange (~0.13 ms of two messages each way where a memcpy of their bytes takes 0.5 µs;
bench/bench_exchange.py). A mailbox is the least that can carry the same rows: per direction,
:data:`SLOTS` fixed slots of bytes, each with a word the writer sets after its bytes (the message's
number). The writer copies the tensors into a slot and publishes the word; the reader spins on the word,
then reads the tensors in place. No frame, no thread, no system call on the way: a round trip between
two spinning processes costs microseconds.

Which slot a message takes: the n-th message written one way over the pair's life takes slot
``n % SLOTS``, and its word carries n, the step and the message's number in the step (:func:`word`).
The two ends send the same messages in the same order (actors/board.py), so a reader knows n from
its own count and the word it waits for: a slot's old message never passes for a new one, and two
ends that disagree (a step that failed on one of them) wait, time out and fail, never read the wrong
rows. The caller's exchange order keeps a slot from being
overwritten before its reader is done with it (actors/board.py: the dispatch and combine of every
exchange, every worker waiting for every peer's).

Waits: a reader spins :data:`SPIN_S`, then naps :data:`NAP_S` between looks (the GIL and the core go
to whoever needs them), and every :data:`CHECK_S` it checks the peer's end (the link's TCP
socket: a killed peer's closes, so a wait fails within a millisecond, never at the timeout) and the
link's timeout (a stopped peer fails the wait at the group's timeout, as on the links). After any
failure the mailbox is broken: every later use raises (the engine regroups; a new epoch makes new
segments).

Memory order: the data is written before the word, and a full barrier (a lock's atomic instruction,
as :mod:`actors.shm`'s rings use) sits between them; x86-64 keeps the reader's loads in order. Other
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
SPIN_S = 50e-6  # a waiting reader spins this long, then naps between looks
NAP_S = 20e-6  # a waiting reader's sleep between looks after its spin
PR_SET_TIMERSLACK = 29  # prctl(2)
CHECK_S = 1e-3  # how often a waiting reader checks the peer's end and the timeout
ALIGN = 64  # each tensor of a message starts at a multiple of this (any dtype's view of it is aligned)
PAGE = 4096
_GONE = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR | select.POLLNVAL


_napping = threading.local()


def _nap() -> None:
    """Sleep :data:`NAP_S`, with this thread's timer slack cut to a microsecond first (Linux lets a
    sleep run 50 µs late by default): a waiting reader gives up its core between looks — on a few
    cores busy with other processes, spinning on one took it from them (served at 16 streams: half
    the tokens/s) — and still sees the word within tens of microseconds."""
    if not getattr(_napping, "slack", False):
        _napping.slack = True
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: the default slack
    time.sleep(NAP_S)


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
    """One direction: :data:`SLOTS` words (each on its own cache line) and slots."""

    def __init__(self, mm: mmap.mmap, offset: int, box_bytes: int):
        self.slot_bytes = (box_bytes // SLOTS) // ALIGN * ALIGN
        self.words = [ctypes.c_uint64.from_buffer(mm, offset + 64 * i) for i in range(SLOTS)]
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
        self._fence()  # the bytes before the word (a lock's atomic instruction is a full barrier)
        self.out.words[self.sent % SLOTS].value = word(self.sent, step, i)
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
        self._check()
        w, want = self.inbox.words[n % SLOTS], word(n, step, i)
        if w.value == want:
            return
        start = time.monotonic()
        spin_until, check_at = start + SPIN_S, start + CHECK_S
        while w.value != want:
            now = time.monotonic()
            if now < spin_until:
                continue
            _nap()  # the core and the GIL go to whoever needs them (the engine, the HTTP path, a peer)
            if now >= check_at:
                check_at = now + CHECK_S
                if self._poll.poll(0):
                    self._fail(MailboxBroken(f"{self.label} is gone (its end of the link closed)"))
                if self.timeout_s is not None and now - start > self.timeout_s:
                    self._fail(TimeoutError(f"{self.label} wrote nothing for {self.timeout_s:g} s"))

    def _fail(self, e: Exception) -> None:
        self.broken = e
        raise e

    def _check(self) -> None:
        if self.broken is not None:
            raise MailboxBroken(f"the mailbox to {self.label} failed earlier: {self.broken}")
