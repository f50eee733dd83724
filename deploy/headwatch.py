"""What `moeray up` does, while it serves, for the Ray cluster it started (`--nodes K`) when the head node
fails: with GCS fault tolerance it starts the GCS, or the whole head node, again on the same Redis (as
KubeRay restarts a head pod); without it, once the cluster is gone (the raylets exit after their
reconnect timeout), it stops what is left and answers 503 on the serving port, saying what happened and
what to do, until `moeray down`. It also records every process it started (deploy/owned.py), for `down`.

Never: serves requests, or touches a cluster it did not start (`--address`: only the bookkeeping of a
Redis it started).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from . import owned
from .gate import unavailable_body

RECORD_EVERY_S = 2.0
PROBE_EVERY_S = 5.0  # the ingress replica's address, while the gate relays through the proxy
GIVE_UP_AFTER_S = 60.0  # failed restarts (with GCS fault tolerance) for this long: the cluster is lost


def lost_message(why: str) -> str:
    return (f"moeray lost its Ray cluster: {why}, and the cluster's Ray processes have exited, so nothing is "
            "served here. Stop what is left with `moeray down` and start again with `moeray up`; to survive "
            "the loss of the head node, serve with GCS fault tolerance (`moeray up --gcs-redis ADDR`, "
            "docs/operations.md).")


class LostFront:
    """An HTTP server on the serving port that answers every request 503 with ``message`` (the
    OpenAI error shape), so that a client learns what happened instead of a refused connection or a
    500 from a proxy whose backends are gone."""

    def __init__(self, host: str, port: int, message: str) -> None:
        body = unavailable_body(message)

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(min(length, 1 << 20))
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Retry-After", "60")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _answer

            def log_message(self, *args) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="moeray-lost-front", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def bind_when_free(host: str, port: int, message: str, timeout_s: float = 10.0) -> LostFront | None:
    """A :class:`LostFront` as soon as the port is free (the processes that held it were just stopped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return LostFront(host, port, message)
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)


class LocalRedis:
    """A ``redis-server`` of `moeray up`'s own (``--gcs-redis local``), on a free loopback port, keeping
    nothing on disk: the GCS's tables outlive the GCS, not the Redis."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ValueError("--gcs-redis local needs redis-server: install it (Debian, Ubuntu: "
                             "`apt-get install redis-server`), or give --gcs-redis HOST:PORT of a Redis you run")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        workdir.mkdir(parents=True, exist_ok=True)
        self.address = f"127.0.0.1:{port}"
        with open(workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                          "--appendonly", "no", "--dir", str(workdir)],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise ValueError(f"redis-server exited at start (code {self.proc.returncode}); see {workdir / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise ValueError(f"redis-server did not answer on {self.address} within 10 s; see {workdir / 'redis.log'}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class HeadWatch:
    """Called every half second by `moeray up`'s serving loop (:meth:`tick`). ``cluster``: the
    :class:`~cluster.local.LocalCluster` it started, or None (a cluster given by --address).
    ``save(records, head_records)`` stores the records of the processes started so far, and of those of
    the head node among them (the state file)."""

    def __init__(self, cluster, *, host: str, port: int, save, gate=None, extra_pids=(), log=print) -> None:
        self.cluster = cluster
        self.gate = gate  # deploy/gate.py: holds new connections while the head node is started again
        self.ft = cluster is not None and cluster.gcs_redis is not None
        self.host, self.port = host, port
        self._save, self._extra, self._log = save, list(extra_pids), log
        self.records: list[list[int]] = []
        self.head_records: list[list[int]] = []
        self.restarts = {"gcs": 0, "head": 0}
        self.front: LostFront | None = None
        self.lost = False
        self._recorded_at = self._probed_at = 0.0
        self._failing_since: float | None = None
        self._warned = False
        self.record()

    def record(self) -> None:
        """Note every process started so far (Ray's, their children, a Redis of ours), for `moeray down`."""
        self._recorded_at = time.monotonic()
        if self.cluster is not None:
            self.head_records = _merge(self.head_records, owned.record(
                owned.with_descendants(self.cluster.process_ids(head_only=True)) - {os.getpid()}))
            ours = owned.with_descendants(self.cluster.process_ids()) - {os.getpid()}
        else:
            ours = set()
        self.records = _merge(self.records, owned.record(ours | set(self._extra)))
        self._save(self.records, self.head_records)

    def tick(self) -> None:
        if self.lost:
            return
        if time.monotonic() - self._recorded_at >= RECORD_EVERY_S:
            self.record()
        if self.gate is not None and (self.gate.holding or (self.gate.direct is None
                                                            and time.monotonic() - self._probed_at >= PROBE_EVERY_S)):
            self._probed_at = time.monotonic()
            server = self._app_answers()
            if server is not None and self.gate.holding:
                self.gate.release()
                self._log("moeray up: the app answers through the new head node's proxy; connections go through "
                          "again", flush=True)
            if server is not None and server[1] != self.gate.backend_port:
                self.gate.relay_to(server)
        cluster = self.cluster
        if cluster is None or (cluster.gcs_alive() and cluster.head_alive()):
            self._failing_since = None
            return
        if self.ft:
            self._restart(cluster)
            return
        why = "the head node's GCS stopped and the cluster has no GCS fault tolerance"
        if not self._warned:
            self._warned = True
            self._log("moeray up: the Ray head's GCS stopped; without GCS fault tolerance the cluster stops "
                      "when its raylets give up reconnecting (RAY_gcs_rpc_server_reconnect_timeout_s, 60 s "
                      "by default)", flush=True)
            if self.gate is not None:
                self.gate.doom(lost_message(why))  # the replica answers until it goes; then 503, not a 500
        if cluster.head_alive():  # no GCS: the data plane goes on until the raylets' reconnect timeout
            return
        self.lose(why)

    def _restart(self, cluster) -> None:
        what = "gcs" if cluster.head_alive() else "head"
        t0 = time.monotonic()
        try:
            if what == "head":
                if self.gate is not None:
                    self.gate.hold()  # until the app answers through the proxy Serve starts on the new head
                # what the old head left running (its workers' children: Serve's HAProxy) goes first
                owned.stop(self.head_records, grace_s=1.0)
                self.head_records = []
                cluster.restart_head()
            else:
                cluster.restart_gcs()
        except Exception as e:  # keep serving what still runs; try again next tick, give up after a while
            self._failing_since = self._failing_since or t0
            self._log(f"moeray up: starting the {'GCS' if what == 'gcs' else 'head node'} again failed: {e!r}",
                      flush=True)
            if time.monotonic() - self._failing_since > GIVE_UP_AFTER_S and not cluster.head_alive():
                self.lose(f"the head node stopped and could not be started again on its Redis "
                          f"({cluster.gcs_redis.address}): {e}")
            return
        self._failing_since = None
        self.restarts[what] += 1
        self._log(f"moeray up: the {'GCS' if what == 'gcs' else 'head node'} stopped; started it again on its "
                  f"Redis ({cluster.gcs_redis.address}) in {time.monotonic() - t0:.1f} s", flush=True)
        self.record()

    def lose(self, why: str) -> None:
        """The cluster is gone: stop what is left of it (the port's holders among them), answer 503."""
        self.lost = True
        message = lost_message(why)
        self._log(f"moeray up: {message}", flush=True)
        owned.stop([r for r in self.records if r[0] not in self._extra], grace_s=0.5)  # a dead cluster's
        if self.gate is not None:  # it answers 503 from now on: the replica it relayed to is gone
            self.gate.doom(message)
            self.gate.relay_to(None)
            return
        self.front = bind_when_free(self.host, self.port, message)
        if self.front is None:
            self._log(f"moeray up: could not answer on {self.host}:{self.port} (it is still taken)", flush=True)

    def _app_answers(self) -> tuple[str, int] | None:
        """The address of the HTTP server that answered the app's /health through Serve's proxy (behind the
        gate): the ingress replica's own with Serve's direct ingress, else the proxy's; None: no 200."""
        try:
            r = httpx.get(f"http://{self.host}:{self.gate.backend_port}/health", timeout=2)
            host, _, port = (r.json().get("server") or "").rpartition(":")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if r.status_code != 200:
            return None
        return (host, int(port)) if host and port.isdigit() else (self.host, self.gate.backend_port)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()
        if self.front is not None:
            self.front.close()


def _merge(old: list[list[int]], new: list[list[int]]) -> list[list[int]]:
    """The records of ``old`` whose process still runs, and ``new``'s."""
    seen = {tuple(r) for r in owned.alive(old)}
    return [list(r) for r in sorted(seen | {tuple(r) for r in new})]
