"""Torch's thread count in threads other than the one that set it.

``torch.set_num_threads(n)`` sizes OpenMP's pool only for the calling thread (and for torch's own
``parallel_for`` in any thread). A BLAS call (MKL, oneDNN) from another thread — an actor's step
thread, a GEMM pool's worker — uses that thread's OpenMP default instead: one thread per core.
Those threads spin between calls, so an actor told to use one thread takes every core from its
peers. Measured on 2 cores: a 512×512 GEMM loop on a new thread used 1.95 cores after
``torch.set_num_threads(1)`` in the main thread, 1.0 after :func:`adopt_torch_threads`."""

from __future__ import annotations

import torch


def adopt_torch_threads() -> None:
    """Make the calling thread's OpenMP and BLAS pools the size ``torch.set_num_threads`` gave
    (call it first thing on a thread that runs torch work)."""
    torch.set_num_threads(torch.get_num_threads())
