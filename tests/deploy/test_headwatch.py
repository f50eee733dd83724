"""The parts of surviving the head node that need no Ray (issue 38; the whole of it, on a real 3-node
cluster, is tests/deploy/test_head_loss.py): the process records `moeray down` stops by, the gate that
holds connections while the head is away, the 503 answer once the cluster is lost, what `moeray up`
decides to do when the GCS or the head's raylet stops, the serving config's GCS fault tolerance, and
the Redis `moeray up --gcs-redis local` starts."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from deploy import owned
from deploy.config import ServeConfig
from deploy.gate import Gate
from deploy.headwatch import HeadWatch, LostFront
from tests.ports import free_port


# ---- the process records -------------------------------------------------------------------------------
def test_records_stop_the_recorded_processes_and_never_a_pid_with_another_start_time():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while len(owned.with_descendants([parent.pid])) < 2:
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        family = owned.with_descendants([parent.pid])
        records = owned.record(family)
        assert {pid for pid, _ in records} == family and len(family) == 2
        wrong = [[pid, start + 1] for pid, start in records]  # the same PIDs, other processes
        assert owned.alive(wrong) == [] and owned.stop(wrong) == []
        assert all(owned.start_time(pid) is not None for pid in family)  # untouched
        assert sorted(owned.stop(records)) == sorted(family)
        assert owned.alive(records) == [] and all(owned.start_time(pid) is None for pid in family)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait()


# ---- the gate -------------------------------------------------------------------------------------------
class _Hello(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + 6))
        self.end_headers()
        self.wfile.write(b"hello " + body)

    def log_message(self, *args):
        pass


def _backend(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_gate_relays_holds_while_the_head_is_away_and_answers_503_after_its_limit():
    port, backend_port = free_port(), free_port()
    gate = Gate("127.0.0.1", port, backend_port, hold_s=20)
    server = _backend(backend_port)
    try:
        assert httpx.post(f"http://127.0.0.1:{port}/x", content=b"a" * 100_000, timeout=10).content == \
            b"hello " + b"a" * 100_000
        gate.hold()
        server.shutdown()
        server.server_close()
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(
            httpx.post(f"http://127.0.0.1:{port}/x", content=b"b", timeout=30)))
        waiting.start()
        time.sleep(1.0)
        assert gate.holding and not answers  # held, not refused
        server = _backend(backend_port)  # the new proxy listens: still held until released
        time.sleep(0.5)
        assert not answers
        gate.release()
        waiting.join(timeout=10)
        assert answers[0].status_code == 200 and answers[0].content == b"hello b"
    finally:
        server.shutdown()
        server.server_close()
        gate.close()
    short = Gate("127.0.0.1", free_port(), free_port(), hold_s=0.5)  # nothing ever listens behind it
    try:
        r = httpx.get(f"http://127.0.0.1:{short.port}/v1/models", timeout=10)
        assert r.status_code == 503 and "head node" in r.json()["error"]["message"]
    finally:
        short.close()


def test_lost_front_answers_every_request_503_with_what_to_do():
    port = free_port()
    front = LostFront("127.0.0.1", port, "moeray lost its Ray cluster: run `moeray down`")
    try:
        for r in (httpx.get(f"http://127.0.0.1:{port}/health"),
                  httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": []})):
            assert r.status_code == 503 and r.headers["retry-after"]
            assert r.json()["error"] == {"message": "moeray lost its Ray cluster: run `moeray down`",
                                         "type": "service_unavailable", "code": 503}
    finally:
        front.close()
    with socket.socket() as s:  # nothing listens there any more (a server may bind it again)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


# ---- what `moeray up` decides ----------------------------------------------------------------------------
class _Cluster:
    """The four facts and two actions HeadWatch uses of a LocalCluster (which needs Ray): scripted."""

    def __init__(self, redis: bool):
        self.gcs_redis = type("R", (), {"address": "127.0.0.1:1"})() if redis else None
        self.gcs, self.head, self.calls = True, True, []

    def gcs_alive(self):
        return self.gcs

    def head_alive(self):
        return self.head

    def process_ids(self, head_only=False):
        return []

    def restart_gcs(self):
        self.calls.append("gcs")
        self.gcs = True

    def restart_head(self):
        self.calls.append("head")
        self.gcs = self.head = True


def _watch(cluster):
    logs = []
    watch = HeadWatch(cluster, host="127.0.0.1", port=free_port(), save=lambda *a: None,
                      log=lambda *a, **k: logs.append(a[0]))
    return watch, logs


def test_with_gcs_ft_a_dead_gcs_or_head_is_started_again():
    cluster = _Cluster(redis=True)
    watch, logs = _watch(cluster)
    watch.tick()
    assert cluster.calls == []
    cluster.gcs = False
    watch.tick()
    assert cluster.calls == ["gcs"] and watch.restarts == {"gcs": 1, "head": 0}
    cluster.gcs = cluster.head = False
    watch.tick()
    assert cluster.calls == ["gcs", "head"] and not watch.lost
    assert "started it again on its Redis" in logs[-1]


def test_without_gcs_ft_the_cluster_is_lost_once_the_raylets_give_up():
    cluster = _Cluster(redis=False)
    watch, logs = _watch(cluster)
    cluster.gcs = False
    watch.tick()  # the data plane goes on until the reconnect timeout: nothing to do but say so
    assert not watch.lost and cluster.calls == [] and "reconnecting" in logs[-1]
    cluster.head = False
    watch.tick()
    try:
        assert watch.lost and cluster.calls == []
        r = httpx.get(f"http://127.0.0.1:{watch.port}/health")
        assert r.status_code == 503 and "GCS fault tolerance" in r.json()["error"]["message"]
    finally:
        watch.close()


# ---- the serving config ----------------------------------------------------------------------------------
def test_gcs_fault_tolerance_config_names_what_is_wrong(tmp_path):
    ok = ServeConfig.parse({"gcs_fault_tolerance": {"redis_address": "redis.internal:6379", "namespace": "a"}})
    assert ok.gcs_fault_tolerance.password() == ""
    for bad, says in (({"redis_address": "redis"}, "gcs_fault_tolerance.redis_address: 'redis' is not HOST:PORT"),
                      ({"redis_address": "h:99999"}, "is not HOST:PORT"),
                      ({"redis_address": "local", "extra": 1}, "gcs_fault_tolerance.extra")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            ServeConfig.parse({"gcs_fault_tolerance": bad})
    secret = tmp_path / "pw"
    secret.write_text("# the Redis password\ns3cret\n")
    cfg = ServeConfig.parse({"gcs_fault_tolerance": {"redis_address": "local", "redis_password_file": str(secret)}})
    assert cfg.gcs_fault_tolerance.password() == "s3cret"
    secret.write_text("\n")
    with pytest.raises(ValueError, match="holds no password"):
        cfg.gcs_fault_tolerance.password()


def test_local_redis_of_moeray_up_answers_and_stops(tmp_path):
    """`moeray up --gcs-redis local`: a redis-server of its own on a free loopback port, gone at stop."""
    from deploy.headwatch import LocalRedis

    redis = LocalRedis(tmp_path / "redis")
    try:
        host, port = redis.address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"SET moeray 1\r\nGET moeray\r\n")
            time.sleep(0.2)
            assert s.recv(64).startswith(b"+OK\r\n$1\r\n1")
    finally:
        redis.stop()
    assert redis.proc.poll() is not None and owned.start_time(redis.proc.pid) is None
