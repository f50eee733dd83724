"""The exchange's shared-memory links (actors/shm.py) where they differ from the sockets they upgrade:
rings smaller than a message, the handshake's choices (another node, a segment that cannot be opened),
no segment name left behind, and a peer process killed or stopped. Everything the two link kinds
share runs over both in tests/actors/test_wire.py."""

import contextlib
import glob
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from actors import shm
from actors.dispatch import _P2P
from actors.framing import TOKEN_BYTES
from actors.shm import ShmStream, upgrade
from actors.wire import SocketMesh
from tests.actors.procs import context as mp_context

TOKEN = b"s" * TOKEN_BYTES


def _meshes(timeout_s: float = 20.0, keys=("node", "node"), ring_bytes: int = shm.RING_BYTES):
    """(attention rank 0's mesh, expert rank 1's mesh) made and upgraded concurrently, each end
    reporting its key of ``keys``; returns them and the links upgraded on each end."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
    with ThreadPoolExecutor(2) as pool:
        meshes = [f.result(timeout=30) for f in [pool.submit(SocketMesh, store, r, 1, 2, "127.0.0.1", timeout_s,
                                                             token=TOKEN) for r, store in ((0, master), (1, client))]]
        upgraded = [f.result(timeout=30) for f in [pool.submit(upgrade, m, k, ring_bytes) for m, k in zip(meshes, keys)]]
    return meshes, upgraded


def _mine() -> list[str]:
    return glob.glob(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{os.getpid()}-*"))


def _close(*meshes):
    for m in meshes:
        m.close()


RING = 4096


@pytest.mark.parametrize("size", [RING - 16, RING, RING + 1, 3 * RING + 5])
def test_messages_around_the_ring_size_arrive_byte_for_byte_both_ways(size):
    """A 4 KiB ring: messages just under, at, just over and three times its size, with small ones
    between them so that headers split across the ring's end, both ways at once, in posted order."""
    (a, e), upgraded = _meshes(ring_bytes=RING)
    try:
        assert upgraded == [1, 1]
        g = torch.Generator().manual_seed(size)
        msgs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (size, 7, size, 1, size)]
        for src, dst, peer in ((a, e, 1), (e, a, 0)):
            got = [torch.empty_like(m) for m in msgs]
            posted = [dst.recv(x, 1 - peer, tag=i) for i, x in enumerate(got)]
            sends = [src.send(m, peer, tag=i) for i, m in enumerate(msgs)]
            for w in posted[::-1] + sends:  # the last receive waited first: the earlier ones are read on the way
                w.wait()
            assert all(torch.equal(x, m) for x, m in zip(got, msgs))
    finally:
        _close(a, e)


def test_ends_on_different_nodes_keep_their_sockets():
    (a, e), upgraded = _meshes(keys=("n1", "n2"))
    try:
        assert upgraded == [0, 0] and not _mine()
        assert not any(isinstance(link.sock, ShmStream) for m in (a, e) for link in m.links.values())
        got = torch.empty(3)
        a.send(torch.tensor([1.0, 2.0, 3.0]), 1, tag=0).wait()
        e.recv(got, 0, tag=0).wait()
        assert got.tolist() == [1.0, 2.0, 3.0]
    finally:
        _close(a, e)


def test_a_segment_that_cannot_be_opened_keeps_the_sockets_and_leaves_no_name(monkeypatch):
    def refuse(name):
        raise PermissionError(f"cannot open {name}")

    monkeypatch.setattr(shm, "_open", refuse)
    (a, e), upgraded = _meshes()
    try:
        assert upgraded == [0, 0] and not _mine()
        got = torch.empty(2)
        e.send(torch.tensor([4.0, 5.0]), 0, tag=0).wait()
        a.recv(got, 1, tag=0).wait()
        assert got.tolist() == [4.0, 5.0]
    finally:
        _close(a, e)


def test_no_segment_name_outlives_the_handshake_and_a_dead_creators_is_swept():
    (a, e), upgraded = _meshes()
    _close(a, e)
    assert upgraded == [1, 1] and not _mine()
    child = mp_context().Process(target=time.sleep, args=(0,))
    child.start()
    child.join()  # a pid that no process has now
    stale = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{child.pid}-deadbeef")
    open(stale, "wb").close()
    shm.sweep()
    assert not os.path.exists(stale)


# ---- a peer in another process, killed or stopped --------------------------------------------
BIG = 8 << 20  # fp32 elements: 32 MiB


def _big(seed: int) -> torch.Tensor:
    return torch.randn(BIG, generator=torch.Generator().manual_seed(seed))


def _exchange(mesh, peer: int, send: torch.Tensor, into: torch.Tensor) -> float:
    """One a2a call as two colocated workers make it (actors/dispatch.py ``_P2P``): its seconds."""
    t0 = time.monotonic()
    _P2P([mesh.send(send, peer, tag=1)], [mesh.recv(into, peer, tag=1)], (send, into)).wait()
    return time.monotonic() - t0


def _expert(port: int, q, exchange: bool) -> None:
    """Rank 1 in its own process: its mesh upgraded; then (``exchange``) 32 MiB each way with rank 0,
    or it waits to be killed or stopped."""
    send, want, got = (_big(1), _big(0), torch.empty(BIG)) if exchange else (None, None, None)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    mesh = SocketMesh(store, 1, 1, 2, "127.0.0.1", 20.0, token=TOKEN)
    q.put(upgrade(mesh, "node"))
    if exchange:
        took = _exchange(mesh, 0, send, got)
        q.put((took, torch.equal(got, want)))
    time.sleep(120)


def _with_expert(timeout_s: float, exchange: bool = False):
    """(this process's attention mesh, the expert process, a queue of its answers), their link in
    shared memory."""
    ctx = mp_context()
    q = ctx.Queue()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    proc = ctx.Process(target=_expert, args=(master.port, q, exchange), daemon=True)
    proc.start()
    mesh = SocketMesh(master, 0, 1, 2, "127.0.0.1", timeout_s, token=TOKEN)
    mesh.store = master  # the rendezvous lives as long as the mesh
    assert upgrade(mesh, "node") == 1 and q.get(timeout=30) == 1
    assert isinstance(mesh.links[1].sock, ShmStream)
    return mesh, proc, q


@pytest.mark.operator
def test_32_mib_each_way_between_two_processes_crosses_in_under_a_second():
    """Each side sends 32 MiB and receives 32 MiB in one a2a call, at once, between two processes (16
    times a ring, eight times the socket buffers): each reads while its own rest is still leaving."""
    send, want, got = _big(0), _big(1), torch.empty(BIG)
    mesh, proc, q = _with_expert(timeout_s=10, exchange=True)
    try:
        took = _exchange(mesh, 1, send, got)
        their_took, they_got = q.get(timeout=30)
        assert torch.equal(got, want) and they_got
        assert max(took, their_took) < 1.0, (took, their_took)
    finally:
        mesh.close()
        _end(proc)


def _end(proc) -> None:
    """End ``proc``, resumed first if a test stopped it. It may be gone already though ``is_alive()`` says not
    yet: a forkserver's child is reaped by the forkserver, so its pid can vanish between the two calls."""
    if proc.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.join(5)


@pytest.mark.operator
@pytest.mark.parametrize("waiting", ["receive", "send"])
def test_a_killed_peer_fails_a_waiting_receive_or_a_queued_send_at_once(waiting):
    mesh, proc, _q = _with_expert(timeout_s=5)
    try:
        if waiting == "receive":
            work, error = mesh.recv(torch.empty(4), 1, tag=0), "rank 1 closed its connection"
        else:  # 32 MiB: the ring takes 2, the rest waits for the sender thread
            work, error = mesh.send(torch.zeros(8 << 20), 1, tag=0), "sending to rank 1"
            assert type(work).__name__ == "_Queued"
        threading.Timer(0.3, proc.kill).start()
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=error):
            work.wait()
        assert time.monotonic() - t0 < 1.5  # not the 5 s timeout
        with pytest.raises(ConnectionError, match="the link to rank 1 failed earlier"):
            mesh.send(torch.zeros(4), 1, tag=1)
    finally:
        mesh.close()
        _end(proc)


@pytest.mark.operator
def test_a_stopped_peer_fails_a_receive_at_the_timeout():
    mesh, proc, _q = _with_expert(timeout_s=1.5)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 1 sent nothing for 1.5 s"):
            mesh.recv(torch.empty(4), 1, tag=0).wait()
        assert 1.0 < time.monotonic() - t0 < 3.5
    finally:
        mesh.close()
        _end(proc)
