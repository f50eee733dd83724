"""The serving app in this process, for the HTTP-semantics tests (tests/**/test_*inproc*.py): the
real Ingress and engine server (deploy/inprocess.py) over the in-process executor
(cluster/inprocess.py: the real attention worker, every routed expert in this process), served by
uvicorn on a loopback port — so the official clients (openai, httpx, schemathesis) talk real HTTP
to it. No Ray: these tests pass with ``import ray`` failing and without the shared conftest
(tests/test_owners.py checks it).

Preset checkpoints are built once per test process (:func:`preset`), into a directory removed at exit.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from cluster.inprocess import InProcessExecutor
from deploy.config import ServeConfig
from deploy.inprocess import InProcessServer
from tests.presets import preset  # noqa: F401  (the in-process tests' preset builder, shared)

@contextmanager
def serve(path: Path, *, admin_key: str | None = None, **settings):
    """The app for ``path`` with these serving settings (a :class:`ServeConfig`'s fields), on a free
    loopback port; yields the running :class:`InProcessServer` (``.url``), stopped on exit."""
    cfg = ServeConfig(model=str(path), **settings)
    with InProcessServer(cfg.model_dump(), str(path), executor_factory=InProcessExecutor,
                         admin_key=admin_key) as server:
        yield server


def wait_idle(server: InProcessServer, timeout_s: float = 30.0) -> None:
    """Until the engine runs and queues nothing (every request ended, cancelled ones freed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = server.engine_server.engine.snapshot
        if snap.running == 0 and snap.waiting == 0:
            return
        assert time.monotonic() < deadline, f"the engine is still busy after {timeout_s}s: {snap}"
        time.sleep(0.05)


def post(server: InProcessServer, route: str, body: dict, key: str | None = None, timeout: float = 120):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{route}", json=body, headers=headers, timeout=timeout)
