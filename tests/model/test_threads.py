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


# Each thread that runs a parallel region keeps an OpenMP pool; once the pools' threads outnumber the cores,
# libgomp throttles every pool's spin, and each parallel op on the stepping thread waits for a futex wake. Run
# in a fresh interpreter (two torch threads, as on these machines), so that no other test's pools count. A pool
# is seen by its worker threads: a parallel op on a thread without a pool makes new ones in /proc/self/task.
_POOL_SCRIPT = r'''
import asyncio, os, sys, time, torch
torch.set_num_threads(2)
tids = lambda: set(os.listdir("/proc/self/task"))
def parallel_op():  # large enough for torch to split it over its 2 threads
    torch.softmax(torch.randn(256, 4096), -1)
def makes_a_pool():
    before = tids()
    parallel_op()
    return tids() - before
def gone(workers):
    deadline = time.monotonic() + 10  # a released worker exits on its own
    while workers & tids() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not workers & tids()
mode = sys.argv[1]
if mode == "release":
    from model.threads import release_openmp_pool
    workers = makes_a_pool()
    assert workers, "the first parallel op made no OpenMP worker"
    assert not makes_a_pool(), "a second op made another pool"
    assert release_openmp_pool()
    print("released", gone(workers), "remade", bool(makes_a_pool()))
else:  # an in-process engine served from the async engine's thread, after the main thread made a pool
    from cluster.aengine import AsyncEngine
    from cluster.config import EngineConfig
    from cluster.engine import Engine
    from cluster.inprocess import InProcessExecutor
    from cluster.spec import ClusterSpec
    from cluster.stream import EngineRequest
    from model.config import load_config
    from model.sampling import SamplingParams
    path = sys.argv[2]
    cfg = EngineConfig.of(path, num_blocks=64, block_size=16)
    spec = ClusterSpec(attention=1, experts=1)
    eng = Engine(cfg, spec, executor=InProcessExecutor(cfg, spec, load_config(path))).start()
    parallel_op()  # the caller's own work on its thread: its pool now exists
    assert not makes_a_pool()
    front = AsyncEngine(eng).start()
    async def serve():
        got = []
        async for chunk in front.generate(EngineRequest((5, 6, 7, 8), SamplingParams(max_tokens=4, ignore_eos=True))):
            got += chunk.token_ids
        return got
    tokens = asyncio.run(serve())
    print("tokens", len(tokens), "main remade", bool(makes_a_pool()))
    front.stop()
    eng.shutdown()
'''


def _pool_script(*args: str) -> str:
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _POOL_SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=240, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_release_frees_the_calling_thread_s_openmp_pool_and_a_later_op_makes_a_new_one():
    assert _pool_script("release") == "released True remade True"


def test_the_async_engine_leaves_its_stepping_thread_the_only_pool(tmp_path):
    """The thread that starts the async engine gives up its pool (the steps run on the engine's thread): a
    parallel op on it afterwards has to make a new one. Without the release the main thread's pool lives on
    beside the engine thread's, and every parallel op of a step is throttled (model/threads.py)."""
    from tests.presets import preset

    assert _pool_script("engine", str(preset("kimi-k2-tiny", dtype="float32"))) == "tokens 4 main remade True"
