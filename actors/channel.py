"""The step channel: one direct TCP connection from the engine to each actor, carrying that actor's
step requests and results (docs/architecture.md "Engine").

Ray stays the control plane: it creates the actors, opens their channels (each actor's
``open_channel``, a Ray call that hands over the engine's token), moves them between epochs and
tells a dead actor from a failed step. Only the per-step message and its answer go through here,
because a Ray actor call costs far more than the message: on these machines a step's calls to two
actors took 2.4 ms of wall time and 3.4 ms of CPU over the caller and the actors (task submission,
gRPC and the core worker's threads), against 0.2 ms and 0.3 ms over these sockets
(``bench/bench_overhead.py`` measures the step with both).

* :class:`StepServer` (actor side) listens on its node's address; the first connection that presents
  the engine's token is the engine's (anything else is closed and ignored). Its thread then runs the
  requests in the order they came, one at a time, and answers each with its result or its error.
* :class:`StepChannel` (engine side) sends a step's request without ever blocking on a full socket
  (the link's sender thread takes the rest) and reads the answers in order. Each message carries its
  step number: an answer to a step the engine gave up on (a step sent ahead of one that failed) is
  skipped. Every read has a deadline; a closed connection raises at once.

Owns: one actor's channel — the server's thread and listener, the engine's link — and the step
numbers on it. Never: lays out frames or the handshake itself (:mod:`actors.framing` does, for the
exchange's sockets too), or runs two of an actor's steps at once.
"""

from __future__ import annotations

import pickle
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from model.threads import adopt_torch_threads

from .framing import TOKEN_BYTES, Acceptor, check_token, connect, readable
from .group import break_exchange
from .wire import Link

__all__ = ["TOKEN_BYTES", "ChannelClosed", "ServesSteps", "StepChannel", "StepError", "StepServer"]

# the channel's handshake (actors/framing.py): this magic, the engine as identity, the engine's token
_MAGIC, _ENGINE = b"moeray-s", 0
_HELLO_TIMEOUT_S = 5.0  # a connection that has not said its hello by then is closed


class StepError(RuntimeError):
    """The actor answered a step with an error (the actor itself is alive)."""


class ChannelClosed(ConnectionError):
    """The actor's end of the channel is gone (the actor died, or its node)."""


def _frame(kind: str, value: Any) -> bytes:
    return pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)


class StepServer:
    """Actor side of one step channel: serves ``handler(request, received_at) -> result`` on its own
    thread (``received_at``: when the request's frame was read, on ``time.perf_counter``)."""

    def __init__(self, host: str, token: bytes, handler: Callable[[Any], Any], name: str,
                 accept_timeout_s: float = 300.0):
        check_token(token, "a step channel token")
        self.token, self.handler, self.name = token, handler, name
        self.listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address: tuple[str, int] = (host, self.listener.getsockname()[1])
        self.link: Link | None = None
        self.closed = False
        self._deadline = time.monotonic() + accept_timeout_s
        self.thread = threading.Thread(target=self._run, name="moeray-steps", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        adopt_torch_threads()  # the steps run here: with the actor's thread count, not one per core
        try:
            self.link = self._accept()
        finally:
            self.listener.close()
        while self.link is not None and not self.closed:
            try:
                readable(self.link.sock, None)  # idle until the engine's next request
                step, data = self.link.read_frame()
                received = time.perf_counter()
            except (OSError, ValueError):  # the engine closed the channel (or it was closed here)
                break
            try:
                reply = _frame("ok", self.handler(pickle.loads(data), received))
            except Exception as e:  # noqa: BLE001 — the engine gets it as the step's error
                traceback.print_exc(file=sys.stderr)
                reply = _frame("error", f"{type(e).__name__}: {e}")
            try:
                self.link.send_bytes(step, reply)  # in order; a large answer leaves from the sender thread
            except OSError:
                break
        self.close()

    def _accept(self) -> Link | None:
        """The engine's connection: the first one that presents the token before the deadline
        (anything else is closed and ignored)."""
        acceptor = Acceptor(self.listener, _MAGIC, self.token, hello_timeout_s=_HELLO_TIMEOUT_S)
        try:
            passed = acceptor.accept(self._deadline)
        except (OSError, ValueError):  # closed here meanwhile
            return None
        finally:
            acceptor.close()
        if passed is None:
            print(f"{self.name}: the engine did not open its step channel", file=sys.stderr)
            return None
        # no timeouts this side: it idles between steps for as long as the engine likes, and an answer
        # may wait in the socket while the engine reads a stuck peer's (it closes if the engine goes)
        return Link(passed[0], "engine", None, label="the engine")

    def close(self) -> None:
        self.closed = True
        if self.link is not None:
            self.link.close()
        else:
            self.listener.close()


class StepChannel:
    """Engine side of one actor's step channel (``name``: the actor, for errors)."""

    def __init__(self, name: str, address: tuple[str, int], token: bytes, timeout_s: float,
                 connect_timeout_s: float | None = None):
        self.name = name
        sock = connect(address, _MAGIC, _ENGINE, token, connect_timeout_s or timeout_s)
        self.link = Link(sock, name, timeout_s, label=name)
        self.failed: OSError | None = None  # a send that could not be written: the actor's end is gone

    def send(self, step: int, request: Any) -> None:
        """Send ``request`` for step ``step``; never blocks on a full socket. A failure to send shows
        at :meth:`recv` (as a closed channel)."""
        if self.failed is not None:
            return
        try:
            self.link.send_bytes(step, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as e:
            self.failed = e

    def recv(self, step: int, deadline: float, alive: Callable[[], bool] | None = None,
             check_every_s: float = 2.0) -> Any:
        """The answer to step ``step`` (earlier steps' answers are skipped). Raises StepError when the
        actor answered with an error, TimeoutError when no answer came by ``deadline`` (monotonic),
        ChannelClosed when the actor's end is gone — or, every ``check_every_s`` without an answer,
        when ``alive()`` says the actor is (its node lost: no connection closes then)."""
        if self.failed is not None:
            raise ChannelClosed(f"{self.name} closed its step channel ({self.failed})")
        while True:
            left = deadline - time.monotonic()
            try:
                if not readable(self.link.sock, min(max(left, 0.0), check_every_s)):
                    if left <= check_every_s:
                        raise TimeoutError(f"{self.name} did not answer step {step}")
                    if alive is not None and not alive():
                        raise ChannelClosed(f"{self.name} is gone (its node stopped answering)")
                    continue
                call, data = self.link.read_frame()
            except (TimeoutError, ChannelClosed):
                raise
            except (OSError, ValueError) as e:
                self.failed = e if isinstance(e, OSError) else OSError(str(e))
                raise ChannelClosed(f"{self.name} closed its step channel ({e})") from None
            if call < step:
                continue  # the answer to a step given up on
            if call > step:
                raise ChannelClosed(f"{self.name} answered step {call} where step {step} was due")
            kind, value = pickle.loads(data)
            if kind == "error":
                raise StepError(value)
            return value

    def close(self) -> None:
        self.link.close()


class ServesSteps:
    """What both actor kinds add for their step channel: :meth:`open_channel` (a Ray call from the
    engine) and the lock that keeps a step and an epoch change apart (a step runs on the channel's
    thread, an epoch change on Ray's). The class defines ``name``, ``step`` and ``enter_epoch``."""

    name: str
    _channel: StepServer | None = None

    def __init__(self):
        self.busy = threading.Lock()
        self.steps_begun = self.steps_done = 0  # bumped by the step thread; read by heartbeat()

    def open_channel(self, token: bytes) -> tuple[str, int]:
        """Serve this actor's steps to the engine that holds ``token``: returns where it listens."""
        from .group import node_ip

        self.close_channel()
        self._channel = StepServer(node_ip(), token, self.serve_step, self.name)
        return self._channel.address

    received_at = 0.0  # when the step being served arrived (time.perf_counter), for its timeline

    def serve_step(self, request, received_at: float = 0.0):
        with self.busy:
            self.received_at = received_at or time.perf_counter()
            self.steps_begun += 1
            try:
                return self.step(request)
            except Exception:
                break_exchange()
                raise
            finally:
                self.steps_done += 1

    def break_exchange(self) -> None:
        """Break this epoch's exchange from Ray's thread (its sockets closed; an NCCL group aborted): a
        step blocked on a hung peer fails at once (the engine calls it on the live actors when it
        found one hung)."""
        break_exchange()

    def exchange_links(self) -> dict[str, int]:
        """How this epoch's exchange links travel: {"shm": n, "socket": m}, and colocated workers' mailboxes
        (actors/group.py ``link_kinds``)."""
        from .group import link_kinds

        return link_kinds()

    def heartbeat(self) -> tuple[int, int]:
        """(steps begun, steps done): answered on Ray's thread, never the step thread's, so it tells a
        live process with a long step from one that answers nothing at all (stopped, wedged, swapping)."""
        return self.steps_begun, self.steps_done

    def close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
