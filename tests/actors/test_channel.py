"""The engine's step channel (actors/channel.py) on its own: a real StepServer thread and a
StepChannel over loopback, with plain handlers in place of the actors' steps."""

import socket
import threading
import time

import pytest

from actors.channel import TOKEN_BYTES, ChannelClosed, ServesSteps, StepChannel, StepError, StepServer

TOKEN = b"k" * TOKEN_BYTES


def _open(handler, timeout_s: float = 10.0, token: bytes = TOKEN) -> tuple[StepServer, StepChannel]:
    server = StepServer("127.0.0.1", TOKEN, handler, "actor[0]")
    return server, StepChannel("actor[0]", server.address, token, timeout_s)


def _soon(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def _held() -> tuple[threading.Event, StepServer, StepChannel]:
    """A server whose steps wait until the returned gate opens (at most 10 s), with step 1 sent."""
    gate = threading.Event()

    def handler(req, received_at):
        gate.wait(10)
        return req

    server, ch = _open(handler)
    ch.send(1, "x")
    return gate, server, ch


def test_requests_are_served_in_order_and_answers_match_their_steps():
    seen = []

    def handler(req, received_at):
        seen.append(req)
        return {"echo": req, "thread": threading.current_thread().name}

    server, ch = _open(handler)
    try:
        for step in range(1, 4):
            ch.send(step, ("req", step))
        answers = [ch.recv(step, _soon()) for step in range(1, 4)]
        assert seen == [("req", 1), ("req", 2), ("req", 3)]
        assert [a["echo"] for a in answers] == seen
        assert {a["thread"] for a in answers} == {"moeray-steps"}  # the channel's own thread, not the caller's
    finally:
        ch.close()
        server.close()


def test_large_requests_and_answers_cross_without_blocking_either_side():
    """The engine sends the next step's request before it reads the last answer (async scheduling):
    with both larger than the sockets' buffers, neither side may block on its send."""
    big = bytes(range(256)) * 40_000  # 10 MB each way

    server, ch = _open(lambda req, received_at: req[::-1])
    try:
        t0 = time.monotonic()
        for step in (1, 2, 3):
            ch.send(step, big)
        assert time.monotonic() - t0 < 5
        assert all(ch.recv(step, _soon(30)) == big[::-1] for step in (1, 2, 3))
    finally:
        ch.close()
        server.close()


def test_an_error_in_a_step_is_that_steps_answer_and_the_server_goes_on():
    def handler(req, received_at):
        if req == "poison":
            raise RuntimeError("the poisoned prompt")
        return req

    server, ch = _open(handler)
    try:
        ch.send(1, "poison")
        ch.send(2, "good")
        with pytest.raises(StepError, match="RuntimeError: the poisoned prompt"):
            ch.recv(1, _soon())
        assert ch.recv(2, _soon()) == "good"
    finally:
        ch.close()
        server.close()


def test_answers_to_steps_given_up_on_are_skipped():
    server, ch = _open(lambda req, received_at: req)
    try:
        for step in (5, 6, 7):
            ch.send(step, step * 10)
        assert ch.recv(7, _soon()) == 70  # 5 and 6 were given up on (a failed step and one sent ahead)
        ch.send(8, 80)
        assert ch.recv(8, _soon()) == 80
    finally:
        ch.close()
        server.close()


def test_a_closed_actor_end_raises_at_once_not_at_the_deadline():
    gate, server, ch = _held()
    try:
        threading.Timer(0.3, server.close).start()  # the actor's end goes away while the step runs
        t0 = time.monotonic()
        with pytest.raises(ChannelClosed, match=r"actor\[0\] closed its step channel"):
            ch.recv(1, _soon(20))
        assert time.monotonic() - t0 < 5
        ch.send(2, "y")  # a send to a gone actor does not raise here: the next wait does
        with pytest.raises(ChannelClosed):
            ch.recv(2, _soon(1))
    finally:
        gate.set()
        ch.close()


def test_a_silent_actor_times_out_at_the_deadline():
    gate, server, ch = _held()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"actor\[0\] did not answer step 1"):
            ch.recv(1, time.monotonic() + 1.0)
        assert 0.9 < time.monotonic() - t0 < 5
    finally:
        gate.set()
        ch.close()
        server.close()


def test_a_lost_node_is_found_by_its_liveness_check_before_the_deadline():
    """A node that stops answering closes no connection: the wait asks ``alive()`` every
    ``check_every_s``, waits on while it says yes and gives the actor up as soon as it says no."""
    gate, server, ch = _held()
    asked = []

    def alive():
        asked.append(time.monotonic())
        return len(asked) < 3  # the node is lost at the third check

    try:
        threading.Timer(0.5, gate.set).start()  # a live node's slow step is waited for
        assert ch.recv(1, _soon(10), alive=lambda: True, check_every_s=0.05) == "x"
        gate.clear()
        ch.send(2, "y")
        t0 = time.monotonic()
        with pytest.raises(ChannelClosed, match=r"actor\[0\] is gone \(its node stopped answering\)"):
            ch.recv(2, _soon(30), alive=alive, check_every_s=0.2)
        assert len(asked) == 3 and time.monotonic() - t0 < 5
    finally:
        gate.set()
        ch.close()
        server.close()


def test_connections_without_the_token_do_not_take_the_engines_place():
    server = StepServer("127.0.0.1", TOKEN, lambda req, received_at: ("served", req), "actor[0]")
    strays = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
    strays[0].sendall(b"garbage" * 10)
    strays[1].sendall(b"moeray-s" + bytes(8) + b"x" * TOKEN_BYTES)  # the right magic and identity, a wrong token
    strays[2].close()  # silent close
    ch = StepChannel("actor[0]", server.address, TOKEN, 10)
    try:
        ch.send(1, "hello")
        assert ch.recv(1, _soon()) == ("served", "hello")
        strays[1].settimeout(5)
        assert strays[1].recv(16) == b""  # closed by the server: it was ignored
    finally:
        for s in strays:
            s.close()
        ch.close()
        server.close()


def test_a_wrong_token_gets_no_answer():
    server, ch = _open(lambda req, received_at: req, token=b"w" * TOKEN_BYTES)
    try:
        ch.send(1, "x")
        with pytest.raises(ChannelClosed):
            ch.recv(1, _soon(10))
    finally:
        ch.close()
        server.close()


def test_an_epoch_change_waits_for_the_step_in_progress():
    """A step runs on the channel's thread, an epoch change on Ray's: they never overlap."""
    events = []

    class Worker(ServesSteps):
        name = "attention[0]"

        def step(self, req):
            events.append("step begins")
            time.sleep(0.5)
            events.append("step ends")
            return req

        def enter_epoch(self):
            with self.busy:
                events.append("epoch")

    w = Worker()
    host, port = w.open_channel(TOKEN)
    ch = StepChannel("attention[0]", (host, port), TOKEN, 10)
    try:
        ch.send(1, "x")
        while not events:
            time.sleep(0.01)
        w.enter_epoch()
        assert ch.recv(1, _soon()) == "x"
        assert events == ["step begins", "step ends", "epoch"]
    finally:
        ch.close()
        w.close_channel()


def test_a_token_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        StepServer("127.0.0.1", b"short", lambda req, received_at: req, "actor[0]")


def test_a_failed_step_aborts_an_nccl_group_so_its_peers_fail_at_once(monkeypatch):
    """A worker that raises mid-step (before its exchange) must not leave its peers in
    ``all_to_all_single`` until the collective timeout: on NCCL there are no sockets to close, so its
    process group is aborted. No GPU here: an NCCL default group is stood in for (is_initialized,
    get_backend and the abort itself) — what it checks is that the failed step reaches the abort."""
    import torch.distributed as dist

    from actors import group

    aborted = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda *a: aborted.append(a), raising=False)
    monkeypatch.setattr(group, "_mesh", None)

    class Failing(ServesSteps):
        name = "worker[0]"

        def step(self, request):
            raise RuntimeError("sampling failed")

    actor = Failing()
    with pytest.raises(RuntimeError, match="sampling failed"):
        actor.serve_step(None)
    assert aborted == [()]
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    actor.break_exchange()  # on gloo, nothing to abort: the socket mesh (none here) is closed instead
    assert aborted == [()]
