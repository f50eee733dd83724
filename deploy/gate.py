"""`moeray up`'s own listener on the serving port, in front of Serve's HTTP proxy, on a cluster of several
nodes it started (deploy/headwatch.py): with GCS fault tolerance it outlives the head node; without, it
answers 503 instead of the proxy's 500 once the cluster is going.

Serve's proxy runs on the head node; a head node that dies takes it along, and the proxy that Serve
starts on the new head answers before it is ready (for a moment every path is a 404, then a 500 while
its backend has no replica yet; its /-/healthz says so, but a client on this machine has no load
balancer asking it). So the gate relays each connection, byte for byte, straight to the ingress replica's
own HTTP server (Serve's direct ingress; the replica runs on a worker node and tells its address in
/health), which the head's loss does not touch: streams go on, new requests are served meanwhile. Where
that address is unknown or refuses (the replica was started again elsewhere) it relays to the proxy's
own port, and from the moment the head is found gone until the app answers /health through the new
proxy it holds those connections instead (up to ``hold_s``, then 503): a slower answer, not an error.
"""

from __future__ import annotations

import asyncio
import json
import threading

HOLD_S = 120.0  # a new connection waits this long for the app; then 503
CONNECT_S = 2.0  # a connection to the replica or the proxy (on this machine) that takes longer is refused
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 10\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


def unavailable_body(message: str) -> bytes:
    """A 503's body, in the OpenAI error shape the app's own errors have."""
    return json.dumps({"error": {"message": message, "type": "service_unavailable", "code": 503}}).encode()


class Gate:
    """Listens on (``host``, ``port``), relays to (``host``, ``backend_port``). :meth:`hold` and
    :meth:`release` are called from any thread."""

    def __init__(self, host: str, port: int, backend_port: int, *, hold_s: float = HOLD_S) -> None:
        self.host, self.port, self.backend_port, self.hold_s = host, port, backend_port, hold_s
        self.direct: tuple[str, int] | None = None
        self.doomed: str | None = None  # :meth:`doom`'s message
        self._clients: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._open.set()
        started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(started,), name="moeray-gate", daemon=True)
        self._thread.start()
        started.wait()
        if self._error is not None:
            raise self._error

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._relay, self.host, self.port, reuse_address=True))
        except BaseException as e:  # noqa: BLE001 — handed to the constructor's caller
            self._error = e
            started.set()
            return
        started.set()
        self._loop.run_forever()

    @property
    def holding(self) -> bool:
        return not self._open.is_set()

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def doom(self, message: str) -> None:
        """The cluster is going (its GCS stopped for good): a connection the ingress replica refuses is
        answered 503 with ``message`` instead of going to the proxy, whose answer for a backend that died
        is a 500. Called from any thread; a replica that still answers is still relayed to."""
        self.doomed = message

    def relay_to(self, address: tuple[str, int] | None) -> None:
        """Relay straight to ``address`` (the ingress replica's own HTTP server, behind Serve's direct
        ingress), past the proxy: what goes there does not pass the head node. None: through the proxy."""
        self.direct = address

    async def _backend(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the ingress replica if it is known and accepts, else to the proxy once the gate is
        open and the proxy accepts; None after hold_s."""
        direct = self.direct
        if direct is not None:
            try:
                return await asyncio.wait_for(asyncio.open_connection(*direct), CONNECT_S)
            except (OSError, asyncio.TimeoutError):  # the replica is gone (started again elsewhere): the proxy
                if self.direct == direct:
                    self.direct = None
        if self.doomed is not None:
            return None
        deadline = self._loop.time() + self.hold_s
        while True:
            left = deadline - self._loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._open.wait(), left)
                return await asyncio.wait_for(asyncio.open_connection(self.host, self.backend_port), CONNECT_S)
            except (OSError, asyncio.TimeoutError):  # the proxy is not listening (yet)
                await asyncio.sleep(0.1)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            await self._relay_one(reader, writer)
        finally:
            self._clients.discard(writer)

    async def _relay_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backend = await self._backend()
        if backend is None:
            body = unavailable_body(self.doomed or "the cluster's head node is being started again and the app did "
                                                   "not answer in time; retry")
            writer.write(BUSY % (len(body), body))
            await _close(writer)
            return
        b_reader, b_writer = backend
        # the request side may end first (a client that half-closes); the answer side ends the connection
        request = asyncio.ensure_future(_pipe(reader, b_writer, eof=True))
        await _pipe(b_reader, writer)
        request.cancel()
        await _close(b_writer)
        await _close(writer)

    def close(self) -> None:
        """Stop listening and end every connection still open (a held one, a stream): the port is free."""
        async def stop() -> None:
            self._server.close()
            for writer in list(self._clients):
                writer.transport.abort()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except asyncio.TimeoutError:
                pass

        if self._error is None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, eof: bool = False) -> None:
    """Copy until ``src`` ends; then pass the end on (``eof``: a half-close) or leave closing to the caller."""
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if eof and dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        pass


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
