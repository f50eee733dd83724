"""Torch's threads in threads other than the one that set them.

Two facts of OpenMP (GNU libgomp, which torch's CPU builds use for its ``parallel_for`` and MKL's
threading) shape how a process may run torch work on a thread of its own:

* ``torch.set_num_threads(n)`` sizes OpenMP's pool only for the calling thread (and for torch's own
  ``parallel_for`` in any thread). A BLAS call (MKL, oneDNN) from another thread — an actor's step
  thread, a GEMM pool's worker — uses that thread's OpenMP default instead: one thread per core.
  Those threads spin between calls, so an actor told to use one thread takes every core from its
  peers. Measured on 2 cores: a 512×512 GEMM loop on a new thread used 1.95 cores after
  ``torch.set_num_threads(1)`` in the main thread, 1.0 after :func:`adopt_torch_threads`.
* Each thread that runs a parallel region keeps a pool of its own, for as long as it lives. Once the
  pools' threads outnumber the CPUs, libgomp cuts every pool's spin between regions to ~100 turns, so
  each parallel op then waits for a futex wake of its workers. Measured on 2 cores: a softmax over
  64 × 2048 took 35 µs on the thread that made the only pool and 95 µs on a second thread while the
  main thread's pool lived; a served in-process decode step of ``kimi-k2-tiny`` took 6.0 ms on the
  engine's thread against 3.2 ms on the main thread. :func:`release_openmp_pool` on the thread that
  built the model (then idle) gives the stepping thread the only pool again."""

from __future__ import annotations

import contextlib
import ctypes
import logging

import torch

log = logging.getLogger(__name__)


def adopt_torch_threads() -> None:
    """Make the calling thread's OpenMP and BLAS pools the size ``torch.set_num_threads`` gave
    (call it first thing on a thread that runs torch work)."""
    torch.set_num_threads(torch.get_num_threads())


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP pool (``omp_pause_resource_all(omp_pause_soft)``), so that
    another thread's parallel ops are not throttled by it; the calling thread makes a new pool if it
    runs parallel work again. Call it on a thread that is done with torch work for now (the main
    thread once the model is built and its steps run elsewhere). False where the process's OpenMP
    offers no pause (it is then left as it was). Only GNU libgomp's is called: its pause frees the calling
    thread's pool alone, where another runtime's may reach the pools of threads that are mid-region."""
    try:
        with open("/proc/self/maps") as maps:
            if not any("libgomp" in line for line in maps):
                return False
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    done = pause(1) == 0  # 1: omp_pause_soft
    if not done:
        log.debug("omp_pause_resource_all refused: this thread's OpenMP pool is kept")
    return done


@contextlib.contextmanager
def side_thread_torch_work():
    """Torch work on a thread the steps do not run on (an actor's control thread staging experts): with the
    actor's thread count (:func:`adopt_torch_threads`), and that thread's OpenMP pool freed after
    (:func:`release_openmp_pool`), so the steps' pool stays the only one."""
    adopt_torch_threads()
    try:
        yield
    finally:
        release_openmp_pool()
