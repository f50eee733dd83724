"""The processes the exchange tests start (each rank of a group, a peer, an expert): forked from one
server process that imported torch, the exchange's modules and the test modules once
(``multiprocessing``'s ``forkserver``), not spawned — a spawned child imported them all again, about
a second each, for some fifty children. Each child is still a process of its own: its own process
group, sockets and shared memory. The server is single-threaded and runs no torch op, so forking it
is safe (forking an xdist worker, with its threads, would not be)."""

import multiprocessing as mp

# (the test modules by the names pytest imports them under, which their children's targets are pickled by)
PRELOAD = ["torch", "torch.distributed", "actors.dispatch", "actors.colocated", "actors.group", "actors.shm",
           "actors.mailbox", "model.moe", "tests.actors.exact", "test_dispatch", "test_colocated_exchange", "test_shm",
           "test_mailbox"]


def context():
    """The multiprocessing context the exchange tests start their processes with."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
