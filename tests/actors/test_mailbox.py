"""The mailboxes (actors/mailbox.py) beside a pair's link: messages of several tensors arrive byte for byte
both ways, in place; a slot's old message never passes for a new one (two ends that disagree fail at the
timeout, never read the wrong bytes, and the mailbox stays broken); a message larger than a slot is
refused; pairs on two nodes get none; a killed peer fails a waiting read at once and a stopped one at
the timeout. The exchange that uses them: tests/actors/test_colocated_exchange.py (``auto``)."""

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
from actors.framing import TOKEN_BYTES
from actors.mailbox import SLOTS, MailboxBroken
from actors.shm import ShmStream, upgrade
from actors.wire import SocketMesh
from tests.actors.procs import context as mp_context
from tests.actors.test_shm import _end

TOKEN = b"m" * TOKEN_BYTES
BOX = 64 << 10  # 16 KiB slots


def _meshes(timeout_s: float = 20.0, keys=("node", "node")):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
    with ThreadPoolExecutor(2) as pool:
        meshes = [f.result(timeout=30) for f in [pool.submit(SocketMesh, store, r, 2, 2, "127.0.0.1", timeout_s,
                                                             token=TOKEN, colocated=True)
                                                 for r, store in ((0, master), (1, client))]]
        upgraded = [f.result(timeout=30) for f in [pool.submit(upgrade, m, k, rings=False, box_bytes=BOX)
                                                   for m, k in zip(meshes, keys)]]
    return meshes, upgraded


def test_messages_of_several_tensors_arrive_byte_for_byte_both_ways_and_the_links_stay_sockets():
    (a, b), upgraded = _meshes()
    try:
        assert upgraded == [1, 1]
        ab, ba = a.links[1], b.links[0]
        assert not isinstance(ab.sock, ShmStream) and ab.box is not None and ba.box is not None  # sockets + boxes
        g = torch.Generator().manual_seed(0)
        for step in range(1, 4):
            for i in range(3 * SLOTS):  # every slot reused, around and around
                parts = [torch.randn(i + 1, 8, generator=g), torch.randint(0, 99, (i, 3), generator=g, dtype=torch.int32),
                         torch.randn(2, generator=g).to(torch.bfloat16), torch.empty(0, 8)]
                shapes = [(tuple(p.shape), p.dtype) for p in parts]
                n = ab.box.put(step, i, parts)
                m = ba.box.put(step, i, [p.flip(0) for p in parts])
                assert n == m == ((step - 1) * 3 * SLOTS + i)
                for got, want in ((ba.box.get(n, step, i, shapes), parts),
                                  (ab.box.get(n, step, i, shapes), [p.flip(0) for p in parts])):
                    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(got, want))
        assert not ab.box.fits(ab.box.slot_bytes + 1)
        with pytest.raises(ValueError, match="does not fit a mailbox slot"):
            ab.box.put(9, 0, [torch.empty(ab.box.slot_bytes // 4 + 1)])
    finally:
        a.close(), b.close()


def test_an_old_message_never_passes_for_a_new_one_and_a_failed_mailbox_stays_broken():
    (a, b), _ = _meshes(timeout_s=0.5)
    try:
        ab, ba = a.links[1], b.links[0]
        n = ab.box.put(1, 0, [torch.ones(4)])
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 0 wrote nothing for 0.5 s"):  # the reader is at step 2
            ba.box.get(n, 2, 0, [((4,), torch.float32)])
        assert 0.4 < time.monotonic() - t0 < 2.5
        with pytest.raises(MailboxBroken, match="failed earlier"):
            ba.box.get(n, 1, 0, [((4,), torch.float32)])
        ab.box.put(1, 1, [torch.ones(4)])  # the writer's own direction still works; the reader's end is done
    finally:
        a.close(), b.close()


def test_a_waiting_reader_sleeps_until_the_message_and_then_has_it():
    """Past its spin a reader sleeps on the box's wake-up word (a futex): waiting 0.4 s for a message takes
    its thread a small part of that in CPU time (a reader that kept looking took a core from the other
    processes), and the writer's wake-up brings it the message. Then many round trips between two
    threads, each side sleeping on the other: every message arrives, in order."""
    (a, b), _ = _meshes()
    try:
        ab, ba = a.links[1], b.links[0]
        got = {}

        def read():
            cpu0, t0 = time.thread_time(), time.monotonic()
            got["x"] = ba.box.get(0, 1, 0, [((4,), torch.float32)])[0].clone()
            got["cpu"], got["wall"] = time.thread_time() - cpu0, time.monotonic() - t0

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.4)
        ab.box.put(1, 0, [torch.arange(4.0)])
        reader.join(timeout=10)
        assert torch.equal(got["x"], torch.arange(4.0)) and got["wall"] >= 0.35
        assert got["cpu"] < 0.25 * got["wall"], got  # it slept (~3 % here); napping 20 µs between looks took 44 %

        def pong():
            for i in range(1, 400):
                x = ba.box.get(i, 2, i, [((1,), torch.float32)])[0].item()
                ba.box.put(2, i, [torch.tensor([x + 1])])
        ba.box.put(1, 0, [torch.zeros(1)])  # (ba's message 0: the numbering as both ends count it)
        ab.box.get(0, 1, 0, [((1,), torch.float32)])
        t = threading.Thread(target=pong)
        t.start()
        for i in range(1, 400):
            ab.box.put(2, i, [torch.tensor([float(i)])])
            assert ab.box.get(i, 2, i, [((1,), torch.float32)])[0].item() == i + 1
        t.join(timeout=10)
    finally:
        a.close(), b.close()


def test_pairs_on_two_nodes_get_no_mailbox():
    (a, b), upgraded = _meshes(keys=("node-a", "node-b"))
    try:
        assert upgraded == [0, 0] and a.links[1].box is None and b.links[0].box is None
    finally:
        a.close(), b.close()


# ---- a peer in another process, killed or stopped --------------------------------------------
def _peer(port: int, q) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    mesh = SocketMesh(store, 1, 2, 2, "127.0.0.1", 20.0, token=TOKEN, colocated=True)
    q.put(upgrade(mesh, "node", rings=False, box_bytes=BOX))
    time.sleep(120)


def _with_peer(timeout_s: float):
    ctx = mp_context()
    q = ctx.Queue()
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    proc = ctx.Process(target=_peer, args=(master.port, q), daemon=True)
    proc.start()
    mesh = SocketMesh(master, 0, 2, 2, "127.0.0.1", timeout_s, token=TOKEN, colocated=True)
    mesh.store = master
    assert upgrade(mesh, "node", rings=False, box_bytes=BOX) == 1 and q.get(timeout=30) == 1
    return mesh, proc


@pytest.mark.operator
def test_a_killed_peer_fails_a_waiting_read_at_once():
    mesh, proc = _with_peer(timeout_s=5)
    try:
        threading.Timer(0.3, proc.kill).start()
        t0 = time.monotonic()
        with pytest.raises(MailboxBroken, match="rank 1 is gone"):
            mesh.links[1].box.get(0, 1, 0, [((4,), torch.float32)])
        assert 0.2 < time.monotonic() - t0 < 1.5  # not the 5 s timeout
        with pytest.raises(MailboxBroken, match="failed earlier"):
            mesh.links[1].box.put(1, 0, [torch.ones(4)])
    finally:
        mesh.close()
        _end(proc)


@pytest.mark.operator
def test_a_stopped_peer_fails_a_waiting_read_at_the_timeout():
    mesh, proc = _with_peer(timeout_s=1.5)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="rank 1 wrote nothing for 1.5 s"):
            mesh.links[1].box.get(0, 1, 0, [((4,), torch.float32)])
        assert 1.0 < time.monotonic() - t0 < 3.5
    finally:
        mesh.close()
        _end(proc)
        assert not [p for p in os.listdir(shm.SHM_DIR) if p.startswith(f"{shm.PREFIX}{os.getpid()}-")]


def test_an_epoch_takes_mailboxes_only_when_every_rank_is_on_one_node():
    """The join's agreement (actors/group.py ``_one_node``): every rank says its node key through the epoch's store
    and all read every one, so all agree — mailboxes when every key is the same, none when one differs (a
    multi-node epoch's same-node pairs would hold segments its exchange never uses) or none has shared memory."""
    from actors.group import _one_node

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    stores = [master] + [dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
                         for _ in range(2)]
    for case, (keys, want) in enumerate(((["a", "a", "a"], True), (["a", "a", "b"], False), ([None] * 3, False),
                                         (["a", None, "a"], False))):
        with ThreadPoolExecutor(3) as pool:
            got = [f.result(timeout=30) for f in [pool.submit(_one_node, st, f"t/{case}", r, 3, k)
                                                  for r, (st, k) in enumerate(zip(stores, keys))]]
        assert got == [want] * 3, (keys, got)
