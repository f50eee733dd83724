"""The bytes on a connection, shared by the engine's step channel (:mod:`actors.channel`) and the
expert exchange's socket mesh (:mod:`actors.wire`).

Owns: the frame header (a call or step number, then the payload's size), exact reads into a
buffer, and the handshake every new connection passes before it is used: its transport's magic,
who connects (an attention rank on the mesh; the engine on a step channel) and a secret token (the
engine's per channel, the epoch's on the mesh), compared in constant time.
Never: numbers, orders or times a transport's messages (the step channel keeps its step numbers
and liveness checks, the mesh its call numbers, sender threads and posted receives), or keeps a
connection that failed its handshake.
"""

from __future__ import annotations

import hmac
import math
import select
import socket
import struct
import time

TOKEN_BYTES = 16  # the secret a connection's hello carries
HEADER = struct.Struct("<qq")  # a frame's first bytes: call or step number, payload bytes
MAX_FRAME = 1 << 31  # a frame of unknown size (read_frame) above this is a broken stream, not data
HELLO = struct.Struct(f"<8sq{TOKEN_BYTES}s")  # a new connection's first bytes: magic, identity, token


def check_token(token: bytes, what: str) -> None:
    """A ValueError naming ``what`` unless ``token`` is :data:`TOKEN_BYTES` bytes."""
    if not isinstance(token, bytes):
        raise ValueError(f"{what} must be bytes, got {type(token).__name__}")
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"{what} is {TOKEN_BYTES} bytes, got {len(token)}")


def readable(sock: socket.socket, timeout_s: float | None) -> bool:
    """``sock`` has data (or its end of file) within ``timeout_s`` (None: wait for ever). poll, not
    select: select cannot watch descriptors above 1023, which a long-lived process reaches."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))


# ---- frames ------------------------------------------------------------------------------
def frame_header(number: int, size: int) -> bytes:
    return HEADER.pack(number, size)


def read_exactly(sock: socket.socket, view: memoryview, peer: str, timeout_s: float | None) -> memoryview:
    """Fill ``view`` from ``sock`` (``peer`` names it in errors; ``timeout_s`` is the socket's
    SO_RCVTIMEO, for the error). Raises TimeoutError when the socket's timeout runs out,
    ConnectionError when the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError(f"{peer} sent nothing for {timeout_s or 0:g} s") from None
        if k == 0:
            raise ConnectionError(f"{peer} closed its connection")
        got += k
    return view


def read_header(sock: socket.socket, peer: str, timeout_s: float | None) -> tuple[int, int]:
    """The next frame's (number, payload bytes)."""
    return HEADER.unpack(read_exactly(sock, memoryview(bytearray(HEADER.size)), peer, timeout_s))


def read_frame(sock: socket.socket, peer: str, timeout_s: float | None) -> tuple[int, bytearray]:
    """The next whole frame of unknown size: (number, payload)."""
    number, size = read_header(sock, peer, timeout_s)
    if not 0 <= size <= MAX_FRAME:
        raise ConnectionError(f"{peer} announced a message of {size} bytes (the stream is broken)")
    data = bytearray(size)
    read_exactly(sock, memoryview(data), peer, timeout_s)
    return number, data


# ---- the handshake -------------------------------------------------------------------------
def hello(magic: bytes, identity: int, token: bytes) -> bytes:
    assert len(magic) == 8, f"a transport's magic is 8 bytes, got {magic!r}"
    return HELLO.pack(magic, identity, token)


def check_hello(data: bytes, magic: bytes, token: bytes) -> int | None:
    """The identity a whole hello announces, or None when its magic or token is not the expected one."""
    got_magic, identity, got_token = HELLO.unpack(data)
    if got_magic != magic or not hmac.compare_digest(got_token, token):
        return None
    return identity


def connect(address: tuple[str, int], magic: bytes, identity: int, token: bytes,
            timeout_s: float) -> socket.socket:
    """A connection to ``address`` that has sent its hello (``timeout_s`` for both); blocking, no
    timeout left on it."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.sendall(hello(magic, identity, token))
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


class Acceptor:
    """The connections to ``listener`` that pass the handshake (``magic``, ``token``). Every pending
    hello is read at once, so a stray that sends garbage, too little or nothing never holds up a
    real peer; one that fails is closed and the listener goes on. ``hello_timeout_s``: how long a
    connection may take to say its hello (None: until the caller's deadline)."""

    def __init__(self, listener: socket.socket, magic: bytes, token: bytes, hello_timeout_s: float | None = None):
        self.listener, self.magic, self.token, self.hello_timeout_s = listener, magic, token, hello_timeout_s
        self.pending: dict[int, tuple[socket.socket, bytes, float]] = {}  # fd → (socket, hello so far, give-up time)

    def accept(self, deadline: float) -> tuple[socket.socket, int] | None:
        """The next connection that passes, as (blocking socket, the identity it announced); None at
        ``deadline`` (monotonic). A closed listener raises (OSError or ValueError)."""
        while True:
            now = time.monotonic()
            for fd in [fd for fd, (_, _, give_up) in self.pending.items() if give_up <= now]:
                self._drop(fd)
            if now >= deadline:
                return None
            wait = min([deadline] + [give_up for _, _, give_up in self.pending.values()]) - now
            poll = select.poll()
            poll.register(self.listener, select.POLLIN)
            for fd in self.pending:
                poll.register(fd, select.POLLIN)
            for fd, _ in poll.poll(max(1, math.ceil(wait * 1000))):
                if fd in self.pending:
                    passed = self._read_hello(fd)
                    if passed is not None:
                        return passed
                else:
                    self._take()

    def _take(self) -> None:
        sock, _ = self.listener.accept()
        sock.setblocking(False)
        give_up = math.inf if self.hello_timeout_s is None else time.monotonic() + self.hello_timeout_s
        self.pending[sock.fileno()] = (sock, b"", give_up)

    def _read_hello(self, fd: int) -> tuple[socket.socket, int] | None:
        sock, data, give_up = self.pending[fd]
        try:
            chunk = sock.recv(HELLO.size - len(data))  # never past the hello: what follows is the peer's first frame
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:  # closed before its hello
            self._drop(fd)
            return None
        data += chunk
        if len(data) < HELLO.size:
            self.pending[fd] = (sock, data, give_up)
            return None
        del self.pending[fd]
        identity = check_hello(data, self.magic, self.token)
        if identity is None:
            sock.close()  # a stray: ignored
            return None
        sock.setblocking(True)
        return sock, identity

    def _drop(self, fd: int) -> None:
        sock, _, _ = self.pending.pop(fd)
        sock.close()

    def close(self) -> None:
        """Close the connections still saying their hello (never the listener)."""
        for fd in list(self.pending):
            self._drop(fd)
