"""Every thread that runs an actor's torch work has the actor's thread count: torch.set_num_threads
sizes OpenMP's pool for its own thread only, and a BLAS call on another thread would otherwise run
(and spin) on one OpenMP thread per core. Read from the OpenMP runtime torch loaded."""

import ctypes
import os
import threading
import time

import pytest
import torch

from actors.channel import TOKEN_BYTES, StepChannel, StepServer
from model.moe import ExpertThreads
from model.threads import adopt_torch_threads


def _omp_max_threads():
    """omp_get_max_threads() of the calling thread, from the OpenMP library loaded in this process."""
    libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libiomp" in line})
    assert libs, "torch's OpenMP runtime is not loaded"
    return ctypes.CDLL(libs[0]).omp_get_max_threads()


@pytest.fixture
def threads():
    """A torch thread count no machine has by default (one more than its cores), restored after."""
    before = torch.get_num_threads()
    n = (os.cpu_count() or 1) + 1
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(before)


def _on_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    return out[0]


def test_a_new_thread_has_the_default_pool_until_it_adopts_torchs_count(threads):
    assert _omp_max_threads() == threads
    assert _on_new_thread(_omp_max_threads) != threads  # the trap this guards against
    assert _on_new_thread(lambda: (adopt_torch_threads(), _omp_max_threads())[1]) == threads


def test_the_step_thread_and_the_expert_gemm_pool_run_with_torchs_count(threads):
    token = b"t" * TOKEN_BYTES
    server = StepServer("127.0.0.1", token, lambda req, received_at: _omp_max_threads(), "actor[0]")
    ch = StepChannel("actor[0]", server.address, token, 10.0)
    pool = ExpertThreads(2)
    try:
        ch.send(1, None)
        assert ch.recv(1, time.monotonic() + 10) == threads
        assert pool.pool.submit(_omp_max_threads).result(timeout=10) == threads
    finally:
        pool.close()
        ch.close()
        server.close()
