"""Joining and leaving an epoch's process group, the same way for both actor kinds.

NCCL (GPU) does not raise when a peer dies: a collective waits, and the watchdog acts at the
timeout. With ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` ("clean up only", set for every actor through its
Ray runtime environment by the worker group, see :data:`NCCL_ENV`) the watchdog aborts the
communicators of a timed-out collective without killing the process, so the survivors raise, answer
the engine, and can join a recovery epoch; leaving a group whose peer died is then an abort, since a
clean destroy could wait on the dead peer. gloo (CPU) raises on a closed peer or at the timeout."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout  # public in spirit: no other way to shorten a group's timeout

from .mailbox import BOX_BYTES
from .messages import GroupInfo
from .shm import ShmStream, node_key, upgrade
from .wire import SocketMesh, local_ip

# the environment of every actor of an NCCL deployment (a Ray runtime_env; nothing here reads it)
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def open_store(ip: str) -> dist.TCPStore:
    """The epoch's rendezvous store, listening at once on a port the kernel picks on ``ip`` (its
    ``port``): rank 0 opens it and keeps it, so no other process can take the port between the
    choice and the group's start (a port found free and let go can be taken meanwhile)."""
    return dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))


# "socket": direct sockets for every pair (actors/wire.py); "shm": shared memory between two processes on
# one node, direct sockets between nodes (actors/shm.py); "group": gloo's own sends; "auto": the one measured
# fastest at decode sizes, the sockets (bench/bench_exchange.py: shared memory's wake-up through a doorbell
# costs more than the socket's own at one token, and the bytes moved equal at 19 MB). An epoch's actors all on
# one node also get mailboxes with "auto" and "shm" (actors/mailbox.py, actors/board.py): a decode step's
# exchange without the links' frames.
TRANSPORTS = ("auto", "socket", "shm", "group")
_mesh: SocketMesh | None = None  # the current epoch's exchange links (gloo groups, transports auto and socket)
_collective: timedelta | None = None  # the current group's collective timeout


def join_group(info: GroupInfo, rank: int, world_size: int, store: dist.TCPStore | None = None, *,
               num_attention: int, colocated: bool = False) -> None:
    """Join the epoch's process group as ``rank``: through ``store`` (rank 0's, from :func:`open_store`)
    where given, else through the store at the group's address (opened there by rank 0 if it has none).
    On gloo with transports ``auto``, ``socket`` and ``shm`` also the epoch's exchange links
    (:mod:`actors.wire`) between its ``num_attention`` attention ranks and the expert actors after them
    (``colocated``: between every two workers), keyed by the group's token; with ``shm`` the links
    between two processes on one node then move to shared memory (:mod:`actors.shm`)."""
    global _mesh, _collective
    if info.transport not in TRANSPORTS:
        raise ValueError(f"exchange transport must be one of {', '.join(TRANSPORTS)}, got {info.transport!r}")
    # the rendezvous waits the join timeout for every member; the group's collectives and exchange
    # sockets then wait the collective timeout
    joining, collective = timedelta(seconds=info.rendezvous_timeout_s), timedelta(seconds=info.timeout_s)
    _collective = None
    if store is None:
        store = dist.TCPStore(info.address, info.port, world_size, is_master=rank == 0, timeout=joining)
    else:
        store.set_timeout(joining)
    dist.init_process_group(info.backend, store=store, rank=rank, world_size=world_size, timeout=joining)
    try:
        if joining != collective:
            _set_pg_timeout(collective)
        if info.backend == "gloo" and info.transport != "group":
            _mesh = SocketMesh(store, rank, num_attention, world_size, node_ip(info.address), info.timeout_s,
                               token=info.token, prefix=f"moeray/wire/{info.epoch}", colocated=colocated,
                               connect_timeout_s=info.rendezvous_timeout_s)
            if info.transport in ("auto", "shm"):
                try:
                    key = node_key()
                    # mailboxes only where every worker of the epoch is on one node (the exchange takes them only
                    # then: a multi-node epoch's same-node pairs would hold segments they never use)
                    boxes = _one_node(store, f"moeray/wire/{info.epoch}/node", rank, world_size, key)
                    if info.transport == "shm" or boxes:
                        upgrade(_mesh, key, rings=info.transport == "shm", box_bytes=BOX_BYTES if boxes else 0)
                    _mesh.board = boxes and _all_boxed(store, f"moeray/wire/{info.epoch}/boxed", rank, world_size)
                except BaseException:
                    _mesh.close()
                    _mesh = None
                    raise
        store.set_timeout(collective)
        _collective = collective
    except BaseException:
        dist.destroy_process_group()
        raise


def _one_node(store: dist.TCPStore, prefix: str, rank: int, world_size: int, key: str | None) -> bool:
    """Whether every rank of the epoch reports the same node ``key`` (:func:`actors.shm.node_key`; None: no shared
    memory here): each says its own, and all read every one, so all agree."""
    store.set(f"{prefix}/{rank}", (key or "").encode())
    keys = {store.get(f"{prefix}/{r}") for r in range(world_size)}
    return len(keys) == 1 and keys != {b""}


def _all_boxed(store: dist.TCPStore, prefix: str, rank: int, world_size: int) -> bool:
    """Whether every pair of the epoch's workers has mailboxes (all on one node, each segment made):
    each rank says whether all of its links have them, and all read every answer, so all agree on
    taking the mailbox exchange (actors/board.py) or not."""
    mine = all(link.box is not None for link in _mesh.links.values())
    store.set(f"{prefix}/{rank}", b"1" if mine else b"0")
    return all(store.get(f"{prefix}/{r}") == b"1" for r in range(world_size))


def current_mesh() -> SocketMesh | None:
    """The exchange sockets of the group this process is in (None: the group's own ops)."""
    return _mesh


def collective_timeout() -> timedelta | None:
    """The collective timeout of the group this process joined last (None: none joined). gloo's own
    point-to-point ops keep the join timeout their context was made with (``_set_pg_timeout`` reaches
    the collectives only): their waits pass this one."""
    return _collective


def link_kinds() -> dict[str, int]:
    """How this process's exchange links travel: {"shm": n, "socket": m} ({} on the group's own ops); where
    links have mailboxes (actors/mailbox.py: the epoch's workers all on one node) also "mailbox" (links with
    them) and "mailbox_messages" (the messages this process has written into them this epoch)."""
    kinds: dict[str, int] = {}
    links = list(_mesh.links.values()) if _mesh is not None else []
    for link in links:
        kind = "shm" if isinstance(link.sock, ShmStream) else "socket"
        kinds[kind] = kinds.get(kind, 0) + 1
    boxed = [link.box for link in links if link.box is not None]
    if boxed:
        kinds["mailbox"] = len(boxed)
        kinds["mailbox_messages"] = sum(box.sent for box in boxed)
    return kinds


def node_ip(toward: str = "127.0.0.1") -> str:
    """Where this process's sockets (expert exchange, step channel) listen: its Ray node's address,
    else this host's address on the route to ``toward`` (the group's rank 0)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return local_ip(toward)


def break_exchange() -> None:
    """A step failed in this process: its peers still waiting on it must fail at once, not at the
    collective timeout. The epoch's exchange sockets are closed; on NCCL the process group is
    aborted (``all_to_all_single`` has no sockets to close: the abort ends the peers' collectives
    too). Either way the engine regroups next, in a new epoch; on gloo's own sends (transport
    ``group``) the peers' timeout applies."""
    if _mesh is not None:
        _mesh.close()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.is_initialized() and dist.get_backend() == "nccl" and abort is not None:
        abort()


def leave_group() -> None:
    """Leave the current process group, if any (an abort on NCCL, see the module docstring)."""
    global _mesh, _collective
    _collective = None
    if _mesh is not None:
        _mesh.close()
        _mesh = None
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.get_backend() == "nccl" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def exchange_device(info: GroupInfo, compute: torch.device) -> torch.device:
    """Where the expert exchange's tensors live: the GPU on NCCL, host memory on gloo (a GPU actor
    on gloo — e.g. several actors sharing one GPU, which NCCL refuses — stages through the host)."""
    return compute if info.backend == "nccl" else torch.device("cpu")
