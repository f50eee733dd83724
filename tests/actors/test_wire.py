"""The expert exchange's links on their own: two meshes of one epoch made through a real rendezvous
store, one per thread (an attention rank and an expert actor), each test over the direct sockets
(actors/wire.py) and over shared memory (actors/shm.py: the same links, upgraded)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from actors.dispatch import _P2P
from actors.framing import TOKEN_BYTES
from actors.shm import ShmStream, upgrade
from actors.wire import SocketMesh

TOKEN = b"e" * TOKEN_BYTES  # the epoch's token


def _stores():
    """A rendezvous store and a second client of it: one each, as in two processes."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    return master, dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))


KINDS = ("socket", "shm")


def _pair(timeout_s: float = 20.0, kind: str = "socket"):
    """(attention rank 0's mesh, expert rank 1's mesh), made concurrently as the two actors make them;
    ``kind`` "shm": then upgraded to shared memory, both ends reporting one node."""
    master, client = _stores()
    with ThreadPoolExecutor(2) as pool:  # one store client each, as in two processes
        futs = [pool.submit(SocketMesh, store, r, 1, 2, "127.0.0.1", timeout_s, token=TOKEN)
                for r, store in ((0, master), (1, client))]
        meshes = tuple(f.result(timeout=30) for f in futs)
        if kind == "shm":
            assert [f.result(timeout=30) for f in [pool.submit(upgrade, m, "node") for m in meshes]] == [1, 1]
    for m in meshes:
        assert all(isinstance(link.sock, ShmStream) == (kind == "shm") for link in m.links.values())
    return meshes


@pytest.fixture(params=KINDS)
def pair(request):
    a, e = _pair(kind=request.param)
    yield a, e
    a.close()
    e.close()


def test_crossing_sends_larger_than_the_socket_buffers_complete_exactly(pair):
    """Both sides post a 48 MB send before either receives (ping-pong's crossing exchanges): the part
    the kernel does not take goes to the link's sender thread, so neither caller blocks and both
    arrive byte for byte."""
    a, e = pair
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3_000_000, 4, generator=g), torch.randn(3_000_000, 4, generator=g).to(torch.bfloat16)
    gx, gy = torch.empty_like(x), torch.empty_like(y)
    t0 = time.monotonic()
    sends = [a.send(x, 1, tag=1), e.send(y, 0, tag=1)]  # both return before any receive is posted
    assert time.monotonic() - t0 < 5
    assert any(type(s).__name__ == "_Queued" for s in sends)  # too big for the kernel: really queued
    recvs = [a.recv(gy, 1, tag=1), e.recv(gx, 0, tag=1)]
    for w in recvs + sends:
        w.wait()
    assert torch.equal(gx, x) and torch.equal(gy.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("kind", KINDS)
def test_an_exchange_crossing_32_mib_each_way_completes_when_each_side_waits_its_own_ops(kind):
    """Each side posts its send and its receive as one a2a call and waits on that call, as two
    colocated workers do in every exchange (actors/dispatch.py ``_P2P``), at once from two threads (two
    processes): 32 MiB each way, eight times the socket buffers. Each must read the other's rows
    while its own rest is still leaving, or both sit blocked until the link's timeout."""
    a, e = _pair(timeout_s=5, kind=kind)
    try:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8 << 20, generator=g), torch.randn(8 << 20, generator=g)  # 32 MiB each
        gx, gy = torch.empty_like(x), torch.empty_like(y)

        def exchange(mesh, send, into, peer):
            t0 = time.monotonic()
            _P2P([mesh.send(send, peer, tag=1)], [mesh.recv(into, peer, tag=1)], (send, into)).wait()
            return time.monotonic() - t0

        with ThreadPoolExecutor(2) as pool:
            took = [f.result(timeout=30) for f in (pool.submit(exchange, a, x, gy, 1),
                                                   pool.submit(exchange, e, y, gx, 0))]
        assert torch.equal(gx, x) and torch.equal(gy, y)
        assert max(took) < 1.0, took
    finally:
        a.close()
        e.close()


def test_receives_complete_in_posted_order_whichever_is_waited_first(pair):
    a, e = pair
    msgs = [torch.full((5 + i,), float(i)) for i in range(4)]
    got = [torch.empty_like(m) for m in msgs]
    posted = [e.recv(g, 0, tag=i) for i, g in enumerate(got)]
    for i, m in enumerate(msgs):
        a.send(m, 1, tag=i).wait()
    posted[2].wait()  # reads 0, 1 and 2 off the link, in order
    assert [p.done for p in posted] == [True, True, True, False]
    posted[3].wait()
    assert all(torch.equal(g, m) for g, m in zip(got, msgs))


def test_a_message_other_than_the_one_due_is_an_error_naming_both(pair):
    a, e = pair
    a.send(torch.zeros(4), 1, tag=3).wait()
    with pytest.raises(ConnectionError, match=r"rank 0 sent call 3 of 16 bytes where call 2 of 16 bytes was due"):
        e.recv(torch.empty(4), 0, tag=2).wait()


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_peer_raises_at_the_timeout(kind):
    a, e = _pair(timeout_s=1.5, kind=kind)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 1 sent nothing for 1.5 s"):
            a.recv(torch.empty(4), 1, tag=0).wait()
        assert 1.0 < time.monotonic() - t0 < 5
    finally:
        a.close()
        e.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_peer_raises_at_once(kind):
    a, e = _pair(timeout_s=5, kind=kind)
    try:
        threading.Timer(0.3, e.close).start()
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="rank 1 closed its connection"):
            a.recv(torch.empty(4), 1, tag=1).wait()
        assert time.monotonic() - t0 < 3  # not the 5 s timeout
    finally:
        a.close()
        e.close()


def test_a_receive_into_a_non_contiguous_tensor_is_refused(pair):
    a, _ = pair
    with pytest.raises(ValueError, match="contiguous"):
        a.recv(torch.empty(4, 4).t(), 1, tag=0)


def test_an_attention_rank_that_never_connects_fails_the_expert_side_in_time():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1: rank\(s\) \[0\] did not connect within 1 s"):
        SocketMesh(store, 1, 1, 2, "127.0.0.1", 1.0, token=TOKEN)
    assert time.monotonic() - t0 < 4


def test_an_unknown_transport_is_refused_by_name():
    from actors.group import join_group
    from actors.messages import GroupInfo
    from cluster.config import EngineConfig
    from deploy.config import ServeConfig

    with pytest.raises(ValueError, match="engine setting 'transport' must be one of auto, socket, shm, group, got 'tcp'"):
        EngineConfig.of(model="m", transport="tcp")
    with pytest.raises(ValueError, match="exchange transport must be one of auto, socket, shm, group, got 'tcp'"):
        join_group(GroupInfo(0, "127.0.0.1", 1, TOKEN, transport="tcp"), 0, 2, num_attention=1)
    with pytest.raises(ValueError, match="transport"):
        ServeConfig.parse({"transport": "tcp"})
    assert ServeConfig.parse({}).engine_config("m").data_plane.transport == "auto"


def test_a_group_needs_a_token_of_the_right_size():
    from actors.messages import GroupInfo

    with pytest.raises(ValueError, match=f"group: token is {TOKEN_BYTES} bytes, got 5"):
        GroupInfo(0, "127.0.0.1", 1, b"short")
    with pytest.raises(ValueError, match="group: token must be bytes, got str"):
        GroupInfo(0, "127.0.0.1", 1, "e" * TOKEN_BYTES)
    assert "token" not in repr(GroupInfo(0, "127.0.0.1", 1, TOKEN))  # a secret: never in a log line


def test_after_a_failed_receive_the_link_stays_failed(pair):
    """A receive that failed left the stream at an unknown point: later waits raise, never misread."""
    a, e = pair
    a.send(torch.zeros(4), 1, tag=3).wait()
    a.send(torch.zeros(4), 1, tag=4).wait()
    with pytest.raises(ConnectionError, match="call 3"):
        e.recv(torch.empty(4), 0, tag=2).wait()
    with pytest.raises(ConnectionError, match="the link to rank 0 failed earlier"):
        e.recv(torch.empty(4), 0, tag=4).wait()


def test_stray_connections_during_setup_are_ignored():
    """Something else connecting to an expert actor's port (garbage, a wrong rank, silence) does not
    take an attention rank's place: the real one still connects and the link works."""
    import socket

    master, client = _stores()
    with ThreadPoolExecutor(1) as pool:
        expert = pool.submit(SocketMesh, client, 1, 1, 2, "127.0.0.1", 10.0, token=TOKEN)
        host, port = master.get("moeray/wire/1").decode().rsplit(":", 1)
        strays = [socket.create_connection((host, int(port))) for _ in range(3)]
        strays[0].sendall(b"GET / HTTP/1.1\r\n\r\n")
        strays[1].sendall(b"moeray-x" + (7).to_bytes(8, "little") + TOKEN)  # a rank this epoch does not have
        strays[2].close()
        attention = SocketMesh(master, 0, 1, 2, "127.0.0.1", 10.0, token=TOKEN)
        e = expert.result(timeout=30)
    try:
        got = torch.empty(3)
        attention.send(torch.tensor([1.0, 2.0, 3.0]), 1, tag=0).wait()
        e.recv(got, 0, tag=0).wait()
        assert got.tolist() == [1.0, 2.0, 3.0] and set(e.links) == {0}
    finally:
        for s in strays:
            s.close()
        attention.close()
        e.close()


def test_a_connection_without_the_epochs_token_is_closed_and_ignored():
    """A process that announces a free attention rank but not the epoch's token (another epoch's, a
    stray) does not take that rank's place: it is closed, and the real rank still connects."""
    import socket

    master, client = _stores()
    with ThreadPoolExecutor(1) as pool:
        expert = pool.submit(SocketMesh, client, 1, 1, 2, "127.0.0.1", 10.0, token=TOKEN)
        host, port = master.get("moeray/wire/1").decode().rsplit(":", 1)
        stray = socket.create_connection((host, int(port)), timeout=5)
        try:
            stray.sendall(b"moeray-x" + (0).to_bytes(8, "little") + b"w" * TOKEN_BYTES)  # rank 0, a wrong token
            assert stray.recv(16) == b""  # closed by the expert actor before the real rank 0 connects
        finally:
            stray.close()
        attention = SocketMesh(master, 0, 1, 2, "127.0.0.1", 10.0, token=TOKEN)
        e = expert.result(timeout=30)
    try:
        got = torch.empty(3)
        attention.send(torch.tensor([1.0, 2.0, 3.0]), 1, tag=0).wait()
        e.recv(got, 0, tag=0).wait()
        assert got.tolist() == [1.0, 2.0, 3.0] and set(e.links) == {0}
    finally:
        attention.close()
        e.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_send_that_fails_midway_fails_its_wait_and_every_later_send(kind):
    """Part of a message may have left when a send fails: the stream is unusable, so its wait raises
    and later sends are refused at once (the engine regroups), never written after half a message."""
    a, e = _pair(timeout_s=5, kind=kind)
    try:
        e.close()  # the peer is gone; what it had not read is reset
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="sending to rank 1"):
            for tag in range(1, 50):  # the first sends may still fit the kernel's buffers
                a.send(torch.zeros(1 << 20), 1, tag=tag).wait()
        assert time.monotonic() - t0 < 4  # not the 5 s timeout
        with pytest.raises(ConnectionError, match="the link to rank 1 failed earlier"):
            a.send(torch.zeros(4), 1, tag=99)
    finally:
        a.close()
