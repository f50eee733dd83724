"""The serving app in one process, without Ray: the same :class:`~deploy.ingress.Ingress` and
:class:`~deploy.engine_server.EngineServer` as under Serve, joined by a :class:`LocalHandle`
instead of a ``DeploymentHandle``, served by uvicorn on a loopback port from a background thread.

What it is for: HTTP semantics tested in one process (tests/**/test_*inproc*.py), with the engine
on an injected executor — cluster/inprocess.py's (the real attention worker and every routed expert
in this process) or a fake. Never: imports Ray, or stands in for the cluster's own paths (scaling,
recovery, the step channels and the exchange are tested on real Ray clusters).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time

from .engine_server import EngineServer, ExecutorFactory
from .config import ServeConfig
from .ingress import Ingress
from .routes import make_api, specialize


class _LocalStream:
    """What ``handle.options(stream=True).method.remote()`` gives: an async iterator with ``cancel``."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    def __anext__(self):
        return self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.get_running_loop().create_task(self.agen.aclose())


class _LocalMethod:
    def __init__(self, fn, stream: bool):
        self.fn, self.stream = fn, stream

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        """The call, on the caller's event loop: a task (awaitable, cancellable) or, streamed, a
        :class:`_LocalStream`."""
        out = self.fn(*args, **kwargs)
        if self.stream:
            return _LocalStream(out)
        if inspect.isawaitable(out):
            return asyncio.ensure_future(out)
        done = asyncio.get_running_loop().create_future()
        done.set_result(out)
        return done


class LocalHandle:
    """A ``DeploymentHandle`` over an object in this process: ``handle.method.remote(...)`` and
    ``handle.options(stream=True).method.remote(...)``, as the Ingress and the stream mux use them."""

    def __init__(self, target, stream: bool = False):
        self._target, self._stream = target, stream

    def options(self, stream: bool = False, **_) -> "LocalHandle":
        return LocalHandle(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name), self._stream)


class InProcessServer:
    """The app on ``http://127.0.0.1:<port>`` from this process (``port`` 0: a free one). Use as a
    context manager; :attr:`url` once started. ``executor_factory``: the engine's executor (see
    :class:`~deploy.engine_server.EngineServer`); ``admin_key``: as $MOERAY_ADMIN_KEY would give."""

    def __init__(self, raw: dict, model_path: str, *, executor_factory: ExecutorFactory,
                 admin_key: str | None = None, host: str = "127.0.0.1", port: int = 0):
        self.serve_cfg = ServeConfig.parse(raw)
        self.raw, self.model_path, self.host, self.port = self.serve_cfg.model_dump(), model_path, host, port
        self.executor_factory, self.admin_key = executor_factory, admin_key
        self.engine_server: EngineServer | None = None
        self.ingress: Ingress | None = None
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "InProcessServer":
        import uvicorn

        self.engine_server = EngineServer(self.raw, self.model_path, executor_factory=self.executor_factory)
        self.ingress = Ingress(LocalHandle(self.engine_server), self.raw, self.model_path, admin_key=self.admin_key)
        api, doc = make_api(lambda name: getattr(self.ingress, name))
        specialize(doc, self.serve_cfg, self.model_path)
        if not self.port:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(api, host=self.host, port=self.port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="moeray-inprocess-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the in-process server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        if self.engine_server is not None:
            self.engine_server.shutdown()

    def __enter__(self) -> "InProcessServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
