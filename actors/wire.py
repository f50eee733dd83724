"""Direct sockets for the expert exchange on CPU: one TCP connection per (attention rank, expert actor).

gloo's point-to-point ops hand every message to its device thread and back: on these machines a
16 KiB send and receive each way took 0.16-0.46 ms over runs (``bench_overhead``'s p2p floor),
against about 0.025 ms for the same bytes over a plain loopback socket written and read by the
calling thread.
An MoE layer makes two such exchanges per step, so on gloo groups the exchange runs here instead:

* :class:`SocketMesh` is one epoch's connections, made through the epoch's rendezvous store right
  after the process group (each expert actor listens on its node's address, every attention rank
  connects to each with the epoch's token in its hello). The group itself stays: it is the epoch's
  membership, and NCCL groups keep ``all_to_all_single``.
* A send is written by the calling thread when the socket takes it whole (the common case); what the
  kernel does not take goes to the link's sender thread, in order, so a large send never blocks the
  caller while its peer is blocked sending too (ping-pong's crossing exchanges, every colocated
  exchange). Its wait does block until the rest has left: a caller that sends and receives on a
  link waits for its receives first (actors/dispatch.py ``_P2P``), or two peers each waiting on a
  send larger than the socket buffers would wait for ever on each other.
* Receives complete in the order they were posted on a link. Each message carries its call number
  and size, so a desynchronised peer is an error naming both, never misread bytes.
* Every wait has the group's timeout (the sockets' SO_RCVTIMEO / SO_SNDTIMEO); a closed peer raises at
  once instead of at the timeout.

Owns: one epoch's links, their sender threads and posted receives. Never: lays out frames or
handshakes itself (:mod:`actors.framing` does, for the step channel too), or takes a connection
without the epoch's token.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time

import torch

from .framing import Acceptor, check_token, connect, frame_header, read_exactly, read_frame, read_header

_MAGIC = b"moeray-x"  # the mesh's handshake (actors/framing.py): this, the attention rank, the epoch's token


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (shared, not copied)."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


class _Done:
    """A send the calling thread wrote whole."""

    def wait(self) -> None:
        pass


DONE = _Done()


class _Queued:
    """A send (or its rest) waiting for the link's sender thread."""

    def __init__(self, link: "Link", parts: list[memoryview]):
        self.link, self.parts, self.done, self.error = link, parts, threading.Event(), None

    def wait(self) -> None:
        if not self.done.wait(self.link.timeout_s):
            raise TimeoutError(f"a send to {self.link.label} did not leave within {self.link.timeout_s:g} s")
        if self.error is not None:
            raise ConnectionError(f"sending to {self.link.label}: {self.error}") from self.error


class _Recv:
    """A posted receive of ``view``'s size, for call ``call``."""

    def __init__(self, link: "Link", call: int, view: memoryview):
        self.link, self.call, self.view, self.done = link, call, view, False

    def wait(self) -> None:
        self.link.complete(self)


def _fail(works: list[_Queued], error: Exception) -> None:
    """End queued sends that will never leave: their waits raise ``error``."""
    for w in works:
        w.error = error
        w.done.set()


class Link:
    """One connected socket to ``peer`` (named ``label`` in errors: "rank 3", "expert[1]"). Every
    read and write has ``timeout_s`` (None: none, for a side that may wait for ever)."""

    def __init__(self, sock: socket.socket, peer: int | str, timeout_s: float | None, label: str | None = None):
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = timeout_s or 0  # 0: no timeout
        tv = struct.pack("ll", int(t), int((t % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s
        self.label = label or f"rank {peer}"
        self.posted: collections.deque[_Recv] = collections.deque()
        self.queue: collections.deque[_Queued] = collections.deque()
        self.cv = threading.Condition()
        self.sender: threading.Thread | None = None
        self.closed = False
        self.broken: OSError | None = None  # the error that left the stream at an unknown point (either way)
        self.box = None  # its mailboxes (actors/mailbox.py), where the two ends share a node (actors/shm.py)

    # ---- sending ------------------------------------------------------------------------
    def send(self, call: int, t: torch.Tensor):
        return self.send_bytes(call, _bytes(t))

    def send_bytes(self, call: int, data: bytes | memoryview):
        """Send ``data`` as call ``call``; returns a work to wait for (never blocks on a full socket)."""
        parts = [memoryview(frame_header(call, len(data))), memoryview(data)]
        with self.cv:
            if self.broken is not None:
                raise ConnectionError(f"the link to {self.label} failed earlier: {self.broken}")
            if not self.queue:  # nothing ahead of it: try to write it whole, now, from this thread
                try:
                    sent = self.sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                parts = _rest(parts, sent)
                if not parts:
                    return DONE
            work = _Queued(self, parts)
            self.queue.append(work)
            if self.sender is None:
                self.sender = threading.Thread(target=self._send_loop, name=f"moeray-send-{self.peer}", daemon=True)
                self.sender.start()
            self.cv.notify()
            return work

    def _send_loop(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.closed:
                    self.cv.wait()
                if self.closed:
                    failed, self.queue = list(self.queue), collections.deque()
                    _fail(failed, ConnectionError("the exchange's sockets were closed"))
                    return
                work = self.queue[0]
            try:
                for part in work.parts:
                    self.sock.sendall(part)
            except OSError as e:  # part of a message may have left: the stream is unusable, for both ends
                with self.cv:
                    self.broken = self.broken or e
                    failed, self.queue = list(self.queue), collections.deque()
                _fail(failed, e)
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)  # the peer sees the link close, never half a message
                except OSError:
                    pass
                return
            with self.cv:
                self.queue.popleft()
            work.done.set()

    # ---- receiving ----------------------------------------------------------------------
    def post(self, call: int, t: torch.Tensor) -> _Recv:
        if not t.is_contiguous():
            raise ValueError("a receive needs a contiguous tensor (its bytes are written in place)")
        r = _Recv(self, call, _bytes(t))
        self.posted.append(r)
        return r

    def complete(self, want: _Recv) -> None:
        """Read the posted receives in order, up to and including ``want``. After a failure the link
        is broken: its stream position is unknown, so every later wait raises the same error (the
        engine regroups: a new epoch makes new links)."""
        if self.broken is not None:
            raise ConnectionError(f"the link to {self.label} failed earlier: {self.broken}")
        try:
            while not want.done:
                r = self.posted[0]
                call, size = read_header(self.sock, self.label, self.timeout_s)
                if (call, size) != (r.call, len(r.view)):
                    raise ConnectionError(f"{self.label} sent call {call} of {size} bytes where call {r.call} "
                                          f"of {len(r.view)} bytes was due (the two sides' exchanges differ)")
                read_exactly(self.sock, r.view, self.label, self.timeout_s)
                r.done = True
                self.posted.popleft()
        except OSError as e:
            self.broken = e
            raise

    def read_frame(self) -> tuple[int, bytearray]:
        """The next whole message of unknown size, (call number, bytes), for links that carry no
        posted receives (the engine's step channels); the socket's timeout applies to each read."""
        if self.broken is not None:
            raise ConnectionError(f"the link to {self.label} failed earlier: {self.broken}")
        try:
            return read_frame(self.sock, self.label, self.timeout_s)
        except OSError as e:
            self.broken = e
            raise

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _rest(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What of ``parts`` is left after their first ``sent`` bytes went."""
    out = []
    for p in parts:
        if sent >= len(p):
            sent -= len(p)
            continue
        out.append(p[sent:])
        sent = 0
    return out


def local_ip(toward: str) -> str:
    """This host's address on the route to ``toward`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return s.getsockname()[0]


class SocketMesh:
    """One epoch's links. Disaggregated: every attention rank (ranks below ``num_attention``) to every
    expert actor. ``colocated``: every worker to every other (each both sends and serves). A rank that
    accepts listens on its node; every connection carries the epoch's ``token`` in its hello, and any
    other (a stray, a process of another epoch) is closed and ignored while it waits for its peers."""

    def __init__(self, store, rank: int, num_attention: int, world: int, host: str, timeout_s: float, *,
                 token: bytes, prefix: str = "moeray/wire", colocated: bool = False,
                 connect_timeout_s: float | None = None):
        """``timeout_s``: each link's reads and writes; ``connect_timeout_s`` (default ``timeout_s``):
        finding and connecting every peer."""
        check_token(token, "the exchange's token")
        self.rank, self.links = rank, {}
        self.board = False  # every pair of the epoch has mailboxes (actors/group.py, actors/board.py)
        deadline = time.monotonic() + (timeout_s if connect_timeout_s is None else connect_timeout_s)
        if colocated:  # worker i connects to every lower rank and accepts every higher one
            connect_to, accept_from = range(rank), set(range(rank + 1, world))
        elif rank >= num_attention:  # expert actor: accept one connection per attention rank
            connect_to, accept_from = range(0), set(range(num_attention))
        else:  # attention rank: connect to each expert actor
            connect_to, accept_from = range(num_attention, world), set()
        # which links this rank opened and which it took (the shared-memory upgrade, actors/shm.py, asks)
        self.connected, self.accepted = list(connect_to), accept_from
        try:
            if accept_from:
                with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as srv:
                    port = srv.getsockname()[1]
                    store.set(f"{prefix}/{rank}", f"{srv.getsockname()[0]}:{port}")
                    self._connect(store, connect_to, prefix, token, deadline, timeout_s)
                    self._accept(Acceptor(srv, _MAGIC, token), accept_from, deadline, timeout_s)
            else:
                self._connect(store, connect_to, prefix, token, deadline, timeout_s)
        except BaseException:
            self.close()
            raise

    def _connect(self, store, peers, prefix: str, token: bytes, deadline: float, timeout_s: float) -> None:
        for peer in peers:
            host, port = store.get(f"{prefix}/{peer}").decode().rsplit(":", 1)
            sock = connect((host, int(port)), _MAGIC, self.rank, token, max(deadline - time.monotonic(), 0.001))
            self.links[peer] = Link(sock, peer, timeout_s)

    def _accept(self, acceptor: Acceptor, peers: set[int], deadline: float, timeout_s: float) -> None:
        """One link per rank of ``peers``, each from the first connection with the token that announces it."""
        try:
            while not peers <= set(self.links):
                passed = acceptor.accept(deadline)
                if passed is None:
                    missing = sorted(peers - set(self.links))
                    raise TimeoutError(f"rank {self.rank}: rank(s) {missing} did not connect within {timeout_s:g} s")
                sock, peer = passed
                if peer not in peers or peer in self.links:
                    sock.close()  # not one of this epoch's ranks that connect here: ignored
                    continue
                self.links[peer] = Link(sock, peer, timeout_s)
        finally:
            acceptor.close()

    def send(self, t: torch.Tensor, peer: int, tag: int):
        """Send ``t`` to rank ``peer`` as call ``tag`` of the step; returns a work to wait for."""
        return self.links[peer].send(tag, t)

    def recv(self, t: torch.Tensor, peer: int, tag: int):
        """Post a receive of ``t``'s size from rank ``peer`` (call ``tag``); returns a work to wait for."""
        return self.links[peer].post(tag, t)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}
